"""Drafting heads on this machine: what a drafted token costs in target steps, and what the policy
does with it (issue 28).

Without --model: the tiny checkpoints of tests/test_heads.py, converted by our converter — a random
Qwen3.5 with its MTP layer, a token-only one whose head agrees with it (hf_models.token_only_mtp),
each also "heavy" (12 layers, FFN 2048: a trunk that outweighs the head's output layer, as a real
model's does), and a tiny qwen3 with a random EAGLE-3 drafter. With --model: a real model that has
an MTP layer (e.g. `edgeinfer pull Qwen/Qwen3.5-2B`), on the code-edit and free-chat workloads.

Rows: plain; the head at fixed lengths (every step drafts k, p_min 0); the head adaptive (the
policy's choice; "adapt p0": without the p_min stop, llama.cpp's default, where a draft stopped by
p_min has paid a decode for nothing); auto (head or lookup per step). Greedy; decode tok/s excluding prefill, the
median of --rounds rounds alternating the rows; "cost" is the head's measured drafted token in
target steps (stats.speculation.draft_cost), "steps" drafting / plain steps. Every row must give
plain's tokens (checked).

    .venv/bin/python -m benchmarks.bench_heads [--rounds 5] [--tokens 200] [--threads 1]
    .venv/bin/python -m benchmarks.bench_heads --model qwen3.5-2b:q4_k_m [--tokens 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tiny_models(root: Path) -> dict[str, tuple[Path, str | None]]:
    """name -> (GGUF, EAGLE-3 drafter GGUF or None)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from hf_models import make_random_eagle3_drafter, make_random_hf_model, make_random_qwen35_model, token_only_mtp

    from edgeinfer.convert import convert_model

    heavy = {"layer_types": (("linear_attention",) * 3 + ("full_attention",)) * 3, "intermediate": 2048}
    out: dict[str, tuple[Path, str | None]] = {}
    for name, kw, outtype in (("random", {}, "f32"), ("agree", {"edit": token_only_mtp("agree")}, "f32"),
                              ("heavy-random", heavy, "f16"),
                              ("heavy-agree", {**heavy, "edit": token_only_mtp("agree")}, "f16")):
        src = make_random_qwen35_model(root / name, tied=False, **kw)
        out[name] = (convert_model(src, outtype, root / f"{name}.gguf", register=False).path, None)
    target = make_random_hf_model(root / "qwen3", "qwen3", layers=8, heads=4, kv_heads=2, tied=False)
    drafter = make_random_eagle3_drafter(root / "qwen3-eagle3", target, aux_layers=[1, 4, 6])
    t = convert_model(target, "f32", root / "qwen3.gguf", register=False).path
    d = convert_model(drafter, "f32", root / "qwen3-eagle3.gguf", register=False, target=target).path
    out["qwen3+eagle3"] = (t, str(d))
    return out


def rows_for(method: str, drafter: str | None, ks: tuple[int, ...]) -> dict[str, object]:
    import edgeinfer

    spec = edgeinfer.SpeculationOptions
    extra = {"draft_model": drafter} if drafter else {}
    rows: dict[str, object] = {"plain": spec()}
    for k in ks:
        rows[f"{method} k={k}"] = spec(method=method, adaptive=False, draft_max=k, p_min=0.0, **extra)
    rows[f"{method} adaptive"] = spec(method=method, **extra)
    rows[f"{method} adapt p0"] = spec(method=method, p_min=0.0, **extra)  # no p_min stop (llama.cpp's default)
    if method == "mtp":
        rows["auto"] = spec(method="auto")
    return rows


def measure(engine, prompts: dict[str, list[int]], rows: dict[str, object], tokens: int, rounds: int) -> list[dict]:
    import edgeinfer

    results: dict[tuple[str, str], list] = {}
    for _ in range(rounds):
        for pname, prompt in prompts.items():
            for rname, spec in rows.items():
                engine.reset()  # each row reads the same prompt from an empty cache
                opts = edgeinfer.GenerateOptions(max_tokens=tokens, sampling=edgeinfer.SamplingOptions(temperature=0.0),
                                                 speculation=spec)
                results.setdefault((pname, rname), []).append(engine.generate(prompt, opts).result())
    out = []
    for pname in prompts:
        plain = results[(pname, "plain")]
        base = statistics.median(d.stats.decode_tok_s for d in plain)
        for rname in rows:
            done = results[(pname, rname)]
            tok_s = statistics.median(d.stats.decode_tok_s for d in done)
            sp = done[-1].stats.speculation
            out.append({
                "prompt": pname, "row": rname, "tok_s": tok_s, "ratio": tok_s / base if base else 0.0,
                "same": all(d.tokens == plain[0].tokens for d in done),
                "cost": sp.draft_cost if sp else 0.0,
                "accepted": f"{sp.accepted}/{sp.drafted}" if sp else "",
                "per_pos": ",".join(f"{a:.2f}" for a in sp.per_position_acceptance) if sp else "",
                "steps": f"{sp.steps}/{sp.plain_steps}" if sp else "",
                "note": sp.note if sp else "",
            })
    return out


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n#### {title}")
    print(f"{'prompt':12} {'row':16} {'tok/s':>7} {'ratio':>6} {'same':>4} {'cost':>5} {'accepted':>9} "
          f"{'steps':>8}  per-position acceptance / note")
    for r in rows:
        tail = r["per_pos"] + (f"  ({r['note']})" if r["note"] else "")
        print(f"{r['prompt']:12} {r['row']:16} {r['tok_s']:7.1f} {r['ratio']:6.2f} {'yes' if r['same'] else 'NO':>4} "
              f"{r['cost']:5.2f} {r['accepted']:>9} {r['steps']:>8}  {tail}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="a real model with an MTP layer (store name or .gguf path)")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("EDGEINFER_THREADS", "2")))
    ap.add_argument("--only", default="", help="comma-separated tiny models to run (default: all)")
    args = ap.parse_args()

    import edgeinfer

    print(f"{args.threads} threads, {args.tokens} tokens, median of {args.rounds} rounds, load average "
          f"{os.getloadavg()[0]:.1f} at start")
    if args.model:
        from benchmarks.bench_speculative import workloads

        with edgeinfer.load(args.model, n_ctx=4096, n_threads=args.threads) as engine:
            engine.prepare_speculation("mtp")
            prompts = {}
            for name, (messages, reply_start) in workloads().items():
                if name != "RAG quote":
                    prompts[name] = engine.tokenize(engine.render_chat(messages) + reply_start, add_special=False,
                                                    parse_special=True)
            print_table(f"{engine.name}", measure(engine, prompts, rows_for("mtp", None, (1, 2, 3, 4)),
                                                  args.tokens, args.rounds))
    else:
        with tempfile.TemporaryDirectory(prefix="edgeinfer-heads-") as tmp:
            store = edgeinfer.Store(Path(tmp) / "store")
            only = {n.strip() for n in args.only.split(",") if n.strip()}
            for name, (path, drafter) in tiny_models(Path(tmp)).items():
                if only and name not in only:
                    continue
                method = "eagle3" if drafter else "mtp"
                with edgeinfer.load(path, n_ctx=1024, n_threads=args.threads, store=store) as engine:
                    engine.prepare_speculation(f"eagle3={drafter}" if drafter else "mtp")
                    prompts = {"counting": list(range(100, 140)), "other": list(range(300, 380, 2))}
                    print_table(name, measure(engine, prompts, rows_for(method, drafter, (1, 3)), args.tokens,
                                              args.rounds))
    print(f"\nload average {os.getloadavg()[0]:.1f} at end")


if __name__ == "__main__":
    main()
