"""Decode speed by thread count and OpenMP wait policy, on an idle machine and beside one busy process.

llama.cpp's CPU backend runs OpenMP workers that spin while they wait for each other
(OMP_WAIT_POLICY=ACTIVE behaviour). When another process holds a core, a spinning worker waits for a
thread that is not running, and one-token decode collapses. This measures what the default thread
count and wait policy should be: each configuration in its own process (the policy is read when
llama.cpp loads), rows alternating, medians.

    .venv/bin/python -m benchmarks.bench_threads [--model PATH | --pair] [--threads 1,2] [--rounds 3]
        [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time
import edgeinfer
path, threads, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with edgeinfer.load(path, n_ctx=1024, n_threads=threads) as engine:
    prompt = engine.chat_tokens([{"role": "user", "content": "Write a long story about a lighthouse keeper."}])
    opts = edgeinfer.GenerateOptions(max_tokens=tokens, sampling=edgeinfer.SamplingOptions(temperature=0.0),
                                     speculation=edgeinfer.SpeculationOptions(method="off"))
    engine.generate(prompt[:16], edgeinfer.GenerateOptions(max_tokens=2)).result()  # warm up
    done = engine.generate(prompt, opts).result()
    print(json.dumps({"decode_tok_s": done.stats.decode_tok_s, "tokens": done.stats.generated_tokens}))
"""

BUSY = "import time\nend = time.time() + 3600\nwhile time.time() < end: pass\n"


def run(model: str, threads: int, policy: str, tokens: int) -> float:
    env = dict(os.environ)
    if policy == "unset":
        env.pop("OMP_WAIT_POLICY", None)
    else:
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run([sys.executable, "-c", CHILD, model, str(threads), str(tokens)], env=env,
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"child failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["decode_tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="GGUF path (default: the default model)")
    ap.add_argument("--pair", action="store_true", help="the real Qwen2.5-Coder-1.5B target")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--policies", default="unset,PASSIVE")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    if args.pair:
        from tests.real_models import qwen_pair

        model = str(qwen_pair()[0])
    elif args.model:
        model = args.model
    else:
        from edgeinfer.default_model import default_model_file

        model = str(default_model_file())
    threads = [int(t) for t in args.threads.split(",")]
    policies = args.policies.split(",")
    results: dict[tuple[str, int, str], list[float]] = {}
    load0 = os.getloadavg()[0]
    for _ in range(args.rounds):
        for background in ("idle", "1 busy process"):
            busy = subprocess.Popen([sys.executable, "-c", BUSY]) if background != "idle" else None
            try:
                time.sleep(0.5 if busy else 0)
                for t in threads:
                    for p in policies:
                        results.setdefault((background, t, p), []).append(run(model, t, p, args.tokens))
            finally:
                if busy:
                    busy.kill()
                    busy.wait()
    print(f"{os.path.basename(model)}, greedy, {args.tokens} tokens, median of {args.rounds} alternating rounds, "
          f"{os.cpu_count()} cores; load average {load0:.1f} → {os.getloadavg()[0]:.1f}")
    print("\n| background | threads | OMP_WAIT_POLICY | decode tok/s (median) | runs |")
    print("| --- | --- | --- | --- | --- |")
    for (background, t, p), v in results.items():
        print(f"| {background} | {t} | {p} | {statistics.median(v):.1f} | {', '.join(f'{x:.1f}' for x in v)} |")


if __name__ == "__main__":
    main()
