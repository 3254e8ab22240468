"""The parallel slots and context for `serve` (`tune --serve`): the chosen setup in a BatchEngine with
N slots, N copies of the workload's requests submitted at once, their tokens over the time until
the last one ended. A slot gets the context one `run` gets (min(trained, 4096) tokens; less when N
of those would pass the trained context, which the whole context may not); a slot count whose memory (edgeinfer.fit's estimate) exceeds the budget is
not tried. More slots always raise the total on a CPU until it is compute-bound, and always delay
each request: the choice is the count with the most tokens a second whose median time to first
token is at most twice one slot's, its own setup's single-request measurement standing for N = 1.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .measure import Measurement
from .space import Setup
from .workload import Workload

if TYPE_CHECKING:
    from ..store import Store

__all__ = ["ServeRun", "measure_serving", "choose_parallel", "PARALLELS", "TTFT_LIMIT"]

PARALLELS = (2, 4)
TTFT_LIMIT = 2.0  # a slot count may at most double the median time to first token of one request


@dataclass(frozen=True)
class ServeRun:
    parallel: int
    ctx: int  # the whole context
    tok_s: float  # every request's tokens over the time until the last one ended
    ttft_s: float  # median

    def to_dict(self) -> dict[str, Any]:
        return {"parallel": self.parallel, "ctx": self.ctx, "tok_s": self.tok_s, "ttft_s": self.ttft_s}


def _slot_ctx(trained: int | None, n: int) -> int:
    """A slot's context: what `run` gets (min(trained, 4096)), split further when n of them would
    pass the trained context (the whole context may not)."""
    trained = trained or 4096
    return min(4096, trained // n) // 256 * 256


def measure_serving(store: Store, setup: Setup, single: Measurement, workload: Workload, memory: int, *,
                    parallels: Sequence[int] = PARALLELS, fits_in: Callable[[float], bool] = lambda _s: True,
                    say: Callable[[str], None] = lambda _m: None) -> list[ServeRun]:
    """One run per slot count that fits in `memory` and whose time, estimated as N times the whole
    workload's on one slot (`single`: the setup's measurement, at whatever level), `fits_in` the budget."""
    from ..engine.faces.batch import BatchEngine, BatchOptions
    from ..fit import estimate_memory
    from ..gguf_file import read_gguf

    info = read_gguf(store.get(setup.model).path)
    runs: list[ServeRun] = []
    for n in parallels:
        slot = _slot_ctx(info.context_length, n)
        if slot < 256:
            break
        need = estimate_memory(info, n * slot, kv_type_k=setup.kv_type_k, kv_type_v=setup.kv_type_v,
                               flash_attn=setup.flash_attn).total
        if need > memory:
            say(f"serve: {n} slots need {need / 2**30:.2f} GiB, more than the budget")
            break
        if not fits_in(n * single.seconds * workload.total_tokens / max(single.generated, 1)):
            say(f"serve: no time left for {n} slots")
            break
        say(f"serve: {n} slots of {slot} tokens, {n} copies of each request at once")
        options = setup.load_options(n * slot)
        batch = BatchOptions(parallel=n, calibrate_when_idle=False)
        with BatchEngine.load(setup.model, options, batch, store=store, speculation=setup.speculation()) as engine:
            runs.append(_run(engine, setup, workload, n, n * slot))
    return runs


def _run(engine: Any, setup: Setup, workload: Workload, n: int, ctx: int) -> ServeRun:
    model = engine.manifest.ref if engine.manifest else engine.path
    t0 = time.perf_counter()
    gens = []
    for item in workload.items:
        gens += [engine.chat(item.chat_messages(model), item.options(setup.speculation())) for _ in range(n)]
    done = [g.result() for g in gens]
    seconds = time.perf_counter() - t0
    tokens = sum(d.stats.generated_tokens for d in done)
    return ServeRun(parallel=n, ctx=ctx, tok_s=tokens / seconds, ttft_s=statistics.median(d.stats.ttft_s for d in done))


def choose_parallel(single: Measurement, runs: Sequence[ServeRun]) -> ServeRun | None:
    """The slot count with the most tokens a second within TTFT_LIMIT × one request's time to first
    token (None: one slot, the single-request setup, is best)."""
    ok = [r for r in runs if r.ttft_s <= TTFT_LIMIT * single.ttft_s and r.tok_s > single.tok_s]
    return max(ok, key=lambda r: r.tok_s, default=None)
