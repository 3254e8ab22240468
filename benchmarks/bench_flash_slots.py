"""Flash attention on and off for the server engine's decode step: N slots with a KV stream each
(or, `--unified`, one KV cache for every slot), one row per slot, after D tokens of context in every
slot (what `BatchEngine` runs once its prompts are in). Both settings on contexts of their own over
the same file, alternating, medians.

The single-sequence verdict (engine/llama/flash_choice.py) is measured on one sequence; this shows whether
it holds for the server's rows (each attends over its own slot's stream; in one cache, over every
slot's cells: N x D of them).

    .venv/bin/python -m benchmarks.bench_flash_slots [--model PATH] [--slots 1,4,8] [--depth 512]
        [--steps 16] [--rounds 3] [--threads 2] [--unified]   # default: the default model and the real 1.5B
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def models(given: str | None) -> dict[str, Path]:
    if given:
        return {Path(given).name: Path(given)}
    from edgeinfer.default_model import default_model_file
    from tests.real_models import qwen_pair

    return {"SmolLM2-135M (default)": Path(default_model_file()), "Qwen2.5-Coder-1.5B": Path(qwen_pair()[0])}


def step_seconds(path: Path, slots: int, depth: int, steps: int, rounds: int, threads: int,
                 unified: bool = False) -> dict[bool, float]:
    from edgeinfer.engine.llama.runtime import DecodeRows, LlamaRuntime
    from edgeinfer.engine.core.options import LoadOptions

    rts = {fa: LlamaRuntime(path, LoadOptions(n_ctx=8 * (depth + steps + 64), n_threads=threads, flash_attn=fa),
                            n_seq_max=8, kv_unified=unified) for fa in (True, False)}
    try:
        for rt in rts.values():
            for s in range(slots):
                for start in range(0, depth, 256):
                    rows = DecodeRows()
                    rows.extend([100 + (i + s) % 300 for i in range(start, min(depth, start + 256))], start, s, None)
                    rt.decode_batch(rows)
        times: dict[bool, list[float]] = {True: [], False: []}
        for rnd in range(rounds):
            for fa in ((True, False) if rnd % 2 == 0 else (False, True)):
                rt = rts[fa]
                t0 = time.perf_counter()
                for k in range(steps):
                    rows = DecodeRows()
                    for s in range(slots):
                        rows.add(200 + k, depth + k, s, True)
                    rt.decode_batch(rows)
                times[fa].append((time.perf_counter() - t0) / steps)
                for s in range(slots):
                    rt.seq_rm(s, depth)
        return {fa: statistics.median(v) for fa, v in times.items()}
    finally:
        for rt in rts.values():
            rt.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--slots", default="1,4,8")
    ap.add_argument("--depth", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--unified", action="store_true", help="one KV cache for every slot (kv_unified)")
    args = ap.parse_args()
    print(f"| model | slots | step, flash attention on | off | off's speed × on's |  (depth {args.depth} a slot, "
          f"{'one cache' if args.unified else 'a stream per slot'}, {args.threads} threads, median of {args.rounds})")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, path in models(args.model).items():
        for slots in (int(s) for s in args.slots.split(",")):
            t = step_seconds(path, slots, args.depth, args.steps, args.rounds, args.threads, args.unified)
            print(f"| {name} | {slots} | {t[True] * 1000:.1f} ms | {t[False] * 1000:.1f} ms | {t[True] / t[False]:.2f}× |",
                  flush=True)


if __name__ == "__main__":
    main()
