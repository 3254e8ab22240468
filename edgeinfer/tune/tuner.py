"""`tune(model, ...)`: the fastest setup of a store model on this machine for a workload, within a
quality bound and a memory budget; the table it was chosen from; the profile `run` then uses.

The steps: the ladder (every rung of the model's name; `make` quantizes more from its
highest-precision rung), the reference, the setups of the space (space.py) that fit in `memory`,
their KLD where it is known (quality.py), the measurements an earlier tune of the same model,
machine, build and workload left (the journal: every measurement is kept as soon as it is taken,
so Ctrl-C loses none and the next tune goes on from them), the search (search.py), the table and
its frontier (pareto.py), the profile and its picture (profile.py, plot.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..cpu import usable_cores
from ..errors import InvalidOptionError, ModelNotFoundError, NoSetupError
from .identity import build_key, file_identity, machine_key
from .measure import LEVELS, Measurement, Measurer
from .pareto import Row, frontier, table_rows
from .profile import TunedProfile, now_iso, plot_path, save_profile
from .quality import QUALITY_CHUNKS, Quality, choose_reference
from .search import KLD_MARGIN, Arm, Search, SearchEvent
from .serving import ServeRun, choose_parallel, measure_serving
from .space import KV_PAIRS, METHODS, Setup, SpaceContext, untuned_setup
from .workload import Workload, default_workload, load_workload

if TYPE_CHECKING:
    from ..store import ModelManifest, Store

__all__ = ["tune", "TuneResult", "TuneProgress", "TuneInterrupted", "DEFAULT_MAX_KLD", "DEFAULT_BUDGET_S",
           "DEFAULT_MAKE_TYPES"]

log = logging.getLogger(__name__)

# The default quality bound. On the ladders in benchmarks/RESULTS.md ("edgeinfer tune") Q6_K costs
# 0.009 (SmolLM2-135M) and 0.004 (Qwen2.5-Coder-1.5B) against F16, the 135M's Q4_K_M 0.049 (86 %
# same top) and the 1.5B's Q3_K_M 0.063 (84 %); llama.cpp's own figures for 7-8B models are lower at
# every rung. 0.05 keeps the rungs whose top token agrees with the reference's about nine times in
# ten or more, and lets tune choose among the cache types and quants above them.
DEFAULT_MAX_KLD = 0.05
DEFAULT_BUDGET_S = 600.0
# Rungs `make=True` quantizes (those the installed llama.cpp can make and the store lacks).
DEFAULT_MAKE_TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_K_S", "IQ4_XS", "Q3_K_M")
_JOURNAL = "tune-journal"


class TuneInterrupted(KeyboardInterrupt):
    """Ctrl-C during a tune: `kept` measurements are in the store, and the next tune goes on from them."""

    def __init__(self, kept: int):
        super().__init__(f"{kept} measurements kept")
        self.kept = kept


@dataclass(frozen=True)
class TuneProgress:
    stage: str  # "ladder" | "quality" | "screen" | "combine" | "halve" | "final" | "exhaustive" | "done"
    message: str
    done: int
    total: int
    best: str | None  # the best setup so far and its speed
    elapsed_s: float
    budget_s: float


@dataclass(frozen=True)
class TuneResult:
    model: str
    reference: str
    choice: Row
    rows: tuple[Row, ...]  # every setup measured, at its highest level
    frontier: tuple[Row, ...]
    baseline: Row | None  # the untuned defaults, when measured at the choice's level
    max_kld: float
    memory: int
    workload: Workload
    elapsed_s: float
    budget_s: float
    stopped_by_budget: bool
    exhaustive: bool
    reused: int  # measurements taken from an earlier tune's journal
    profile_path: Path | None = None
    plot_path: Path | None = None
    notes: tuple[str, ...] = field(default=())
    serve_runs: tuple[ServeRun, ...] = ()  # with serve=True: the slot counts measured
    serve: ServeRun | None = None  # the slot count chosen for `serve` (None: one, or not measured)

    @property
    def speedup(self) -> float | None:
        """The choice's tok/s over the untuned defaults' (measured at the same level), if known."""
        if self.baseline is None or self.baseline.measurement.tok_s <= 0:
            return None
        return self.choice.measurement.tok_s / self.baseline.measurement.tok_s

    def table(self, frontier_only: bool = False) -> list[list[str]]:
        return table_rows(self.rows, frontier_only=frontier_only)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "reference": self.reference, "choice": self.choice.to_dict(),
                "speedup": self.speedup, "baseline": self.baseline.to_dict() if self.baseline else None,
                "rows": [r.to_dict() for r in self.rows], "frontier": [r.setup.label() for r in self.frontier],
                "max_kld": self.max_kld, "memory": self.memory,
                "workload": {"name": self.workload.name, "sha256": self.workload.sha256},
                "elapsed_s": round(self.elapsed_s, 1), "budget_s": self.budget_s,
                "stopped_by_budget": self.stopped_by_budget, "exhaustive": self.exhaustive, "reused": self.reused,
                "profile": str(self.profile_path) if self.profile_path else None,
                "plot": str(self.plot_path) if self.plot_path else None, "notes": list(self.notes),
                "serve_runs": [r.to_dict() for r in self.serve_runs],
                "serve": self.serve.to_dict() if self.serve else None}


def _thread_counts() -> list[int | None]:
    """None (the free cores, edgeinfer.cpu: all of them on an idle machine) and fewer pinned ones."""
    n = usable_cores()
    return [None] + sorted({c for c in (n - 1, n // 2) if 1 <= c < n}, reverse=True)


def _make_rungs(target: ModelManifest, ladder: list[ModelManifest], types: Sequence[str], store: Store,
                say: Callable[[str], None], cancel: Callable[[], bool]) -> list[ModelManifest]:
    """Quantize the missing `types` from the ladder's full-precision rung (made from the target first
    when there is none: its dequantized copy, `quantize --type F16`)."""
    from ..quantize import available_quant_types, quantize_model

    full = [m for m in ladder if m.bits_per_weight >= 15.9]
    if full:
        source = max(full, key=lambda m: m.bits_per_weight)
    else:
        say(f"making an F16 copy of {target.ref} to quantize from")
        source = quantize_model(target.ref, "F16", store=store, cancel=cancel).manifest
    have = {(m.quant or "").upper() for m in ladder} | {m.tag.upper() for m in ladder}
    for t in types:
        if t.upper() in have or t.upper() not in available_quant_types() or cancel():
            continue
        say(f"making {t} from {source.ref}")
        quantize_model(source.ref, t, store=store, cancel=cancel)
    from ..fit import ladder as ladder_of

    return ladder_of(target.name, store=store)


def _arms(ladder: list[ModelManifest], store: Store, memory: int, methods: Sequence[str],
          kv_pairs: Sequence[tuple[str, str]]) -> tuple[list[Arm], int]:
    """Every setup of the space that fits in `memory`; and how many did not fit."""
    from ..fit import estimate_memory

    arms, too_big = [], 0
    threads = _thread_counts()
    infos: dict[str, Any] = {}
    for rung in ladder:
        ctx = SpaceContext(rung=rung, ladder=ladder, store=store, infos=infos)
        specs = [v for name in methods for v in METHODS[name].variants(ctx)]
        for (k, v), t in ((kv, t) for kv in kv_pairs for t in threads):
            for fa in ((True, False) if v == "f16" else (True,)):
                mem = estimate_memory(ctx.info(rung), None, kv_type_k=k, kv_type_v=v, flash_attn=fa).total
                for spec, dmax in specs:
                    extra = _draft_memory(spec, rung, ladder, store, ctx, k, v)
                    if mem + extra > memory:
                        too_big += 1
                        continue
                    arms.append(Arm(Setup(rung.ref, k, v, fa, t, spec, dmax), mem + extra))
    return arms, too_big


def _draft_memory(spec: str, rung: ModelManifest, ladder: list[ModelManifest], store: Store, ctx: SpaceContext,
                  k: str, v: str) -> int:
    from ..fit import estimate_memory

    method, _, arg = spec.partition("=")
    draft = None
    if method == "draft" and arg:
        draft = store.find(arg)
    elif method == "self" and arg:
        draft = next((m for m in ladder if m.tag == arg.lower()), None)
    return estimate_memory(ctx.info(draft), None, kv_type_k=k, kv_type_v=v).total if draft is not None else 0


class _Journal:
    """Measurements kept in the store as they are taken, per model, machine, build and workload."""

    def __init__(self, store: Store, name: str, workload: Workload, fresh: bool):
        self.store = store
        context = json.dumps([name, machine_key(), build_key(), workload.sha256, [lv.max_tokens for lv in LEVELS]],
                             sort_keys=True)
        self.key = "v1|" + hashlib.sha256(context.encode()).hexdigest()[:32]
        self.data: dict[str, Any] = {}
        if not fresh:
            try:
                known = store.read_cache(_JOURNAL, self.key)
            except OSError:
                known = None
            self.data = known if isinstance(known, dict) else {}

    @staticmethod
    def arm_key(arm: Arm, store: Store) -> str:
        files = [arm.setup.model] + [a for a in (arm.setup.speculate.partition("=")[2],) if a and ":" in a]
        idents = []
        for ref in files:
            m = store.find(ref)
            idents.append(file_identity(m.path) if m is not None and m.path.exists() else ref)
        digest = hashlib.sha256(json.dumps(idents, sort_keys=True).encode()).hexdigest()[:16]
        return f"{arm.setup.key}|{digest}"

    def restore(self, arms: Sequence[Arm]) -> int:
        n = 0
        for arm in arms:
            for entry in self.data.get(self.arm_key(arm, self.store), []):
                try:
                    m = Measurement.from_dict(entry)
                except ValueError:
                    continue
                arm.results.setdefault(m.level, []).append(m)
                n += 1
        return n

    def count(self) -> int:
        return sum(len(v) for v in self.data.values() if isinstance(v, list))

    def add(self, arm: Arm, m: Measurement) -> None:
        self.data.setdefault(self.arm_key(arm, self.store), []).append(m.to_dict())
        try:
            self.store.write_cache(_JOURNAL, self.key, self.data)
        except OSError as e:
            log.warning("measurement not kept in the store: %s", e)


def tune(
    model: str | None,
    *,
    max_kld: float = DEFAULT_MAX_KLD,
    memory: int | None = None,
    workload: str | Path | Workload | None = None,
    budget: float = DEFAULT_BUDGET_S,
    progress: Callable[[TuneProgress], None] | None = None,
    make: bool | Sequence[str] = False,
    exhaustive: bool = False,
    serve: bool = False,
    methods: Sequence[str] | None = None,
    kv_pairs: Sequence[tuple[str, str]] = KV_PAIRS,
    save: bool = True,
    fresh: bool = False,
    quality_chunks: int = QUALITY_CHUNKS,
    store: Store | None = None,
) -> TuneResult:
    """Find the fastest setup of store model `model` (None: the default model) for `workload` (a
    JSONL file, a Workload, or None: the built-in mix) within `max_kld` (KLD against the model's
    highest-precision rung) and `memory` bytes (None: what this machine has available now), in about
    `budget` seconds; `make` quantizes missing rungs first (True: DEFAULT_MAKE_TYPES, or the types
    given). `serve` also measures the choice with parallel slots (serving.py) for `serve` to use.
    `methods` limits the speculation methods tried (default: every registered one),
    `kv_pairs` the (K, V) cache types. `exhaustive` measures every setup on the whole workload,
    whatever the budget. With `save`, the choice becomes the model's tuned profile. `fresh` ignores
    the measurements an earlier tune kept. `quality_chunks`: chunks of 512 tokens of the evaluation
    text a KLD is measured on (fewer: sooner, with a larger standard error). NoSetupError when nothing
    meets the bound and budget."""
    from ..fit import available_memory, ladder as ladder_of
    from ..store import Store

    store = store or Store()
    started = time.monotonic()
    if not isinstance(max_kld, (int, float)) or isinstance(max_kld, bool) or not max_kld >= 0:
        raise InvalidOptionError(f"max_kld must be a number >= 0, got {max_kld!r}")
    if not isinstance(budget, (int, float)) or isinstance(budget, bool) or not budget > 0:
        raise InvalidOptionError(f"budget must be a positive number of seconds, got {budget!r}")
    if isinstance(quality_chunks, bool) or not isinstance(quality_chunks, int) or not 1 <= quality_chunks <= 64:
        raise InvalidOptionError(f"quality_chunks must be a whole number in [1, 64], got {quality_chunks!r}")
    methods = tuple(methods) if methods is not None else tuple(METHODS)
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise InvalidOptionError(f"unknown speculation method(s) {', '.join(unknown) or '(none given)'}: "
                                 f"choose among {', '.join(METHODS)}")
    path, target = store.resolve(model)
    if target is None:
        raise ModelNotFoundError(f"{path} is not a store model: tune keeps its profile with the model in the store "
                                 "(pull, convert or quantize it into the store first)")
    work = workload if isinstance(workload, Workload) else (
        default_workload() if workload is None else load_workload(workload))
    memory = available_memory() if memory is None else int(memory)
    notes: list[str] = []

    def say(stage: str, message: str, done: int = 0, total: int = 0, best: str | None = None) -> None:
        log.info("%s: %s", stage, message)
        if progress is not None:
            progress(TuneProgress(stage, message, done, total, best, time.monotonic() - started, float(budget)))

    ladder = ladder_of(target.name, store=store)
    if make:
        types = DEFAULT_MAKE_TYPES if make is True else tuple(t.upper() for t in make)  # type: ignore[union-attr]
        ladder = _make_rungs(target, ladder, types, store, lambda m: say("ladder", m),
                             lambda: time.monotonic() - started > budget)
    reference, ref_note = choose_reference(target, ladder, store)
    if ref_note:
        notes.append(ref_note)
    quality = Quality(store, reference, chunks=quality_chunks, on_note=lambda m: say("quality", m))
    arms, too_big = _arms(ladder, store, memory, methods, kv_pairs)
    if not arms:
        raise NoSetupError(f"no setup of {target.name} fits in {memory / 2**30:.2f} GiB ({too_big} need more): "
                           "raise --memory or use a smaller rung")
    for a in arms:
        a.kld, a.kld_err = quality.known_with_error(a.setup.quality_key)
    if all(a.kld is not None and not a.within(max_kld) for a in arms):  # known already: no need to measure speeds
        raise NoSetupError(_nothing_meets(target, arms, max_kld, memory))
    journal = _Journal(store, target.name, work, fresh)
    reused = journal.restore(arms)
    baseline = _baseline(arms, target)
    budget_left = budget - (time.monotonic() - started)

    def check_quality(batch: list[Arm], force: bool = False) -> None:
        """Measure the unknown KLDs of `batch` when that fits in the budget (or `force`)."""
        keys = list(dict.fromkeys(a.setup.quality_key for a in batch if a.kld is None))
        if not keys:
            return
        cost = measurer.prefill_seconds(reference.ref, quality.tokens) + sum(
            measurer.prefill_seconds(ref, quality.tokens) for ref, _k, _v in keys)
        if not (force or exhaustive) and time.monotonic() - started + cost > budget:
            say("quality", f"no time left to measure the KLD of {len(keys)} setup(s)")
            return
        quality.measure(keys)
        for a in arms:
            if a.kld is None:
                a.kld, a.kld_err = quality.known_with_error(a.setup.quality_key)

    def on_event(e: SearchEvent) -> None:
        say(e.stage, e.message, e.done, e.total, e.best)

    measurer = Measurer(store, work, on_note=lambda m: say("measure", m))
    search = Search(arms, measurer, budget_s=float("inf") if exhaustive else max(budget_left, 1.0), max_kld=max_kld,
                    check_quality=check_quality, journal=journal.add, progress=on_event,
                    baseline=baseline.setup if baseline else None)
    try:
        search.run(exhaustive=exhaustive)
    except KeyboardInterrupt:
        raise TuneInterrupted(journal.count()) from None
    best = search.best()
    if best is None:  # only setups of unknown KLD were measured: those of the two fastest, past the budget
        fastest = sorted((a for a in arms if a.results and a.kld is None), key=lambda a: -(a.tok_s(0) or 0.0))
        check_quality(fastest[:2], force=True)
        best = search.best()
    if best is None:
        raise NoSetupError(_nothing_meets(target, arms, max_kld, memory))
    if baseline is not None and best.top_level is not None and best.top_level not in baseline.results \
            and not search.stopped and not exhaustive:
        search.stage = "final"  # the defaults beside the choice, for the speed-up it reports
        search.measure([baseline], LEVELS[best.top_level])
        best = search.best() or best  # the defaults may be the fastest after all
    result = _result(target, reference, best, arms, baseline, max_kld, memory, work, started, budget, search,
                     exhaustive, reused, notes)
    if serve:
        single = best.summary()
        assert single is not None
        runs = measure_serving(store, best.setup, single, work, memory, say=lambda m: say("serve", m),
                               fits_in=lambda s: exhaustive or time.monotonic() - started + s <= budget)
        result = replace(result, serve_runs=tuple(runs), serve=choose_parallel(single, runs),
                         elapsed_s=time.monotonic() - started)
    if save:
        result = _save(store, target, result)
    say("done", f"chose {best.setup.label()}: {result.choice.measurement.tok_s:.1f} tok/s", 1, 1)
    return result


def _baseline(arms: list[Arm], target: ModelManifest) -> Arm | None:
    """The arm closest to the untuned defaults: the target's rung, its default cache, flash attention
    on (llama.cpp's choice on a CPU), the free cores, no speculation."""
    default = untuned_setup(target.ref)
    wanted = Setup(default.model, default.kv_type_k, default.kv_type_v, True, default.threads, default.speculate)
    return next((a for a in arms if a.setup == wanted), None)


def _nothing_meets(target: ModelManifest, arms: list[Arm], max_kld: float, memory: int) -> str:
    known = [a for a in arms if a.kld is not None]
    if any(a.within(max_kld) for a in arms) and not any(a.results for a in arms):
        return (f"no setup of {target.name} could be measured whole within the budget (the first took longer): "
                "raise --budget")
    if not known:
        return f"no setup of {target.name} could be measured within the budget: raise --budget"
    closest = min(known, key=lambda a: a.kld_bound() or 0.0)
    kv = closest.setup.kv_type_k if closest.setup.kv_type_k == closest.setup.kv_type_v else \
        f"{closest.setup.kv_type_k}/{closest.setup.kv_type_v}"
    return (f"no setup of {target.name} within {memory / 2**30:.2f} GiB meets --max-kld {max_kld:g}: the closest is "
            f"{closest.setup.model} with a {kv} cache, KLD {closest.kld:.4f} ± {closest.kld_err:.4f} (within means "
            f"KLD + {KLD_MARGIN:g} standard errors ≤ the bound); raise --max-kld or --memory, or add a "
            "higher-precision rung (--make, or convert/pull the original weights)")


def _result(target: ModelManifest, reference: ModelManifest, best: Arm, arms: list[Arm], baseline: Arm | None,
            max_kld: float, memory: int, work: Workload, started: float, budget: float, search: Search,
            exhaustive: bool, reused: int, notes: list[str]) -> TuneResult:
    rows = []
    for a in arms:
        m = a.summary()
        if m is not None:
            rows.append(Row(a.setup, m, len(a.results[m.level]), a.kld, a.memory, chosen=a is best, kld_err=a.kld_err))
    front = {r.setup.key for r in frontier(rows)}
    rows = [replace(r, on_frontier=r.setup.key in front) for r in rows]
    choice = next(r for r in rows if r.chosen)
    base_row = None
    if baseline is not None and choice.level in baseline.results:
        bm = baseline.summary(choice.level)
        assert bm is not None
        base_row = Row(baseline.setup, bm, len(baseline.results[choice.level]), baseline.kld, baseline.memory,
                       kld_err=baseline.kld_err)
    if choice.level < LEVELS[-1].index:
        notes.append(f"the budget ended before the whole workload was measured: the choice's speed is from level "
                     f"{choice.level} (raise --budget for the whole workload)")
    return TuneResult(model=target.ref, reference=reference.ref, choice=choice, rows=tuple(rows),
                      frontier=tuple(r for r in rows if r.on_frontier), baseline=base_row, max_kld=max_kld,
                      memory=memory, workload=work, elapsed_s=time.monotonic() - started, budget_s=budget,
                      stopped_by_budget=search.stopped, exhaustive=exhaustive, reused=reused, notes=tuple(notes))


def _save(store: Store, target: ModelManifest, result: TuneResult) -> TuneResult:
    from .plot import svg

    setup = result.choice.setup
    files = {target.ref: file_identity(target.path)}
    for ref in (setup.model, setup.speculate.partition("=")[2]):
        m = store.find(ref) if ref and ":" in ref else None
        if m is not None:
            files[m.ref] = file_identity(m.path)
    if setup.speculate.startswith("self="):
        rung = store.get(setup.model)
        self_draft = store.find(f"{rung.name}:{setup.speculate.partition('=')[2].lower()}")
        if self_draft is not None:
            files[self_draft.ref] = file_identity(self_draft.path)
    m = result.choice.measurement
    profile = TunedProfile(
        model=target.ref, setup=setup, reference=result.reference, max_kld=result.max_kld, memory=result.memory,
        workload={"name": result.workload.name, "sha256": result.workload.sha256}, machine=machine_key(),
        build=build_key(), files=files,
        predicted={"tok_s": m.tok_s, "decode_tok_s": m.decode_tok_s, "ttft_s": m.ttft_s,
                   "kld": result.choice.kld or 0.0, "memory": result.choice.memory, "level": m.level,
                   "speedup": result.speedup or 0.0},
        rows=result.rows, created=now_iso(), notes=result.notes,
        serve={"parallel": result.serve.parallel, "ctx": result.serve.ctx} if result.serve else None)
    picture = svg(result.rows, title=f"{target.ref}: speed against KLD ({result.workload.name} workload)",
                  max_kld=result.max_kld)
    path = save_profile(store, target, profile, picture)
    return replace(result, profile_path=path, plot_path=plot_path(store, target))
