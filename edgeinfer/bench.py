"""Speed of a model on this machine, next to its memory-bandwidth roofline.

Decoding one token at batch 1 reads every weight that token touches once, so decode speed is
bounded by (memory read bandwidth) ÷ (bytes streamed per token). The bandwidth is measured here
with numpy (the best of several sums over an array much larger than the caches); the bytes per
token are all tensor bytes except the token-embedding table, of which one row is read — unless the
model ties its output projection to it, in which case the whole table is streamed for the logits.

With `speculation=True` it also measures what speculative decoding plans with: the cost of
verifying b tokens in one decode at two context depths (kept in the store for this model, thread
count and KV type, so no request pays for measuring it), the speed-up ceiling that curve allows,
and what a draft model's token may cost for drafting to pay.

Figures taken on a busy machine are not facts about the model: the 1-minute load average is
recorded before and after, and when other work held the cores our threads needed, nothing is
saved unless asked (then it is saved marked `busy`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .gguf_file import GGUFInfo, read_gguf

if TYPE_CHECKING:
    from .engine.llama.flash_choice import FlashAttnChoice
    from .store import Store

__all__ = ["BenchProgress", "BenchResult", "DraftCosts", "MachineLoad", "SpeculationCosts", "measure_bandwidth",
           "bytes_per_token", "bench", "bench_many", "draft_cost_model", "FLASH_DEPTH"]

# Acceptance rates the draft-model table is given for; the depths the cost curve is measured at.
_ACCEPTANCES = (0.6, 0.7, 0.8, 0.9, 0.95)
_COST_DEPTHS = (64, 1024)
FLASH_DEPTH = 512  # the context depth flash attention is timed at, on and off

_bandwidth_cache: dict[int, float] = {}


@dataclass(frozen=True)
class BenchProgress:
    model: str
    phase: str  # "bandwidth" | "load" | "prefill+decode"
    model_index: int
    n_models: int


@dataclass(frozen=True)
class MachineLoad:
    """The machine's 1-minute load average around a measurement."""

    before: float
    after: float
    cpus: int
    threads: int

    @staticmethod
    def now() -> float:
        return os.getloadavg()[0]

    @property
    def busy(self) -> bool:
        """Other work wanted the cores our threads needed: more runnable processes than the cores
        our threads leave free (after the run, our own threads are part of the average)."""
        others = max(self.before, self.after - self.threads)
        return others > max(0, self.cpus - self.threads) + 0.75


@dataclass(frozen=True)
class SpeculationCosts:
    """What speculative decoding plans with, measured: the cost of a b-token decode in one-token
    steps at each depth, attention's share, the best speed-up at a per-token acceptance (and its
    draft length), and the most a draft model's token may cost to pay at each acceptance."""

    cost: dict[int, dict[int, float]]  # depth -> b -> ratio
    attention: float
    ceiling: dict[float, tuple[float, int]]  # acceptance -> (speed-up, k) at the deeper depth
    draft_break_even: dict[float, float]  # acceptance -> max cost of a drafted token, in target steps

    def draft_verdict(self, draft_cost: float) -> str:
        """'pays above acceptance A' or 'cannot pay', for a drafted token costing `draft_cost` steps."""
        for a in sorted(self.draft_break_even):
            if self.draft_break_even[a] > draft_cost:
                return f"pays above acceptance {a:g} (a drafted token costs {draft_cost:.2f} steps)"
        top = max(self.draft_break_even)
        return (f"cannot pay: a drafted token costs {draft_cost:.2f} steps, even at acceptance {top:g} it must "
                f"cost < {self.draft_break_even[top]:.2f}")


@dataclass(frozen=True)
class DraftCosts:
    """A draft model's cost model against the target: a drafted token costs `cost` target steps
    (one-token decode times, measured alternating, medians), k-token drafts at per-token acceptance
    a are expected to speed decoding up by E(k) / (ρ(k+1) + k·cost), E(k) = 1 + a + … + a^k, with ρ
    the target's measured batch curve at the deeper depth; it pays above acceptance `pays_above`
    (None: at none), and at acceptance 0.9 a drafted token must cost < `max_cost_at_90` steps."""

    model: str
    cost: float
    speedup: dict[float, dict[int, float]]  # acceptance -> k -> expected speed-up
    pays_above: float | None
    max_cost_at_90: float

    def summary(self) -> str:
        at_90 = f"at acceptance 0.9 a drafted token must cost < {self.max_cost_at_90:.2f} steps"
        if self.pays_above is None:
            return f"draft {self.model} cannot pay: its token costs {self.cost:.2f} steps ({at_90})"
        return (f"draft {self.model} pays above acceptance {self.pays_above:.2f} when its token costs "
                f"{self.cost:.2f} steps ({at_90})")


