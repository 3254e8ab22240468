"""llama.cpp's own speculation on the real pair, beside its plain decode: the peers of bench_real_pair.

Rows, alternating within each round, medians: `llama-bench -p 0 -n N -d DEPTH` (plain decode after
the prompt's depth), `llama-lookup` (n-gram lookup) and `llama-speculative` with the 0.5B as draft
model, each with llama.cpp's default draft length (3) and with 8. Greedy (--temp 0), 2 threads, the
same prompt text as bench_real_pair (rendered by edgeinfer's chat template; llama.cpp's examples
parse special tokens). The tools come from benchmarks/build_llama_tools.sh.

    .venv/bin/python -m benchmarks.bench_llama_peers [--workload "code edit"]
        [--tokens 256] [--rounds 3] [--drafts 3,8] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
from pathlib import Path

from benchmarks.bench_batch_curve import TOOLS
from benchmarks.replay_speculation import pair_workloads

DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
ACCEPT = re.compile(r"accept\s+=\s+([\d.]+)%")


def tool_run(cmd: list[str]) -> tuple[float, float | None]:
    """(decode tok/s, acceptance) from a llama-lookup / llama-speculative run."""
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    text = out.stdout + out.stderr
    m = DECODED.search(text)
    if out.returncode != 0 or not m:
        raise SystemExit(f"{Path(cmd[0]).name} failed ({out.returncode}): {text.strip().splitlines()[-3:]}")
    a = ACCEPT.search(text)
    return int(m.group(1)) / float(m.group(2)), (float(a.group(1)) / 100 if a else None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="code edit", choices=list(pair_workloads()))
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--drafts", default="3,8")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not (TOOLS / "llama-lookup").exists():
        raise SystemExit(f"llama.cpp tools not found in {TOOLS}: run benchmarks/build_llama_tools.sh")

    import edgeinfer
    from tests.real_models import qwen_pair

    target, draft = map(str, qwen_pair())
    messages, start = pair_workloads()[args.workload]
    with edgeinfer.load(target, n_ctx=4096, n_threads=1) as engine:
        text = engine.render_chat(messages) + start
        depth = len(engine.tokenize(text, add_special=False, parse_special=True))
    prompt_file = Path(tempfile.mkdtemp(prefix="edgeinfer-peers-")) / "prompt.txt"
    prompt_file.write_text(text)
    common = ["-f", str(prompt_file), "-n", str(args.tokens), "-t", str(args.threads), "-c", "4096",
              "--temp", "0", "--top-k", "1"]
    rows: dict[str, list[tuple[float, float | None]]] = {}
    load0 = os.getloadavg()[0]
    for _ in range(args.rounds):
        bench = subprocess.run([str(TOOLS / "llama-bench"), "-m", target, "-p", "0", "-n", str(args.tokens),
                                "-d", str(depth), "-t", str(args.threads), "-r", "1", "-o", "json"],
                               capture_output=True, text=True, check=True, timeout=1800)
        rows.setdefault("plain (llama-bench tg)", []).append((float(json.loads(bench.stdout)[0]["avg_ts"]), None))
        for n in args.drafts.split(","):
            rows.setdefault(f"llama-lookup, draft {n}", []).append(tool_run(
                [str(TOOLS / "llama-lookup"), "-m", target, "--spec-draft-n-max", n, *common]))
            rows.setdefault(f"llama-speculative 0.5B, draft {n}", []).append(tool_run(
                [str(TOOLS / "llama-speculative"), "-m", target, "-md", draft, "--spec-draft-n-max", n,
                 "-td", str(args.threads), *common]))
    plain = statistics.median(v for v, _ in rows["plain (llama-bench tg)"])
    print(f"{args.workload}: prompt depth {depth}, {args.tokens} tokens, {args.threads} threads, greedy, median of "
          f"{args.rounds} alternating rounds; load average {load0:.1f} → {os.getloadavg()[0]:.1f}\n")
    print("| llama.cpp row | decode tok/s | × plain | acceptance | runs |")
    print("| --- | --- | --- | --- | --- |")
    for name, runs in rows.items():
        tok_s = statistics.median(v for v, _ in runs)
        acc = [a for _, a in runs if a is not None]
        print(f"| {name} | {tok_s:.2f} | {tok_s / plain:.2f} | {statistics.median(acc) if acc else '–'} | "
              f"{', '.join(f'{v:.1f}' for v, _ in runs)} |")


if __name__ == "__main__":
    main()
