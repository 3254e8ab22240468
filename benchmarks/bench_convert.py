"""Conversion speed and peak memory on a synthetic ~1.2B-parameter llama checkpoint in bf16, FP8 or AWQ.

The checkpoint (Llama-3.2-1B dimensions: hidden 2048, 16 layers, 32 heads / 8 KV heads, FFN 8192,
vocab 128256, tied embeddings; random bf16 weights, the default model's tokenizer padded to the
vocab) is written to a temp dir and deleted afterwards. Each conversion runs in its own child
process that reports its own peak RSS (VmHWM of /proc/self/status) and the RSS it had before
converting (imports). Not ru_maxrss: Linux carries the high-water mark of the pre-exec image into it,
so a child forked from this process after it built a quantized checkpoint reported this process's
RSS (1,448 MB for FP8, 1,131 MB for AWQ on 2026-12-01), not the converter's; it is printed next to
VmHWM for comparison.

With --source fp8 (E4M3, 128x128 block scales) or awq (4-bit GEMM, groups of 128), the bf16
checkpoint is quantized tensor by tensor with the tests' independent packers (tests/quant_checkpoints.py)
into a second checkpoint (embeddings stay bf16), which is what gets converted; MB/s counts its bytes.

    .venv/bin/python benchmarks/bench_convert.py [--keep DIR] [--outtypes f16,q8_0] [--layers 16]
        [--source bf16|fp8|awq]

The child also samples /proc/self/status every 2 ms: the peaks of RssAnon (heap: what
the converter allocates) and RssFile (pages of the memory-mapped checkpoint, which the kernel can drop
at will; not a leak). --tracemalloc also reports the peak of the buffers numpy holds at once (it
reports its allocations to tracemalloc), which tells the converter's own arrays apart from what the C
allocator keeps.

With --keep DIR the checkpoints are built in DIR (and DIR-fp8 / DIR-awq) once and reused by later runs.

What `--outtype auto` saves against dequantize -> requantize is measured on real weights by
benchmarks/bench_direct_quant.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

CHILD = r"""
import json, resource, sys, threading, time, tracemalloc
from edgeinfer.convert import convert_model
def status():
    out = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[k] = int(v.split()[0])
    return out
peaks, stop = {}, threading.Event()
def sample():
    while not stop.is_set():
        for k, v in status().items():
            peaks[k] = max(peaks.get(k, 0), v)
        stop.wait(0.002)
before = status()
if sys.argv[4] == "1":
    tracemalloc.start()
sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
t0 = time.perf_counter()
r = convert_model(sys.argv[1], sys.argv[2], sys.argv[3], register=False)
dt = time.perf_counter() - t0
stop.set(); sampler.join()
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"seconds": dt, "cpu_seconds": ru.ru_utime + ru.ru_stime, "source_bytes": r.source_bytes,
                  "output_bytes": r.output_bytes, "rss_before_kb": before["VmRSS"], "anon_before_kb": before["RssAnon"],
                  "peak_rss_kb": status()["VmHWM"], "ru_maxrss_kb": ru.ru_maxrss, "peak_anon_kb": peaks.get("RssAnon", 0), "peak_file_kb": peaks.get("RssFile", 0),
                  "traced_peak": tracemalloc.get_traced_memory()[1] if tracemalloc.is_tracing() else None}))