@dataclass(frozen=True)
class BenchResult:
    model: str
    prompt_tokens: int
    generated_tokens: int
    prefill_tok_s: float
    decode_tok_s: float
    bytes_per_token: int
    bandwidth_bytes_s: float
    roofline_tok_s: float
    roofline_fraction: float  # decode_tok_s / roofline_tok_s
    n_threads: int
    repeats: int
    load: MachineLoad | None = None
    speculation: SpeculationCosts | None = None
    draft: DraftCosts | None = None
    backend: str = "CPU"  # where the layers ran (edgeinfer.devices.Placement.summary)
    flash_attn: FlashAttnChoice | None = None  # flash attention timed on and off (None: not measured)

    def to_metrics(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("model")
        d["busy"] = bool(self.load and self.load.busy)
        return d


def measure_bandwidth(size_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Memory read bandwidth in bytes/s: the best of `repeats` sums over a float64 array (cached per size)."""
    if size_bytes in _bandwidth_cache:
        return _bandwidth_cache[size_bytes]
    a = np.ones(size_bytes // 8, dtype=np.float64)
    a.sum()  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t0)
    del a
    _bandwidth_cache[size_bytes] = size_bytes / best
    return _bandwidth_cache[size_bytes]


def bytes_per_token(info: GGUFInfo) -> int:
    """Weight bytes read to decode one token."""
    names = {t.name: t for t in info.tensors}
    total = info.tensor_bytes
    emb = names.get("token_embd.weight")
    if emb is not None and "output.weight" in names:
        total -= emb.n_bytes - emb.n_bytes // emb.shape[1]  # one row of a separate embedding table
    return total


def _prompt_tokens(engine: Any, n: int) -> list[int]:
    from .evaluate import default_eval_text

    tokens = engine.tokenize(default_eval_text(), add_special=True)
    return tokens[:n]


def bench(
    model: str | Path | None,
    *,
    prompt_tokens: int = 256,
    decode_tokens: int = 64,
    repeats: int = 2,
    n_threads: int | None = None,
    store: Store | None = None,
    save: bool = True,
    save_busy: bool = False,
    speculation: bool = False,
    draft: str | Path | None = None,
    bandwidth: float | None = None,
    placement: Mapping[str, Any] | None = None,
    flash_depth: int = FLASH_DEPTH,
) -> BenchResult:
    """Prefill and decode tok/s at batch 1 (best of `repeats`), greedy, through the engine; with
    `speculation`, the batch cost curve too; with a `draft` model (implies `speculation`), its cost
    model (DraftCosts). Saved in the store unless the machine was busy (`save_busy` saves anyway,
    marked). `placement`: LoadOptions fields n_gpu_layers, rpc, tensor_split; a run on RPC workers
    is not saved (it measures those machines too, not this one). `flash_depth`: the context depth
    at which flash attention is timed on and off (engine/llama/flash_choice.py; 0: not measured), the
    verdict kept for later loads of the model that leave flash attention unset."""
    from .devices import last_placement
    from .engine import load
    from .engine.llama.flash_choice import remember_flash_attn
    from .engine.core.options import GenerateOptions, LoadOptions, SamplingOptions
    from .store import Store

    store = store or Store()
    speculation = speculation or draft is not None
    path, manifest = store.resolve(model)
    info = read_gguf(path)
    bw = bandwidth or measure_bandwidth()
    n_ctx = max(512, prompt_tokens + decode_tokens + 16, max(_COST_DEPTHS) + 64 if speculation else 0,
                flash_depth + 16 if flash_depth else 0)
    options = LoadOptions(n_ctx=n_ctx, n_threads=n_threads, **dict(placement or {})).validate()
    save = save and not options.rpc
    best_prefill = best_decode = 0.0
    generated = 0
    spec_costs = draft_costs = flash = None
    threads = options.threads
    load_before = MachineLoad.now()
    with load(model=manifest.ref if manifest else str(path), options=options) as engine:
        prompt = _prompt_tokens(engine, prompt_tokens)
        gen_options = GenerateOptions(max_tokens=decode_tokens, sampling=SamplingOptions(temperature=0.0))
        for _ in range(max(1, repeats)):
            done = engine.generate(prompt, gen_options).result()
            best_prefill = max(best_prefill, done.stats.prefill_tok_s or 0.0)
            best_decode = max(best_decode, done.stats.decode_tok_s or 0.0)
            generated = done.stats.generated_tokens
        if speculation:
            costs = engine.measure_decode_costs(_prompt_tokens(engine, max(_COST_DEPTHS) + 64), depths=_COST_DEPTHS,
                                                save=False)
            spec_costs = _speculation_costs(costs)
            if draft is not None:
                draft_costs = _draft_costs(engine, costs, draft, options, prompt, gen_options, max(3, repeats))
        if flash_depth:
            flash = engine.measure_flash_attn(_prompt_tokens(engine, flash_depth), save=False)
        placed = last_placement(path)
        machine = MachineLoad(load_before, MachineLoad.now(), os.cpu_count() or 1, threads)
        if speculation and save and (save_busy or not machine.busy):
            engine.save_decode_costs()
        if flash is not None and save and (save_busy or not machine.busy):
            remember_flash_attn(path, options, store, flash)
    bpt = bytes_per_token(info)
    roof = bw / bpt if bpt else 0.0
    result = BenchResult(
        model=manifest.ref if manifest else str(path),
        prompt_tokens=len(prompt),
        generated_tokens=generated,
        prefill_tok_s=best_prefill,
        decode_tok_s=best_decode,
        bytes_per_token=bpt,
        bandwidth_bytes_s=bw,
        roofline_tok_s=roof,
        roofline_fraction=best_decode / roof if roof else 0.0,
        n_threads=threads,
        repeats=max(1, repeats),
        load=machine,
        speculation=spec_costs,
        draft=draft_costs,
        backend=placed.summary() if placed is not None else "CPU",
        flash_attn=flash,
    )
    if save and manifest is not None and (save_busy or not machine.busy):
        store.update_metrics(manifest.ref, "bench", result.to_metrics())
    return result


def _speculation_costs(costs: Any) -> SpeculationCosts:
    from .engine.speculation import break_even_draft_cost

    deep = max(_COST_DEPTHS)
    sizes = (2, 3, 4, 5, 8, 9, 16, 17, 32, 33)
    ratio = {d: {b: round(costs.ratio(b, d), 3) for b in sizes} for d in _COST_DEPTHS}
    ceiling = {}
    for a in _ACCEPTANCES + (0.97,):
        best = (1.0, 0)
        for k in range(1, 33):
            gain = sum(a**i for i in range(k + 1)) / costs.ratio(k + 1, deep)
            best = max(best, (round(gain, 3), k))
        ceiling[a] = best
    even = {a: round(break_even_draft_cost(costs, a, depth=deep), 3) for a in _ACCEPTANCES}
    return SpeculationCosts(cost=ratio, attention=costs.attention, ceiling=ceiling, draft_break_even=even)


def _draft_costs(engine: Any, costs: Any, draft: str | Path, options: Any, prompt: list[int], gen_options: Any,
                 rounds: int) -> DraftCosts:
    """Measure a draft model's token cost against the open target engine (alternating decodes of
    the same prompt, so both see the same machine) and model what its drafts would buy."""
    from statistics import median

    from .engine import load

    ratios = []
    with load(model=str(draft), options=options) as d:
        for _ in range(rounds):
            t = engine.generate(prompt, gen_options).result().stats.decode_tok_s or 0.0
            q = d.generate(prompt, gen_options).result().stats.decode_tok_s or 0.0
            if t > 0 and q > 0:
                ratios.append(t / q)  # a draft token's time over a target token's
    return draft_cost_model(costs, str(draft), median(ratios) if ratios else float("inf"))


def draft_cost_model(costs: Any, model: str, cost: float, depth: int = max(_COST_DEPTHS)) -> DraftCosts:
    """What a draft model whose token costs `cost` target steps would buy, from the target's batch
    curve `costs` (a CostModel) at `depth` (see DraftCosts)."""
    from .engine.speculation import break_even_draft_cost

    speedup = {}
    for a in _ACCEPTANCES:
        e, p, row = 1.0, 1.0, {}
        for k in range(1, 9):
            p *= a
            e += p
            row[k] = round(e / (costs.ratio(k + 1, depth) + k * cost), 3)
        speedup[a] = row

    def pays(a: float) -> bool:  # monotone in a
        return break_even_draft_cost(costs, a, depth=depth) > cost

    pays_above = None
    if pays(0.999):
        lo, hi = 0.0, 0.999
        for _ in range(30):  # bisection for the break-even acceptance
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if pays(mid) else (mid, hi)
        pays_above = round(hi, 3)
    return DraftCosts(model=model, cost=round(cost, 3), speedup=speedup, pays_above=pays_above,
                      max_cost_at_90=round(break_even_draft_cost(costs, 0.9, depth=depth), 3))


def bench_many(
    models: Sequence[str | Path],
    *,
    on_progress: Callable[[BenchProgress], None] | None = None,
    **kwargs: Any,
) -> list[BenchResult]:
    """Bench several models; the bandwidth is measured once, after every model is found (a
    misspelled one fails at once, not after seconds of measuring)."""
    from .store import Store

    store = kwargs.get("store") or Store()
    names = []  # as the progress lines name them (None: the default model, by its store name)
    for m in models:
        path, manifest = store.resolve(m)
        names.append(manifest.ref if manifest is not None else path.name)
    for draft in [kwargs.get("draft")] if kwargs.get("draft") else []:
        store.resolve(draft)
    if on_progress:
        on_progress(BenchProgress("", "bandwidth", 0, len(models)))
    bw = kwargs.pop("bandwidth", None) or measure_bandwidth()
    out = []
    for i, m in enumerate(models):
        if on_progress:
            on_progress(BenchProgress(names[i], "prefill+decode", i + 1, len(models)))
        out.append(bench(m, bandwidth=bw, **kwargs))
    return out
