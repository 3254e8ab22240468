"""`edgeinfer eval MODEL` (perplexity, KLD, same-top %, Δp) and `edgeinfer eval --ladder NAME` (the table)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ._common import (
    INT32_MAX,
    THREADS_HELP,
    ProgressBar,
    add_kv_options,
    add_placement_options,
    common_options,
    format_bytes,
    int_range,
    kv_options,
    placement_options,
    print_table,
    threads_type,
)

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        parents=[common_options()],
        help="measure a model's quality: perplexity, KL divergence vs a reference, same-top %%",
        description="Evaluate like llama-perplexity: chunks of --ctx tokens, the second half of each scored with the "
        "first half as context. Against a reference (default: the full-precision model this one was derived "
        "from) it adds mean KL divergence, the share of positions with the same top token, and Δp. The result "
        "is saved in the model's manifest. --ladder NAME evaluates every quant of NAME and prints the table. "
        "With --kv-type/--kv-type-k/--kv-type-v other than f16 it measures what that KV-cache quantization alone "
        "costs: the same model with an f16 cache is the reference, on chunks of --ctx 4096 tokens (default there) "
        "whose last --scored positions are scored.",
    )
    p.add_argument("model", nargs="?", help="model to evaluate (store name or .gguf path)")
    p.add_argument("--ladder", metavar="NAME", help="evaluate and tabulate every quant of store model NAME")
    p.add_argument("--reference", help="reference model (default: the full-precision model it was derived from)")
    p.add_argument("--text", help="evaluation text file (default: the text shipped with edgeinfer)")
    p.add_argument("--ctx", type=int_range(1, INT32_MAX), help="chunk size in tokens (default 512; 4096 for a KV-cache eval)")
    p.add_argument("--scored", type=int_range(1, INT32_MAX), help="score only the last N positions of each chunk "
                   "(default: its second half; 512 for a KV-cache eval)")
    add_kv_options(p)
    p.add_argument("--chunks", type=int_range(1, INT32_MAX), help="number of chunks (default: as many as the text holds)")
    p.add_argument("--threads", type=threads_type, help=THREADS_HELP)
    add_placement_options(p)
    p.add_argument("--force", action="store_true", help="--ladder: re-measure models that already have results")
    p.add_argument("--no-bench", action="store_true", help="--ladder: do not measure decode speed")
    p.set_defaults(func=run)


def _read_text(path: str | None) -> str | None:
    if path is None:
        return None
    from edgeinfer.errors import ModelNotFoundError

    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelNotFoundError(f"no such text file: {path}") from None


def _fmt(v: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if v is None else format(v * scale, spec)


def run(args: argparse.Namespace) -> int:
    from edgeinfer.errors import InvalidOptionError

    if bool(args.model) == bool(args.ladder):
        raise InvalidOptionError("give either a MODEL or --ladder NAME")
    kv = kv_options(args)
    kv_k, kv_v = kv["kv_type_k"] or kv["kv_type"], kv["kv_type_v"] or kv["kv_type"]
    if (kv_k, kv_v) != ("f16", "f16"):
        if args.ladder or args.reference:
            raise InvalidOptionError("a KV-cache eval compares MODEL with itself on an f16 cache: no --ladder or --reference")
        return _kv_eval(args, kv_k, kv_v)
    if args.ladder:
        return _ladder(args)
    from edgeinfer.evaluate import evaluate

    bar = ProgressBar("eval", None)
    try:
        result = evaluate(args.model, args.reference or "auto", text=_read_text(args.text), ctx=args.ctx or 512,
                          chunks=args.chunks, n_threads=args.threads, scored=args.scored,
                          placement=placement_options(args),
                          on_progress=lambda e: bar.update(e.chunk, e.n_chunks, label=f"eval {e.model}"))
    finally:
        bar.close()
    _print_result(result)
    return 0


def _kv_eval(args: argparse.Namespace, kv_k: str, kv_v: str) -> int:
    from edgeinfer.evaluate import evaluate_kv

    bar = ProgressBar("eval", None)
    ctx = args.ctx or 4096
    try:
        result = evaluate_kv(args.model, kv_k, kv_v, text=_read_text(args.text), ctx=ctx, chunks=args.chunks,
                             scored=args.scored or min(512, ctx // 2), n_threads=args.threads,
                             placement=placement_options(args),
                             on_progress=lambda e: bar.update(e.chunk, e.n_chunks, label=f"eval KV {kv_k}/{kv_v}"))
    finally:
        bar.close()
    print(f"KV cache   {result.kv_types} (K/V) vs f16/f16, same weights")
    _print_result(result)
    return 0


def _print_result(result) -> None:  # noqa: ANN001 - an edgeinfer.evaluate.EvalResult
    print(f"model      {result.model}")
    print(f"reference  {result.reference or '- (none: PPL only; give --reference)'}")
    print(f"scored     {result.positions} tokens in {result.chunks} chunks of {result.ctx}")
    print(f"PPL        {result.ppl:.4f}  (ln PPL ± {result.ppl_stderr:.4f})")
    if result.reference is not None:
        print(f"ref PPL    {result.ref_ppl:.4f}   ratio {result.ppl_ratio:.4f}")
        print(f"KLD        {result.kld:.6f} ± {result.kld_stderr:.6f}")
        print(f"same top   {result.same_top * 100:.2f} %")
        print(f"Δp         {result.delta_p * 100:+.3f} %   (RMS {result.rms_delta_p * 100:.3f} %)")
    print(f"time       {result.seconds:.1f}s")


def _say_busy(results: list) -> None:
    """Speeds measured on a busy machine are not saved (edgeinfer.bench): say so, or the ladder's
    decode column stays '-' without a word."""
    import sys

    busy = [r for r in results if r.load is not None and r.load.busy]
    if busy:
        load = max(busy, key=lambda r: r.load.before).load
        print(f"edgeinfer: note: decode tok/s not saved for {len(busy)} of {len(results)} models: the machine was "
              f"busy (load average {load.before:.1f} on {load.cpus} CPUs); run this again when it is idle, or "
              "`edgeinfer bench MODEL --save-busy` to keep figures marked busy", file=sys.stderr)


def _ladder(args: argparse.Namespace) -> int:
    import hashlib

    from edgeinfer.bench import bench_many
    from edgeinfer.evaluate import default_eval_text, default_reference, evaluate_many
    from edgeinfer.fit import ladder, member_label
    from edgeinfer.store import Store

    store = Store()
    ctx = args.ctx or 512
    members = ladder(args.ladder, store=store)
    reference = args.reference
    if reference is None:
        full = [m for m in members if m.bits_per_weight >= 15.9]
        reference = full[0].ref if full else next((r for m in members if (r := default_reference(m, store))), None)
    text = _read_text(args.text)
    sha = hashlib.sha256((text if text is not None else default_eval_text()).encode("utf-8")).hexdigest()

    def current(m) -> bool:  # noqa: ANN001
        ev = m.metrics.get("eval") or {}
        return (not args.force and ev.get("text_sha256") == sha and ev.get("ctx") == ctx
                and ev.get("reference") == reference and (args.chunks is None or ev.get("chunks") == args.chunks))

    todo = [m.ref for m in members if not current(m) and m.ref != reference]
    if todo:
        bar = ProgressBar("eval", None)
        try:
            evaluate_many(todo, reference, text=text, ctx=ctx, chunks=args.chunks, store=store,
                          n_threads=args.threads, placement=placement_options(args),
                          on_progress=lambda e: bar.update((e.model_index - 1) * e.n_chunks + e.chunk,
                                                           e.n_models * e.n_chunks, label=f"eval {e.model}"))
        finally:
            bar.close()
    if not args.no_bench:
        need = [m.ref for m in members if args.force or not (m.metrics.get("bench") or {}).get("decode_tok_s")]
        if need:
            bar = ProgressBar("bench", len(need))
            try:
                results = bench_many(need, prompt_tokens=128, decode_tokens=48, repeats=1, n_threads=args.threads, flash_depth=0,
                                     placement=placement_options(args),
                                     store=store, on_progress=lambda e: bar.update(max(e.model_index - 1, 0),
                                                                                   label=f"bench {e.model}"))
                bar.update(len(need), label="bench")
            finally:
                bar.close()
            _say_busy(results)
    members = ladder(args.ladder, store=store)  # re-read the saved metrics
    rows = []
    for m in members:
        ev = m.metrics.get("eval") or {}
        bench = m.metrics.get("bench") or {}
        rows.append([
            member_label(m.quant, m.tag) + (" (ref)" if m.ref == reference else ""),
            "yes" if m.source.get("imatrix") else "-",
            f"{m.bits_per_weight:.2f}",
            format_bytes(m.size),
            _fmt(ev.get("ppl"), ".3f"),
            _fmt(ev.get("ppl_ratio"), ".4f"),
            _fmt(ev.get("kld"), ".5f"),
            _fmt(ev.get("same_top"), ".2f", 100.0),
            _fmt(bench.get("decode_tok_s"), ".1f"),
        ])
    print(f"ladder {args.ladder}, reference {reference or '-'}, ctx {ctx}")
    print_table(rows, ["type", "imatrix", "bits/weight", "size", "PPL", "PPL ratio", "KLD", "same-top %",
                       "decode tok/s"])
    return 0