"""


def write_synthetic_llama(folder: Path, layers: int, seed: int = 0) -> tuple[int, int]:
    """Write the bf16 checkpoint one tensor per file write; returns (parameters, largest tensor bytes)."""
    from hf_models import write_tokenizer

    hidden, heads, kv_heads, ffn, vocab = 2048, 32, 8, 8192, 128256
    hd = hidden // heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * hd, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * hd, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * hd, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * hd),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (ffn, hidden),
            p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn),
        }
    shapes["model.norm.weight"] = (hidden,)
    # Random bf16 bit patterns of magnitude ~0.004..0.06, tiled from one 8 Mi-element block (fast to write).
    rng = np.random.default_rng(seed)
    block = (rng.integers(119 << 7, 123 << 7, 8 << 20, dtype=np.uint16) | (rng.integers(0, 2, 8 << 20, dtype=np.uint16) << 15))
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for n, s in shapes.items():
        nb = math.prod(s) * 2
        header[n] = {"dtype": "BF16", "shape": list(s), "data_offsets": [offset, offset + nb]}
        offset += nb
    hj = json.dumps(header).encode()
    hj += b" " * (-len(hj) % 8)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(len(hj).to_bytes(8, "little") + hj)
        for n, s in shapes.items():
            count = math.prod(s)
            if len(s) == 1:
                f.write(np.full(count, 0x3F80, np.uint16).tobytes())  # 1.0
                continue
            for start in range(0, count, block.size):
                f.write(block[: min(block.size, count - start)].tobytes())
    write_tokenizer(folder, "llama-bpe")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": True, "vocab_size": vocab, "torch_dtype": "bfloat16",
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    }
    (folder / "config.json").write_text(json.dumps(config))
    params = sum(math.prod(s) for s in shapes.values())
    largest = max(math.prod(s) for s in shapes.values()) * 2
    return params, largest


def _kept_sizes(folder: Path) -> tuple[int, int]:
    """(parameters, largest tensor bytes) of a checkpoint an earlier run wrote."""
    with open(folder / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    header.pop("__metadata__", None)
    sizes = [math.prod(spec["shape"]) for spec in header.values()]
    return sum(sizes), max(sizes) * 2


def quantize_checkpoint(src: Path, dst: Path, fmt: str) -> int:
    """Quantize every decoder linear layer of `src` (written above) into `dst`, one tensor in memory at a
    time (data to a side file, then header + data); returns the largest stored tensor's bytes."""
    from quant_checkpoints import LINEAR, _config, _layer

    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.is_file() and p.suffix != ".safetensors" and p.name != "config.json":
            shutil.copy(p, dst / p.name)
    raw = open(src / "model.safetensors", "rb")
    n = int.from_bytes(raw.read(8), "little")
    header = json.loads(raw.read(n))
    header.pop("__metadata__", None)
    data_start = 8 + n
    out_header: dict = {"__metadata__": {"format": "pt"}}
    offset, largest = 0, 0
    rng = np.random.default_rng(1)
    side = dst / "data.tmp"
    with open(side, "wb") as f:
        for name, spec in header.items():
            b, e = spec["data_offsets"]
            raw.seek(data_start + b)
            bits = np.frombuffer(raw.read(e - b), np.uint16)
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and module.split(".", 3)[-1] in LINEAR:
                w = (bits.astype(np.uint32) << 16).view(np.float32).reshape(spec["shape"])
                parts, _ = _layer(name, w, "fp8-block" if fmt == "fp8" else fmt, {}, rng)
                items = [(f"{module}.{k}", code, np.ascontiguousarray(a)) for k, (code, a) in parts.items()]
            else:
                items = [(name, "BF16", bits.reshape(spec["shape"]))]
            for tname, code, a in items:
                blob = a.tobytes()
                out_header[tname] = {"dtype": code, "shape": list(a.shape), "data_offsets": [offset, offset + len(blob)]}
                f.write(blob)
                offset += len(blob)
                largest = max(largest, len(blob))
    raw.close()
    hj = json.dumps(out_header).encode()
    hj += b" " * (-len(hj) % 8)
    with open(dst / "model.safetensors", "wb") as out, open(side, "rb") as f:
        out.write(len(hj).to_bytes(8, "little") + hj)
        shutil.copyfileobj(f, out, 64 << 20)
    side.unlink()
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = _config("fp8-block" if fmt == "fp8" else fmt, {})
    (dst / "config.json").write_text(json.dumps(config))
    return largest


