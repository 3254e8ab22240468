"""`edgeinfer pull SPEC`: a model from the Hugging Face Hub (or HF_ENDPOINT), resumable and verified."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from ._common import ProgressBar, common_options, format_bytes

if TYPE_CHECKING:
    from edgeinfer import PullEvent, PullPlan

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pull",
        parents=[common_options()],
        help="download a model from the Hugging Face Hub",
        description="Download a GGUF repo (owner/name[:QUANT], default Q4_K_M or the closest quant) or a "
        "safetensors repo (converted, then quantized per --profile) into the Hugging Face cache, verify every "
        "file's hash and register the model. Ctrl-C and running the same command again resumes. "
        "HF_TOKEN, HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE=1 are honoured.",
    )
    p.add_argument("spec", metavar="SPEC", help="owner/name or owner/name:QUANT, e.g. bartowski/SmolLM2-360M-Instruct-GGUF:Q4_K_M")
    p.add_argument("--revision", metavar="R", help="branch, tag or commit (default: main)")
    p.add_argument("--token", metavar="T", help="Hugging Face token (default: HF_TOKEN or `hf auth login`)")
    p.add_argument("--profile", metavar="NAME", help="quant profile for safetensors repos (default: balanced)")
    p.add_argument("--quant", metavar="TYPE", help="GGUF repos: which file; safetensors repos: the quant to make")
    p.add_argument("--keep-f16", action="store_true", help="safetensors repos: keep the F16 GGUF for later quants")
    p.add_argument("--yes", "-y", action="store_true", help="do not ask before pulling a model that may not fit in RAM")
    p.set_defaults(func=run_pull)


def _describe(plan: PullPlan) -> list[str]:
    lines = [
        f"{plan.repo} @ {plan.revision} ({plan.commit[:12]}): {plan.kind}, {plan.quant}"
        + (f" — {plan.note}" if plan.note else "")
    ]
    for f in plan.files:
        lines.append(f"  {f.path}  {format_bytes(f.size)}")
    cached = f", {format_bytes(plan.cached_bytes)} already cached" if plan.cached_bytes else ""
    resumed = f", {format_bytes(plan.partial_bytes)} to resume from" if plan.partial_bytes else ""
    lines.append(
        f"total {format_bytes(plan.total_bytes)}{cached}{resumed}; to download {format_bytes(plan.download_bytes)}"
        f" ({format_bytes(plan.free_cache_bytes)} free in {plan.cache_dir})"
    )
    if plan.output_bytes:
        lines.append(f"conversion and quantization write about {format_bytes(plan.output_bytes)} to {plan.store_dir}")
    if plan.fits_ram is None:
        lines.append(f"RAM: needs about {format_bytes(plan.ram_needed_bytes)}")
    else:
        verdict = "fits" if plan.fits_ram else "may NOT fit"
        lines.append(
            f"RAM: needs about {format_bytes(plan.ram_needed_bytes)}, {format_bytes(plan.ram_available_bytes)} "
            f"available — {verdict}"
        )
    if plan.offline:
        lines.append("offline: using only the Hugging Face cache")
    return lines


class _FileBar(ProgressBar):
    """A download bar whose rate and ETA count only this run's bytes (not those resumed from)."""

    base = 0

    def _line(self, now: float) -> str:
        done = self.done
        self.done = done - self.base
        total, self.total = self.total, (self.total - self.base if self.total else self.total)
        try:
            line = super()._line(now)
        finally:
            self.done, self.total = done, total
        if self.base:
            line += f" (resumed at {format_bytes(self.base)})"
        return line


def run_pull(args: argparse.Namespace) -> int:
    import edgeinfer
    from edgeinfer.convert import ConvertProgress
    from edgeinfer.quantize import QuantizeProgress

    kwargs = dict(revision=args.revision, token=args.token, profile=args.profile, quant=args.quant, keep_f16=args.keep_f16)
    plan = edgeinfer.plan(args.spec, **kwargs)
    for line in _describe(plan):
        print(line, file=sys.stderr)
    if plan.fits_ram is False and not args.yes:
        if not sys.stdin.isatty():
            print("edgeinfer: the model may not fit in RAM; pass --yes to pull it anyway", file=sys.stderr)
            return 1
        answer = input("The model may not fit in RAM. Pull anyway? [y/N] ").strip().lower()
        if answer not in ("y", "yes"):
            return 1

    bars: dict[str, ProgressBar] = {}
    open_bars: dict[str, ProgressBar] = {}  # drawn but not finished: end their line on errors
    stage_bar: list[ProgressBar | None] = [None]

    def close_stage() -> None:
        if stage_bar[0] is not None:
            stage_bar[0].close()
            stage_bar[0] = None

    def on_progress(ev: PullEvent) -> None:
        if isinstance(ev, edgeinfer.DownloadProgress):
            label = f"[{ev.index}/{ev.count}] {ev.file}"
            bar = bars.get(ev.file)
            if bar is None:
                bar = bars[ev.file] = _FileBar(label, ev.total, unit="B")
                bar.base = ev.resumed_from
            status = {"verifying": " (verifying)", "cached": " (cached)", "done": ""}.get(ev.status, "")
            bar.update(ev.done, ev.total, label=label + status)
            if ev.status in ("cached", "done"):
                bar.close()
                open_bars.pop(ev.file, None)
            else:
                open_bars[ev.file] = bar
        elif isinstance(ev, edgeinfer.PullStage):
            close_stage()
            print(f"{ev.stage}: {ev.message}", file=sys.stderr)
        elif isinstance(ev, ConvertProgress):
            if stage_bar[0] is None:
                stage_bar[0] = ProgressBar("converting", ev.bytes_total, unit="B")
            stage_bar[0].update(ev.bytes_done, ev.bytes_total)
        elif isinstance(ev, QuantizeProgress):
            if stage_bar[0] is None or stage_bar[0].unit == "B":
                close_stage()
                stage_bar[0] = ProgressBar("quantizing", ev.n_tensors, unit="")
            stage_bar[0].update(ev.tensor_index, ev.n_tensors)

    try:
        try:
            result = edgeinfer.pull(args.spec, **kwargs, on_progress=on_progress)
        finally:  # end the bars' lines before any message
            close_stage()
            for bar in open_bars.values():
                bar.close()
    except (KeyboardInterrupt, edgeinfer.Cancelled):
        print("edgeinfer: pull interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    m = result.manifest
    print(
        f"pulled {m.ref}: {format_bytes(m.size)}, {m.bits_per_weight:.2f} bits/weight; "
        f"downloaded {format_bytes(result.downloaded_bytes)}, reused {format_bytes(result.reused_bytes)} "
        f"in {result.seconds:.1f}s",
        file=sys.stderr,
    )
    if result.fit is not None:
        est = result.fit.estimate
        print(
            f"memory at n_ctx={est.n_ctx}: {format_bytes(est.total)} needed, {format_bytes(result.fit.available)} "
            f"available — {'fits' if result.fit.fits else 'does NOT fit'}",
            file=sys.stderr,
        )
    if result.f16_manifest is not None:
        print(f"kept {result.f16_manifest.ref} for later quants", file=sys.stderr)
    print(m.ref)
    return 0
