"""`edgeinfer fit MODEL` (memory needed vs available) and `edgeinfer recommend NAME` (which quant to use)."""

from __future__ import annotations

import argparse
import sys

from ._common import INT32_MAX, ctx_type, add_kv_options, add_placement_options, common_options, format_bytes, int_range, kv_options, placement_options, print_table

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "fit",
        parents=[common_options()],
        help="memory a model needs (weights + KV cache + compute) vs the RAM available",
        description="Estimate the memory to run MODEL with a context of --ctx tokens: weights, KV cache "
        "(layers × ctx × kv heads × head dim × bytes of the K and V types, block overhead included; the bytes "
        "of every KV type are listed too) and llama.cpp's compute buffers, against MemAvailable. Exit code 0 "
        "when it fits, 1 when it does not.",
    )
    p.add_argument("model", nargs="?", help="store name or .gguf path (default: the default model)")
    p.add_argument("--ctx", type=ctx_type, help="context size in tokens (default: min(model's, 4096))")
    add_kv_options(p)
    add_placement_options(p)
    p.set_defaults(func=run_fit)

    r = sub.add_parser(
        "recommend",
        parents=[common_options()],
        help="the best quant of a model's ladder that fits this machine, with measured quality and speed",
        description="Among every quant of NAME in the store: the best measured quality that fits in RAM, or with "
        "--min-quality KLD the fastest one whose measured mean KLD is at most KLD. Measure with "
        "`edgeinfer eval --ladder NAME` first.",
    )
    r.add_argument("name", help="store model name (all its tags form the ladder)")
    r.add_argument("--ctx", type=ctx_type, help="context size in tokens (default: min(model's, 4096))")
    add_kv_options(r)
    add_placement_options(r)
    r.add_argument("--min-quality", type=float, metavar="KLD", help="largest acceptable mean KL divergence")
    r.set_defaults(func=run_recommend)


def run_fit(args: argparse.Namespace) -> int:
    from edgeinfer.fit import fit

    rep = fit(args.model, args.ctx, **kv_options(args), placement=placement_options(args))
    e = rep.estimate
    print(f"model       {rep.model}")
    print(f"weights     {format_bytes(e.weights)}")
    print(f"KV cache    {format_bytes(e.kv_cache)}  ({e.n_layer} layers × {e.n_ctx} ctx × {e.n_head_kv} kv heads × "
          f"{e.head_dim} × (K + V) × {e.kv_type})")
    by_type = "  ".join(f"{name} {format_bytes(b)}" for name, b in rep.kv_by_type.items())
    print(f"KV by type  {by_type}")
    print(f"compute     {format_bytes(e.compute)}  (estimate)")
    print(f"total       {format_bytes(e.total)}")
    if rep.placement is not None:
        _print_placement(rep)
    print(f"available   {format_bytes(rep.available)}" + ("  (this machine)" if rep.placement is not None else ""))
    print(f"fits        {'yes' if rep.fits else 'NO'}  (headroom {format_bytes(rep.headroom)}"
          + (" on this machine)" if rep.placement is not None else ")"))
    trained = _trained_context(args.model)
    if trained and e.n_ctx > trained:
        print(f"edgeinfer: note: a context of {e.n_ctx} tokens is beyond the {trained} this model was trained on: "
              f"it fits in memory, but answers degrade past {trained} tokens", file=sys.stderr)
    return 0 if rep.fits else 1


def _print_placement(rep) -> None:  # noqa: ANN001 - an edgeinfer.fit.FitReport
    """Where each part lands: this machine and each device (weights, KV cache, compute buffers)."""
    plan = rep.placement
    if plan.note:
        print(f"note        {plan.note}")
    rows = []
    for p in plan.parts:
        first, end = p.layers
        layers = "-" if not p.n_layers else (f"{first}-{end - 1}" if end - first > 1 else str(first))
        if end == plan.n_layer + 1 and p.n_layers:
            layers += " +output" if end - first > 1 else " (output)"
        free = rep.available if p.name == "host" else p.memory_free
        fits = p.total <= rep.available if p.name == "host" else p.fits
        rows.append([p.name, p.where, layers, format_bytes(p.weights), format_bytes(p.kv_cache), format_bytes(p.compute),
                     format_bytes(p.total), "-" if free is None else format_bytes(free),
                     "?" if fits is None else ("yes" if fits else "NO")])
    print()
    print_table(rows, ["part", "where", "layers", "weights", "KV cache", "compute", "total", "free", "fits"])
    print()


def _trained_context(model: str | None) -> int | None:
    """The context length the model was trained on (its GGUF's), or None when it does not say."""
    import edgeinfer

    path, manifest = edgeinfer.Store().resolve(model)
    if manifest is not None and manifest.context_length:
        return manifest.context_length
    return edgeinfer.read_gguf(path).context_length or None


def run_recommend(args: argparse.Namespace) -> int:
    from edgeinfer.fit import recommend

    rec = recommend(args.name, args.ctx, min_quality=args.min_quality, **kv_options(args),
                    placement=placement_options(args))
    rows = []
    for c in rec.candidates:
        rows.append([
            ("* " if rec.choice is not None and c.ref == rec.choice.ref else "  ") + c.ref,
            f"{c.manifest.bits_per_weight:.2f}",
            format_bytes(c.fit.estimate.total),
            "yes" if c.fit.fits else "no",
            "-" if c.kld is None else f"{c.kld:.5f}",
            "-" if c.same_top is None else f"{c.same_top * 100:.1f}",
            "-" if c.decode_tok_s is None else f"{c.decode_tok_s:.1f}",
        ])
    print_table(rows, ["model", "bits/weight", "memory", "fits", "KLD", "same-top %", "decode tok/s"])
    for c in rec.candidates:
        if c.inherits_from is not None:
            print(f"note: {c.ref} was made from {c.inherits_from.ref} ({c.inherits_from.bits_per_weight:.2f} bits/weight): "
                  "it keeps that model's error, so it ranks no better than it")
    print()
    if rec.choice is None:
        print(f"no recommendation: {rec.reason}")
        return 1
    print(f"recommended: {rec.choice.ref} — {rec.reason}")
    return 0
