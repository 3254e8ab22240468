"""`edgeinfer tune`'s floors: its choice against the untuned defaults and against an exhaustive search,
measured by this benchmark's own loop after `tune` ran (not by tune's numbers), and its KLD by eval.

    .venv/bin/python -m benchmarks.bench_tune --model 1.5b --home /work/tune-bench/home-1.5b \\
        [--budget 10m] [--exhaustive] [--rounds 3] [--space "--methods off,lookup --kv-types f16,q8_0"]
    .venv/bin/python -m benchmarks.bench_tune --model default --home DIR ...

1. The store (`--home`, kept between runs): `1.5b` registers the real Qwen2.5-Coder-1.5B-Instruct
   Q4_K_M and 0.5B from tests/real_models.py (the 0.5B is a draft model of the same vocabulary),
   dequantizes the 1.5B's Q4_K_M to F16 (no original weights reach this machine: the F16 holds the
   Q4_K_M's values) and quantizes the ladder from it; `default` does the same from the default
   model's Q4_1. Every rung's KLD is then against that F16, measured once here (`eval` on tune's
   four chunks, kept in the manifests: the ladder a user has evaluated; tune measures only the
   cache types' KLD itself).
2. `edgeinfer tune MODEL --budget B --json` in a subprocess, timed.
3. With --exhaustive: `edgeinfer tune MODEL --exhaustive --no-save --json` on the same space (the
   measurements tune took are reused; the rest are measured on the whole workload). `--compare
   SETUP_JSON` puts an earlier exhaustive search's best in the side by side instead.
4. The separate benchmark: the tuned setup, the exhaustive search's best and the untuned defaults
   (`run MODEL` without a profile: LoadOptions(), no speculation), each loaded once per round and run
   on the whole workload, every request from an empty cache, greedy, timed from its submission to its
   last token (the engine loaded: loads are not counted, as in tune); rounds alternate the order;
   medians. The machine's load average is printed beside every figure.
5. The chosen rung and cache types against the reference with `evaluate_many` (eval's function) on
   every chunk of the evaluation text, not tune's four.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

LADDERS = {"1.5b": ("qwen2.5-coder-1.5b-instruct", "q4_k_m", ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_S", "Q3_K_L", "Q3_K_M", "Q2_K")),
           "default": ("smollm2-135m-instruct", "q4_1", ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "Q3_K_M", "Q2_K"))}


def load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def prepare(which: str) -> str:
    """The ladder in the store (idempotent); returns the model to tune."""
    from edgeinfer import Store
    from edgeinfer.quantize import quantize_model

    name, root_tag, types = LADDERS[which]
    store = Store()
    if which == "1.5b":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from real_models import qwen_pair

        big, small = qwen_pair()
        for path, n in ((big, name), (small, "qwen2.5-coder-0.5b-instruct")):
            if store.find(f"{n}:q4_k_m") is None:
                store.register(path, n, "q4_k_m", owned=False, source={"kind": "file", "note": "tests/real_models.py"})
    else:
        store.ensure_default_model()
    if store.find(f"{name}:f16") is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantize_model(f"{name}:{root_tag}", "F16", store=store)
    for t in types:
        if store.find(f"{name}:{t.lower()}") is None:
            t0 = time.monotonic()
            r = quantize_model(f"{name}:f16", t, store=store)
            print(f"made {r.ref} ({r.bits_per_weight:.2f} bits/weight) in {time.monotonic() - t0:.0f} s", flush=True)
    unmeasured = [m.ref for m in store.list() if m.name == name and m.tag != "f16"
                  and (m.metrics.get("eval") or {}).get("reference") != f"{name}:f16"]
    if unmeasured:  # what `edgeinfer eval --chunks 4 --reference NAME:f16 RUNG` keeps in each manifest
        from edgeinfer.evaluate import evaluate_many
        from edgeinfer.tune.quality import QUALITY_CHUNKS

        t0 = time.monotonic()
        for r in evaluate_many(unmeasured, f"{name}:f16", chunks=QUALITY_CHUNKS, store=store, save=True):
            print(f"KLD {r.model}: {r.kld:.4f} ± {r.kld_stderr:.4f} (same top {r.same_top * 100:.1f} %)", flush=True)
        print(f"evaluated {len(unmeasured)} rungs in {time.monotonic() - t0:.0f} s", flush=True)
    return f"{name}:{root_tag}"


def tune_cli(model: str, *args: str) -> tuple[dict, float]:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "edgeinfer", "tune", model, "--json", *args], capture_output=True,
                       text=True, env=os.environ.copy())
    seconds = time.monotonic() - t0
    if r.returncode != 0:
        sys.exit(f"tune failed ({r.returncode}): {r.stderr[-2000:]}")
    return json.loads(r.stdout), seconds


def run_workload(setup, workload) -> tuple[float, float]:  # noqa: ANN001 - edgeinfer.tune types
    """(tok/s, median time to first token) of the whole workload: every request from an empty cache."""
    from edgeinfer import load as load_model

    with load_model(setup.model, setup.load_options()) as engine:
        engine.prepare_speculation(setup.speculation())
        tokens, seconds, ttfts = 0, 0.0, []
        for item in workload.items:
            messages, options = item.chat_messages(setup.model), item.options(setup.speculation())
            engine.reset()
            t0 = time.perf_counter()
            done = engine.chat(messages, options).result()
            seconds += time.perf_counter() - t0
            tokens += done.stats.generated_tokens
            ttfts.append(done.stats.ttft_s)
    return tokens / seconds, statistics.median(ttfts)


def side_by_side(setups: dict, rounds: int) -> dict[str, list[tuple[float, float]]]:
    from edgeinfer.tune import default_workload

    workload = default_workload()
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in setups}
    names = list(setups)
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            tok_s, ttft = run_workload(setups[name], workload)
            runs[name].append((tok_s, ttft))
            print(f"  round {r + 1} {name:<12} {tok_s:6.2f} tok/s  ttft {ttft:5.2f} s   {load()}", flush=True)
    return runs


def verify_kld(setup, reference: str) -> tuple[float, float, int]:  # noqa: ANN001
    from edgeinfer.evaluate import evaluate_many

    r = evaluate_many([setup.model], reference, save=False, model_kv_types=[(setup.kv_type_k, setup.kv_type_v)])[0]
    return r.kld, r.kld_stderr, r.positions


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(LADDERS), required=True)
    ap.add_argument("--home", required=True, help="EDGEINFER_HOME (kept: the ladder is made once)")
    ap.add_argument("--budget", default="10m")
    ap.add_argument("--space", default="", help="flags limiting the space, given to both tune runs")
    ap.add_argument("--exhaustive", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-tune", action="store_true", help="use the stored profile (a tune already ran)")
    ap.add_argument("--compare", help="one more setup in the side by side, as tune's JSON writes one (e.g. an "
                    "earlier exhaustive search's best, without running that search again)")
    args = ap.parse_args()
    os.environ["EDGEINFER_HOME"] = args.home

    from edgeinfer import Store, tuned_status
    from edgeinfer.tune import Setup, untuned_setup

    model = prepare(args.model)
    space = shlex.split(args.space)
    print(f"model {model}, space {args.space or '(all)'}; {load()}", flush=True)
    if not args.skip_tune:
        result, seconds = tune_cli(model, "--budget", args.budget, *space)
        print(f"tune: {seconds:.0f} s wall for a {args.budget} budget; chose {result['choice']['label']} "
              f"predicted {result['choice']['measurement']['tok_s']:.2f} tok/s (level "
              f"{result['choice']['measurement']['level']}), KLD {result['choice']['kld']:.4f}; "
              f"{len(result['rows'])} setups measured, speed-up over its baseline {result['speedup']}; {load()}",
              flush=True)
    store = Store()
    profile = tuned_status(store, store.get(model)).profile
    assert profile is not None
    setups = {"tuned": profile.setup, "untuned": untuned_setup(model)}
    if args.exhaustive:
        exh, seconds = tune_cli(model, "--exhaustive", "--no-save", *space)
        best = exh["choice"]
        setups["exhaustive"] = Setup.from_dict(best["setup"])
        print(f"exhaustive: {seconds:.0f} s wall, {len(exh['rows'])} setups on the whole workload; best "
              f"{best['label']} {best['measurement']['tok_s']:.2f} tok/s, KLD {best['kld']:.4f}; {load()}", flush=True)
        rows = sorted(exh["rows"], key=lambda r: -r["measurement"]["tok_s"])
        for r in rows[:12]:
            print(f"  {'*' if r['chosen'] else 'F' if r['on_frontier'] else ' '} {r['label']:<48} "
                  f"{r['measurement']['tok_s']:6.2f} tok/s  KLD {r['kld'] if r['kld'] is None else round(r['kld'], 4)}")
        if setups["exhaustive"] == setups["tuned"]:
            del setups["exhaustive"]
            print("  (the exhaustive search's best is tune's choice)")
    if args.compare:
        setups["exhaustive"] = Setup.from_dict(json.loads(args.compare))
    print(f"side by side, {args.rounds} rounds, alternating:", flush=True)
    runs = side_by_side(setups, args.rounds)
    med = {k: statistics.median(t for t, _ in v) for k, v in runs.items()}
    for k, v in runs.items():
        print(f"  {k:<12} median {med[k]:6.2f} tok/s (runs {', '.join(f'{t:.2f}' for t, _ in v)}), "
              f"ttft {statistics.median(f for _, f in v):.2f} s: {setups[k].label(short_model=False)}")
    print(f"tuned / untuned: {med['tuned'] / med['untuned']:.3f}x")
    if "exhaustive" in med:
        print(f"tuned / exhaustive best: {med['tuned'] / med['exhaustive']:.3f}x")
    predicted = profile.predicted.get("tok_s", 0.0)
    print(f"tune's prediction {predicted:.2f} tok/s vs measured {med['tuned']:.2f}: "
          f"{(predicted / med['tuned'] - 1) * 100:+.1f} %")
    kld, err, positions = verify_kld(profile.setup, profile.reference)
    print(f"eval: {profile.setup.model} with a {profile.setup.kv_type_k}/{profile.setup.kv_type_v} cache against "
          f"{profile.reference}: KLD {kld:.4f} ± {err:.4f} over {positions} positions (bound {profile.max_kld}); {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
