"""Pull benchmarks against the local Hub server (tests/hub_server.py), which runs in its own process.

1. Download throughput of one ~200 MB GGUF: `edgeinfer.pull` (which also hashes every byte,
   keeps a resumable partial file, validates the GGUF and registers it) vs the raw client's
   `huggingface_hub.hf_hub_download` of the same file (which verifies nothing). Each round starts
   from an empty cache; the two alternate, so shared load on the machine hits both alike.
2. Time from `pull` of the safetensors test repo (the default model exported to HF format:
   download, convert, quantize per profile) to the first token of an answer.

    .venv/bin/python benchmarks/bench_pull.py [--rounds 5] [--size-mb 200] [--skip-ttft]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(1, str(ROOT))  # the checkout, also when not installed


def serve(spec_file: str) -> None:
    """Child process: serve the repos described in the JSON file until stdin closes."""
    from hub_server import HubServer

    spec = json.loads(Path(spec_file).read_text())
    with HubServer() as hub:
        for repo, files in spec.items():
            hub.add_repo(repo, {name: Path(p) for name, p in files.items()})
        print(hub.url, flush=True)
        sys.stdin.read()


def start_server(spec: dict[str, dict[str, str]], work: Path) -> tuple[subprocess.Popen, str]:
    spec_file = work / "repos.json"
    spec_file.write_text(json.dumps(spec))
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(spec_file)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    url = proc.stdout.readline().strip()  # type: ignore[union-attr]
    if not url.startswith("http"):
        raise SystemExit("the hub server did not start")
    return proc, url


def make_gguf(path: Path, size_mb: int) -> Path:
    from hub_server import tiny_gguf

    rows = size_mb * (1 << 20) // (256 * 4)
    return tiny_gguf(path, "F16", rows=rows, seed=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--size-mb", type=int, default=200)
    ap.add_argument("--skip-ttft", action="store_true")
    args = ap.parse_args()
    if args.serve:
        return serve(args.serve)

    work = Path(tempfile.mkdtemp(prefix="bench-pull-"))
    try:
        big = make_gguf(work / "big.gguf", args.size_mb)
        spec = {"bench/Big-GGUF": {"Big-F16.gguf": str(big)}}
        st_folder = None
        if not args.skip_ttft:
            from hf_models import export_default_model_to_hf

            st_folder = export_default_model_to_hf(work / "st", "bfloat16")
            spec["bench/SmolLM2-135M-Instruct"] = {
                p.relative_to(st_folder).as_posix(): str(p) for p in st_folder.rglob("*") if p.is_file()
            }
        server, url = start_server(spec, work)
        # huggingface_hub reads these once, at import: set them first.
        os.environ["HF_ENDPOINT"] = url
        os.environ["HF_HOME"] = str(work / "hf-home")
        os.environ["EDGEINFER_HOME"] = str(work / "edgeinfer-home")
        os.environ.pop("HF_HUB_OFFLINE", None)
        try:
            throughput(work, big, args.rounds)
            if st_folder is not None:
                ttft(work)
        finally:
            server.stdin.close()  # type: ignore[union-attr]
            server.wait(timeout=30)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def throughput(work: Path, big: Path, rounds: int) -> None:
    from huggingface_hub import constants, hf_hub_download

    import edgeinfer
    from edgeinfer.store import Store

    size = big.stat().st_size

    def fresh_cache() -> None:
        shutil.rmtree(constants.HF_HUB_CACHE, ignore_errors=True)

    def ours() -> float:
        fresh_cache()
        marks: dict[str, float] = {}

        def on_progress(ev: object) -> None:
            if isinstance(ev, edgeinfer.PullStage) and ev.stage not in marks:
                marks[ev.stage] = time.perf_counter()

        t = time.perf_counter()
        r = edgeinfer.pull("bench/Big-GGUF:F16", on_progress=on_progress)
        end = time.perf_counter()
        assert r.downloaded_bytes == size
        Store().remove(r.manifest.ref)
        whole.append(end - t)
        return marks["validate"] - t  # metadata + download + sha256 + placing the blob and symlink

    def raw() -> float:
        fresh_cache()
        t = time.perf_counter()
        p = hf_hub_download("bench/Big-GGUF", "Big-F16.gguf")
        dt = time.perf_counter() - t
        assert Path(p).stat().st_size == size
        return dt

    whole: list[float] = []
    ours(), raw()  # warm up: imports, page cache of the served file
    whole.clear()
    times: dict[str, list[float]] = {"edgeinfer.pull": [], "hf_hub_download": []}
    for i in range(rounds):
        pair = [("edgeinfer.pull", ours), ("hf_hub_download", raw)]
        for name, fn in pair if i % 2 == 0 else reversed(pair):
            times[name].append(fn())
    print(f"\n## Download throughput: one {size / 1e6:.0f} MB file, {rounds} rounds each, alternating, fresh cache\n")
    print("| client (what is timed) | median s | median MB/s | min s | max s |")
    print("|---|---:|---:|---:|---:|")
    rows = {
        "edgeinfer.pull (metadata, download, sha256, place in cache)": times["edgeinfer.pull"],
        "hf_hub_download (HEAD, download, place in cache; no hash)": times["hf_hub_download"],
        "edgeinfer.pull end to end (+ GGUF validation, manifest with fsync)": whole,
    }
    for name, ts in rows.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.3f} | {size / 1e6 / med:.0f} | {min(ts):.3f} | {max(ts):.3f} |")
    ratio = statistics.median(times["edgeinfer.pull"]) / statistics.median(times["hf_hub_download"])
    paired = statistics.median(a / b for a, b in zip(times["edgeinfer.pull"], times["hf_hub_download"]))
    for name, ts in times.items():
        print(f"\n{name} per round (s): {', '.join(f'{t:.3f}' for t in ts)}", end="")
    print()
    total = statistics.median(whole) / statistics.median(times["hf_hub_download"])
    print(f"\ndownload overhead of edgeinfer.pull vs hf_hub_download (median time ratio − 1): "
          f"{100 * (ratio - 1):+.1f} % (median of per-round ratios: {100 * (paired - 1):+.1f} %); "
          f"end to end: {100 * (total - 1):+.1f} %")


def ttft(work: Path) -> None:
    import edgeinfer
    from edgeinfer import GenerateOptions, SamplingOptions, TokenEvent

    stages: dict[str, float] = {}
    t0 = time.perf_counter()
    last = [t0]

    def on_progress(ev: object) -> None:
        if isinstance(ev, edgeinfer.PullStage):
            now = time.perf_counter()
            stages[ev.stage] = now - t0
            last[0] = now

    r = edgeinfer.pull("bench/SmolLM2-135M-Instruct", profile="balanced", on_progress=on_progress)
    t_pull = time.perf_counter() - t0
    engine = edgeinfer.load(r.manifest.ref, n_ctx=512)
    t_load = time.perf_counter() - t0
    gen = engine.generate("The capital of France is", GenerateOptions(max_tokens=4, sampling=SamplingOptions(temperature=0)))
    first = None
    for ev in gen:  # drained, not left with `break`: engine.close() waits for an unfinished generation
        if isinstance(ev, TokenEvent) and first is None:
            first = time.perf_counter() - t0
    engine.close()
    print(f"\n## Safetensors repo → first token (default model exported to HF bf16, profile balanced → {r.manifest.quant})\n")
    print("| step | seconds since `pull` started |")
    print("|---|---:|")
    dl_end = stages.get("convert", t_pull)
    print(f"| download {sum(f.size for f in r.plan.files) / 1e6:.0f} MB + verify | {dl_end:.2f} |")
    print(f"| convert to F16 done | {stages.get('quantize', 0):.2f} |")
    print(f"| quantize + register done | {t_pull:.2f} |")
    print(f"| model loaded | {t_load:.2f} |")
    print(f"| first token | {first:.2f} |" if first is not None else "| first token | (none) |")


if __name__ == "__main__":
    main()
