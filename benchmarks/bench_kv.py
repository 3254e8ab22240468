"""KV-cache types at long contexts: memory, prefill and decode speed, and quality, per type.

For each context size (default 8192 tokens) and each KV type (K = V), a fresh child process loads
the model with that cache, prefills the eval text (repeated as needed) up to the context size
minus the `--decode` tokens it then decodes greedily; it reports llama.cpp's own KV buffer size, prefill and decode
tok/s and its peak RSS. Rows alternate types within each round (the machine is shared and noisy);
the table shows medians and each type's ratio to f16. With --kld, each type's cost against the same
weights with an f16 cache (KLD, same-top; evaluate_kv's measurement, the f16 reference computed once)
on --kld-ctx-token chunks of the eval text, the last --kld-scored positions of each.

    .venv/bin/python benchmarks/bench_kv.py [--model REF] [--depths 8192,16384] [--types f16,q8_0,q4_0]
        [--rounds 3] [--decode 64] [--threads 2] [--kld] [--kld-ctx 4096] [--kld-only]

On a shared machine use --threads 1: with two threads on two busy cores an 8k prefill of the
default model ran at 8.8 tok/s and decode at 0.1 tok/s (2026-12-01, load 10-14).

llama.cpp's published figure for comparison: a q8_0 K+V cache costs LLaMA-3-8B a KLD of about 0.0016
against f16 (llama.cpp PR #7412's perplexity/KLD table).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = r"""
import json, re, resource, sys
import edgeinfer
from edgeinfer.engine.llama.runtime import log_capture
from edgeinfer.evaluate import default_eval_text
model, kv, depth, n_decode, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
lines = []
with log_capture(lambda level, text: lines.append(text)):
    engine = edgeinfer.load(model, n_ctx=depth, n_threads=threads, kv_type=kv)
