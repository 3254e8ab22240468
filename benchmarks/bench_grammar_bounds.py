"""The per-token cost of the heaviest grammars the bounds accept (issue 45): each grammar is checked
and compiled as a request's would be (engine/structured/llg.py: bounds.py first, then llguidance
with LIMITS), then driven for `--steps` tokens chosen at random among those its mask allows (seeded);
reported: compile time and the median and worst mask time per token, on a model's vocabulary
(Qwen2.5's 152k tokens by default). A grammar that exhausts llguidance's per-step budget ends with
the error a request would get (its row says where).

    .venv/bin/python benchmarks/bench_grammar_bounds.py [--model PATH.gguf] [--steps 64]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

QWEN = Path.home() / ".cache/edgeinfer-test-models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"


def heavy_grammars() -> dict[str, dict]:
    alt = " | ".join(f'"{chr(97 + i % 26)}{i}"' for i in range(128))
    nested = "root ::= " + "(" * 31 + '"a" | "b" [0-9]*' + ")" * 31 + "*"
    classes = "root ::= (" + " | ".join(f"[{chr(97 + i % 26)}-z]{{1,{i + 1}}}" for i in range(128)) + ")+"
    chain = "root ::= r0\n" + "\n".join(f'r{i} ::= ("x" | "y" r{i + 1})' for i in range(254)) + '\nr254 ::= "z"'
    return {
        "128 identical alternatives, repeated": {"grammar": 'root ::= (' + " | ".join(['"a"'] * 128) + ")+"},
        "128 distinct literals, repeated": {"grammar": f"root ::= ({alt})+"},
        "31 nested starred groups": {"grammar": nested},
        "128 bounded classes, repeated": {"grammar": classes},
        "255-rule chain": {"grammar": chain},
        "enum of 3,000 strings": {"json_schema": {"enum": [f"value-{i}-{'x' * (i % 40)}" for i in range(3000)]}},
        "8 levels of 3-way anyOf": {"json_schema": _any_of(8)},
        "pattern (a|aa)*b{1,200}": {"json_schema": {"type": "string", "pattern": "^(a|aa)*b{1,200}$"}},
        "any JSON": {"json_schema": {}},
    }


def _any_of(depth: int) -> dict:
    if depth == 0:
        return {"type": "string", "maxLength": 40}
    return {"anyOf": [{"type": "object", "properties": {"k": _any_of(depth - 1)}, "required": ["k"]},
                      {"type": "array", "items": _any_of(depth - 1), "maxItems": 3}, {"type": "integer"}]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(QWEN))
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    os.environ.setdefault("EDGEINFER_HOME", "/tmp/bench-grammar-bounds")
    import edgeinfer
    from edgeinfer.engine.core.options import GenerateOptions
    from edgeinfer.engine.structured.llg import LIMITS, Constraint

    with edgeinfer.load(args.model, n_ctx=256, n_threads=1) as engine:
        runtime = engine._runtime  # (a benchmark of the engine's internals: the sampler's matcher itself)
        t0 = time.perf_counter()
        Constraint(runtime, edgeinfer.Grammar('root ::= "x"'))
        print(f"tokenizer for {Path(args.model).name}: {time.perf_counter() - t0:.2f} s (once per loaded model)")
        print(f"limits: {json.dumps(LIMITS)}; uptime: {os.popen('uptime').read().strip()}\n")
        print("| grammar | compile ms | tokens | median mask ms | worst mask ms | ended by |")
        print("| --- | ---: | ---: | ---: | ---: | --- |")
        worst_all = 0.0
        for name, spec in heavy_grammars().items():
            rng = random.Random(45)
            t0 = time.perf_counter()
            try:
                grammar = GenerateOptions(**spec).validate().resolved_grammar()
                c = Constraint(runtime, grammar)
            except edgeinfer.InvalidOptionError as e:
                print(f"| {name} | refused: {e} | | | | |")
                continue
            compile_ms = (time.perf_counter() - t0) * 1000
            times, ended = [], "steps"
            try:
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    mask = c.mask()
                    times.append((time.perf_counter() - t0) * 1000)
                    allowed = np.flatnonzero(mask)
                    allowed = [t for t in allowed if not runtime.is_eog(int(t))] or list(allowed)
                    if not allowed:
                        ended = "no token"
                        break
                    token = int(rng.choice(allowed))
                    if runtime.is_eog(token):
                        ended = "complete"
                        break
                    c.consume(token)
            except edgeinfer.InvalidOptionError as e:
                ended = f"error: {str(e)[:80]}"
            if not times:
                print(f"| {name} | {compile_ms:.1f} | 0 | | | {ended} |")
                continue
            worst = max(times)
            worst_all = max(worst_all, worst)
            print(f"| {name} | {compile_ms:.1f} | {len(times)} | {statistics.median(times):.2f} | {worst:.2f} | {ended} |")
        print(f"\nworst mask over all: {worst_all:.1f} ms; uptime: {os.popen('uptime').read().strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