def run_child(src: Path, outtype: str, out: Path, trace: bool = False) -> dict:
    env = dict(os.environ, EDGEINFER_HOME=str(out.parent / "home"))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(src), outtype, str(out), "1" if trace else "0"], env=env,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"conversion to {outtype} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outtypes", default="f16,q8_0")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--keep", type=Path, help="build the checkpoint here and keep it")
    ap.add_argument("--source", choices=["bf16", "fp8", "awq"], default="bf16",
                    help="checkpoint format to convert (fp8/awq: quantized from the synthetic bf16 one)")
    ap.add_argument("--tracemalloc", action="store_true", help="also report the peak of numpy's live buffers (slower)")
    args = ap.parse_args()
    from edgeinfer.cli._common import print_table

    if args.keep:
        args.keep.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-convert-", dir=args.keep.parent if args.keep else None))
    src = args.keep or (tmp / "synthetic-llama-1b")
    src.mkdir(parents=True, exist_ok=True)
    try:
        t = time.perf_counter()
        if args.keep and (src / "config.json").is_file():
            params, largest = _kept_sizes(src)
            how = "kept from an earlier run"
        else:
            params, largest = write_synthetic_llama(src, args.layers)
            how = f"written in {time.perf_counter() - t:.0f}s"
        size = (src / "model.safetensors").stat().st_size
        print(f"synthetic llama: {params / 1e9:.2f}B parameters, {size / 1e9:.2f} GB bf16, largest tensor "
              f"{largest / 1e6:.0f} MB (token_embd), {how}", flush=True)
        if args.source != "bf16":
            t = time.perf_counter()
            qsrc = src.with_name(f"{src.name}-{args.source}") if args.keep else tmp / f"synthetic-llama-1b-{args.source}"
            if not (args.keep and (qsrc / "config.json").is_file()):
                quantize_checkpoint(src, qsrc, args.source)
                if not args.keep:
                    shutil.rmtree(src)
                how = f"quantized in {time.perf_counter() - t:.0f}s"
            else:
                how = "kept from an earlier run"
            src = qsrc
            print(f"{args.source} checkpoint: {(src / 'model.safetensors').stat().st_size / 1e9:.2f} GB, {how}", flush=True)
        rows = []
        for outtype in args.outtypes.split(","):
            out = tmp / f"out-{outtype}.gguf"
            r = run_child(src, outtype, out, args.tracemalloc)
            out.unlink()
            peak = r["peak_rss_kb"] * 1024
            base = r["rss_before_kb"] * 1024
            rows.append([
                outtype,
                f"{r['seconds']:.1f}",
                f"{r['cpu_seconds']:.1f}",
                f"{r['source_bytes'] / 1e6 / r['seconds']:.0f}",
                f"{r['output_bytes'] / 1e9:.2f}",
                f"{peak / 1e6:.0f}",
                f"{r['ru_maxrss_kb'] * 1024 / 1e6:.0f}",
                f"{r['peak_anon_kb'] * 1024 / 1e6:.0f}",
                f"{r['peak_file_kb'] * 1024 / 1e6:.0f}",
                "–" if r["traced_peak"] is None else f"{r['traced_peak'] / 1e6:.0f}",
                f"{base / 1e6:.0f}",
                f"{peak / largest:.2f}",
                f"{(peak - base) / largest:.2f}",
            ])
            print(f"  {outtype}: done", flush=True)
        print()
        print_table(rows, ["OUTTYPE", "WALL S", "CPU S", "MB/S (src, wall)", "OUT GB", "PEAK RSS MB", "RU_MAXRSS MB", "PEAK ANON MB", "PEAK FILE MB",
                           "NUMPY PEAK MB", "RSS AT START MB",
                           "PEAK/LARGEST", "(PEAK-START)/LARGEST"])
        print(f"\nload average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (wall time depends on it, CPU time less)")
        print(f"largest tensor: {largest / 1e6:.0f} MB (bf16 source); target: peak <= 2x largest + 300 MB "
              f"= {(2 * largest + 300e6) / 1e6:.0f} MB")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