kv_mib = sum(float(m) for m in re.findall(r"KV buffer size =\s*([\d.]+) MiB", "".join(lines)))
text_ids = engine.tokenize(default_eval_text())
n_prompt = depth - n_decode - 8  # the context holds the prompt and the decoded tokens
prompt = (text_ids * (n_prompt // len(text_ids) + 1))[:n_prompt]
opts = edgeinfer.GenerateOptions(max_tokens=n_decode, sampling=edgeinfer.SamplingOptions(temperature=0.0))
done = engine.generate(prompt, opts).result()
engine.close()
s = done.stats
print(json.dumps({"kv_mib": kv_mib, "prefill_tok_s": s.prefill_tok_s, "decode_tok_s": s.decode_tok_s,
                  "generated": s.generated_tokens, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def vs_f16(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}"  # None: no f16 row to compare with


def run_child(model: str, kv: str, depth: int, decode: int, threads: int) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, model, kv, str(depth), str(decode), str(threads)],
                       capture_output=True, text=True, cwd=HERE.parent)
    if r.returncode != 0:
        raise SystemExit(f"{kv} at {depth}: child failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def kv_quality(model: str, types: list[str], ctx: int, scored: int, threads: int) -> list[tuple[float, float, float, int]]:
    """(KLD, its stderr, same-top, positions) of each type against an f16 cache, as evaluate_kv
    measures it, but with the f16 reference computed once for every type."""
    import numpy as np

    import edgeinfer
    from edgeinfer.evaluate import default_eval_text, log_softmax, make_chunks

    def rows(kv: str) -> list[np.ndarray]:
        with edgeinfer.load(model, n_ctx=ctx, n_threads=threads, kv_type=kv) as engine:
            tokens = engine.tokenize(default_eval_text(), add_special=True)
            bos = engine.tokenize("", add_special=True)
            chunks = make_chunks(tokens, ctx, None, bos[0] if bos else None)
            return [log_softmax(engine.logits(c, start=ctx - 1 - scored)[:-1]) for c in chunks]

    ref = rows("f16")
    out = []
    for kv in types:
        lps = ref if kv == "f16" else rows(kv)
        kld = np.concatenate([(np.exp(r) * (r - lp)).sum(axis=1) for r, lp in zip(ref, lps)])
        same = np.concatenate([r.argmax(axis=1) == lp.argmax(axis=1) for r, lp in zip(ref, lps)])
        out.append((float(kld.mean()), float(kld.std(ddof=1) / np.sqrt(kld.size)), float(same.mean()), int(kld.size)))
        print(f"KLD {kv}: {out[-1][0]:.5f} ± {out[-1][1]:.5f}, same top {out[-1][2]:.4f} ({kld.size} positions)",
              file=sys.stderr, flush=True)
    return out


def main() -> None:
    from edgeinfer.kv_types import KV_TYPE_NAMES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="store ref or .gguf path (default: the default model)")
    ap.add_argument("--depths", default="8192", help="comma-separated context depths in tokens")
    ap.add_argument("--types", default=",".join(KV_TYPE_NAMES), help="comma-separated KV types (K = V)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode", type=int, default=64, help="tokens decoded after the prefill")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kld", action="store_true", help="also measure KLD/same-top against an f16 cache")
    ap.add_argument("--kld-ctx", type=int, default=4096, help="chunk size of the KLD measurement")
    ap.add_argument("--kld-scored", type=int, default=512, help="positions scored at the end of each chunk")
    ap.add_argument("--kld-only", action="store_true", help="only the KLD/same-top table (no speed rows)")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()

    from edgeinfer.store import Store

    model = str(Store().resolve(args.model)[0])
    types = [t.strip().lower() for t in args.types.split(",") if t.strip()]
    if args.kld_only:
        print(f"model {model}: KV-cache types against an f16 cache, KLD at ctx {args.kld_ctx}, "
              f"last {args.kld_scored} positions of each chunk, {args.threads} threads")
        print("| KV type | KLD | ± | same-top % | positions |")
        print("|---|---|---|---|---|")
        for t, (kld, se, same, n) in zip(types, kv_quality(model, types, args.kld_ctx, args.kld_scored, args.threads)):
            print(f"| {t} | {kld:.5f} | {se:.5f} | {same * 100:.2f} | {n} |")
        return
    depths = [int(d) for d in args.depths.split(",")]
    rows = []
    for depth in depths:
        samples: dict[str, list[dict]] = {t: [] for t in types}
        for r in range(args.rounds):
            order = types if r % 2 == 0 else types[::-1]  # alternate, so drift hits every type alike
            for t in order:
                samples[t].append(run_child(model, t, depth, args.decode, args.threads))
                print(f"depth {depth} round {r + 1} {t}: {samples[t][-1]}", file=sys.stderr)
        base = statistics.median(s["decode_tok_s"] for s in samples["f16"]) if "f16" in samples else None
        for t in types:
            med = {k: statistics.median(s[k] for s in samples[t]) for k in ("kv_mib", "prefill_tok_s", "decode_tok_s", "peak_rss_mb")}
            rows.append({"depth": depth, "type": t, **med, "decode_vs_f16": med["decode_tok_s"] / base if base else None})
    if args.kld:
        for row, (kld, se, same, n) in zip((r for r in rows if r["depth"] == depths[0]),
                                           kv_quality(model, types, args.kld_ctx, args.kld_scored, args.threads)):
            row |= {"kld": kld, "kld_stderr": se, "same_top": same, "kld_positions": n}

    print(f"model {model}, {args.rounds} rounds (medians), decode {args.decode} tokens after the prefill, "
          f"{args.threads} threads" + (f"; KLD at ctx {args.kld_ctx}, last {args.kld_scored} positions" if args.kld else ""))
    head = "| depth | KV type | KV MiB | prefill tok/s | decode tok/s | decode vs f16 | peak RSS MB |" + (" KLD | same-top % |" if args.kld else "")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for row in rows:
        line = (f"| {row['depth']} | {row['type']} | {row['kv_mib']:.1f} | {row['prefill_tok_s']:.0f} | "
                f"{row['decode_tok_s']:.1f} | {vs_f16(row['decode_vs_f16'])} | {row['peak_rss_mb']:.0f} |")
        if args.kld:
            kld = row.get("kld")
            line += f" {kld:.5f} | {row['same_top'] * 100:.2f} |" if kld is not None else " - | - |"
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
