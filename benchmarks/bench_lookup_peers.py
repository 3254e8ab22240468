"""Our prompt lookup beside llama.cpp's `llama-lookup`, on held-out code edits (issue 46's peer rows).

For each model (the default model's F16 and Q8_0 copies, the real Qwen2.5-Coder-1.5B Q4_K_M) and
each edit of benchmarks/workloads/heldout_edit.py (a file no other benchmark or replay uses, so the
policy was never tuned on it), one round runs, in an order that rotates from round to round: our
`off`, `lookup` and `auto` (edgeinfer's Engine, greedy, decode tok/s from its stats) and
`llama-lookup` at fixed draft lengths (its "decoded N tokens in S seconds"). Same prompt text
(rendered by edgeinfer's chat template, the reply started with a code fence as editors do;
llama.cpp parses special tokens), same token budget, same thread count; medians over rounds.
Each of our rows is run once before the timed rounds, as a user's store would be warm (the cost
curve the engine keeps); every run of ours has a fresh suffix-memory scope (no row remembers
its own earlier answers: llama-lookup here has no -lcd cache either). The tools come from benchmarks/build_llama_tools.sh.

    .venv/bin/python -m benchmarks.bench_lookup_peers [--models f16,q8_0,1.5b] [--edits rename,add]
        [--tokens 256] [--rounds 3] [--drafts 3,8] [--threads 2] [--home DIR]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile
from pathlib import Path

from benchmarks._store import use_home
from benchmarks.bench_batch_curve import TOOLS
from benchmarks.bench_llama_peers import tool_run

_RUNS = itertools.count()
HELDOUT = Path(__file__).parent / "workloads" / "heldout_edit.py"
EDITS = {
    "rename": "Rename the function free_places to open_places everywhere in this file and return the whole file.",
    "add": "Add a function is_full(session) after free_places that returns True when no place is free, and "
           "return the whole file.",
    "plan": "Change the plan checks so that a member whose plan is \"team\" may book like a premium member, and "
            "return the whole file.",
}


def edit_messages(kind: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{EDITS[kind]}\n\n```python\n{HELDOUT.read_text()}```"}]


def model_paths(names: list[str], store) -> dict[str, str]:
    """Store refs (bench:f16, bench:q8_0: the shipped Q4_1 dequantized, then requantized; made once
    per store) or the 1.5B's path."""
    import warnings

    from edgeinfer.default_model import default_model_file
    from edgeinfer.quantize import quantize_model

    out = {}
    for q in (n for n in ("f16", "q8_0") if n in names):
        if store.find(f"bench:{q}") is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if store.find("bench:f16") is None:
                    quantize_model(default_model_file(), "F16", store=store, allow_requantize=True, name="bench")
                if q != "f16":
                    quantize_model("bench:f16", q.upper(), store=store, name="bench")
        out[q] = f"bench:{q}"
    if "1.5b" in names:
        from tests.real_models import qwen_pair

        out["1.5b"] = str(qwen_pair()[0])
    return out


def ours(engine, prompt: list[int], tokens: int, method: str) -> tuple[float, list[int], int]:
    """(decode tok/s, tokens, drafted tokens) of one greedy generation."""
    import edgeinfer

    engine.reset()
    # A fresh memory scope per run: `auto` would otherwise draft this very answer from its own
    # earlier runs (suffix memory), which llama-lookup without -lcd cannot.
    spec = edgeinfer.SpeculationOptions(method=method, memory_scope=f"peers-{next(_RUNS)}")
    opts = edgeinfer.GenerateOptions(max_tokens=tokens, sampling=edgeinfer.SamplingOptions(temperature=0.0),
                                     speculation=spec)
    done = engine.generate(prompt, opts).result()
    sp = done.stats.speculation
    return done.stats.decode_tok_s, done.tokens, (sp.drafted if sp is not None else 0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="f16,q8_0,1.5b")
    ap.add_argument("--edits", default="rename,add")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--drafts", default="3,8", help="llama-lookup's --spec-draft-n-max values")
    ap.add_argument("--ours", default="off,lookup,auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--home", help="EDGEINFER_HOME to use and keep (default: a temporary store)")
    args = ap.parse_args()
    if not (TOOLS / "llama-lookup").exists():
        raise SystemExit(f"llama.cpp tools not found in {TOOLS}: run benchmarks/build_llama_tools.sh")
    tmp = use_home(args.home, "edgeinfer-peers-")
    import edgeinfer

    store = edgeinfer.Store()
    names = [m.strip().lower() for m in args.models.split(",") if m.strip()]
    paths = model_paths(names, store)
    files = {n: store.resolve(p)[0] for n, p in paths.items()}  # llama-lookup takes the file
    methods = [m.strip() for m in args.ours.split(",") if m.strip()]
    drafts = [d.strip() for d in args.drafts.split(",") if d.strip()]
    print(f"{args.tokens} tokens, greedy, {args.threads} threads, medians of {args.rounds} rotating rounds; "
          f"load average {os.getloadavg()[0]:.1f} at start")
    for name in names:
        with edgeinfer.load(paths[name], n_ctx=4096, n_threads=args.threads, flash_attn=False, store=store) as engine:
            for kind in args.edits.split(","):
                text = engine.render_chat(edit_messages(kind)) + "```python\n"
                prompt = engine.tokenize(text, add_special=False, parse_special=True)
                prompt_file = Path(tempfile.mkdtemp(prefix="edgeinfer-peers-")) / "prompt.txt"
                prompt_file.write_text(text)
                common = ["-f", str(prompt_file), "-n", str(args.tokens), "-t", str(args.threads), "-c", "4096",
                          "--temp", "0", "--top-k", "1"]
                for m in methods:  # warm: the engine's cost curve in the store, as a user's would be
                    ours(engine, prompt, min(args.tokens, 32), m)
                rows = [f"ours {m}" for m in methods] + [f"llama-lookup {d}" for d in drafts]
                seen: dict[str, list[float]] = {r: [] for r in rows}
                drafted: dict[str, list[int]] = {r: [] for r in rows}
                texts: dict[str, list[int]] = {}
                for rnd in range(args.rounds):
                    for row in rows[rnd % len(rows):] + rows[: rnd % len(rows)]:
                        if row.startswith("ours"):
                            tok_s, toks, n = ours(engine, prompt, args.tokens, row.split()[1])
                            texts.setdefault(row, toks)
                            drafted[row].append(n)
                        else:
                            tok_s, _ = tool_run([str(TOOLS / "llama-lookup"), "-m", str(files[name]),
                                                 "--spec-draft-n-max", row.split()[1], *common])
                        seen[row].append(tok_s)
                med = {r: statistics.median(v) for r, v in seen.items()}
                best_peer = max((r for r in rows if r.startswith("llama")), key=med.__getitem__)
                plain = med.get("ours off")
                print(f"\n{name} {kind}: prompt {len(prompt)} tokens; load average {os.getloadavg()[0]:.1f}")
                print("| row | decode tok/s | × our off | × best llama-lookup | drafted | same text as off | runs |")
                print("| --- | ---: | ---: | ---: | --- | --- | --- |")
                for r in rows:
                    same = "–" if r not in texts or "ours off" not in texts else str(texts[r] == texts["ours off"])
                    print(f"| {r} | {med[r]:.2f} | {med[r] / plain if plain else float('nan'):.2f} | "
                          f"{med[r] / med[best_peer]:.2f} | {','.join(map(str, drafted[r])) or '–'} | {same} | "
                          f"{', '.join(f'{v:.1f}' for v in seen[r])} |")
    print(f"\nload average {os.getloadavg()[0]:.1f} at end")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
