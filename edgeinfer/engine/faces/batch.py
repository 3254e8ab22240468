"""BatchEngine: the serving face of the scheduler core — N slots, one scheduler thread.

One context holds N sequences (one unified KV cache, each slot limited to n_ctx / N positions as
llama-server's -c / -np split it). A scheduler thread steps the core (engine/core/scheduler.py): each
step is ONE `llama_decode` holding every running request's next token and drafts and the prompt
chunks of those starting. Any number of threads submit requests with `submit()` / `generate()` /
`chat()` and read their events from the returned `Generation` (the same handle as Engine's), fed
through a bounded per-request channel (faces/channel.py): a reader that falls `max_backlog` events
behind pauses its own request, never the others.

Speculation is every method `Engine` has — prompt lookup, a draft model or self-draft (one draft
context, sequence id = slot) and auto, with the rejection rule at T > 0 — chosen when the engine
is made (`speculation=`, e.g. the server's `--speculate`); a request may turn it off or choose
lookup, or use the engine's own method. The policy sizes every request's draft from the batch's
measured cost curve: drafts shrink as concurrency grows and stop where they do not pay.

While no request runs, the thread measures the cost curve (a few decodes at a time, interrupted at
once by an arriving request through llama.cpp's abort callback) and keeps it in the store, so the
first requests use the prior or an earlier measurement and none waits for a calibration.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ...cancel import CancelToken, raise_if_cancelled
from ...errors import ContextLengthError, EdgeInferError, EngineClosedError, InvalidOptionError
from ...gguf_file import GGUFInfo
from ...store import ModelManifest, Store
from .channel import ChannelFeed
from ..chat.tool_parser import ToolCallParser
from .generation import Generation
from .loading import load_face, speculation_options
from .speculation_setup import DraftModels, ProgressCallback, TargetModel, draft_key
from .suffix_disk import suffix_memory
from ..core.events import ScoredTokenEvent
from .common import ModelFace
from ..llama.flash_choice import with_measured_flash_attn
from ..llama.runtime import LlamaRuntime
from ..core.options import HEAD_METHODS, BatchOptions, GenerateOptions, LoadOptions, SpeculationOptions
from ..core.request import RequestState
from ..core.sampler import Sampler
from ..core.scheduler import Scheduler, Slot
from ..speculation.calibration import IdleCalibration
from ..speculation.head_models import mtp_layers
from ..speculation.policy import CostModel, plan_drafts

__all__ = [
    "BatchEngine",
    "BatchOptions",
    "BatchGeneration",
    "BatchMetrics",
    "SlotMetrics",
    "ScoredTokenEvent",
    "plan_drafts",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

# BatchGeneration is Generation: one handle on both faces (faces/generation.py); the name stays for
# code written against it.
BatchGeneration = Generation

# While every running request waits for its reader, how often the scheduler looks for one whose
# reader dropped its handle (RequestState.abandoned): that request is cancelled and its slot freed.
ABANDONED_CHECK_S = 0.5


@dataclass(frozen=True)
class SlotMetrics:
    index: int
    busy: bool
    cached_tokens: int
    decode_tok_s: float  # the current (or last) request's decode speed on this slot


@dataclass(frozen=True)
class BatchMetrics:
    """Counters since the engine started, and the current state (for /metrics)."""

    requests_submitted: int
    requests_finished: dict[str, int]  # by finish reason, plus "error"
    prompt_tokens: int
    cached_prompt_tokens: int
    generated_tokens: int
    queue_depth: int
    active: int
    steps: int
    rows: int  # total decoded rows (prompt chunks + tokens + drafts)
    drafted: int
    accepted: int
    slots: tuple[SlotMetrics, ...]
    calibrating: bool = False  # the idle calibration of the cost curve is not finished


# -- the engine ---------------------------------------------------------------------------------------


class BatchEngine(ModelFace):
    """A model serving N requests at once from one llama.cpp context (see the module docstring).

    Thread safety: every public method may be called from any thread. One scheduler thread owns
    the llama.cpp context; submitters only tokenize and queue.
    """

    def __init__(
        self,
        path: Path,
        info: GGUFInfo,
        options: LoadOptions,
        batch: BatchOptions | None = None,
        *,
        manifest: ModelManifest | None = None,
        store: Store | None = None,
        speculation: SpeculationOptions | str | None = None,
        progress: ProgressCallback | None = None,
        cancel: CancelToken = None,
    ):
        self.path = Path(path)
        self.info = info
        self.manifest = manifest
        if batch is not None and not isinstance(batch, BatchOptions):
            raise InvalidOptionError(f"batch must be BatchOptions, got {type(batch).__name__}")
        self.batch_options = (batch or BatchOptions()).validate()
        self.store = store or Store()
        n = self.batch_options.parallel
        # Before loading: llama.cpp rounds each slot's share up to 256 cells, so a context too small
        # to split would come back larger than asked (and than the model was trained for).
        if options.n_ctx is not None and options.n_ctx // n < 16:
            raise ContextLengthError(f"a context of {options.n_ctx} tokens split between {n} slots leaves "
                                     f"{options.n_ctx // n} per slot: raise --ctx or lower --parallel")
        mtp = mtp_layers(info) > 0
        spec = speculation_options(speculation) if speculation is not None else None
        # A drafting head reads the target's hidden states by batch row, and llama.cpp reorders
        # only logits when it cuts a batch into per-stream ubatches: with heads, one cache.
        unified = self.batch_options.kv_unified or mtp or (spec is not None and spec.method in HEAD_METHODS)
        # flash attention left to us: the verdict measured for this layout, as on Engine (a stream per
        # slot attends as one sequence does; one cache for every slot is a layout of its own: flash_choice)
        self._flash_slots = n if unified and n > 1 else 1
        self.options = options = with_measured_flash_attn(self.path, options, self.store, self._flash_slots)
        self._runtime = LlamaRuntime(self.path, options, n_seq_max=n, load_mtp=mtp, kv_unified=unified)
        self._note_placement()
        rt = self._runtime
        if rt.n_ctx // n < 16:
            rt.close()
            raise ContextLengthError(f"a context of {rt.n_ctx} tokens split between {n} slots leaves "
                                     f"{rt.n_ctx // n} per slot: raise --ctx or lower --parallel")
        self._drafts = DraftModels(TargetModel(self.name, self.path, info, manifest, self.store, options), rt, n)
        self.speculation = SpeculationOptions()
        given = self.batch_options.cost_curve
        costs = CostModel(dict(given)) if given is not None else self._stored_costs()
        self._core = Scheduler(rt, n, costs, drafts=self._drafts.context, heads=self._drafts.heads,
                               margin=self.batch_options.margin,
                               draft_max_rows=self.batch_options.draft_max, max_backlog=self.batch_options.max_backlog,
                               prefill_chunk=self.batch_options.prefill_chunk,
                               decode_wait=self.batch_options.decode_wait,
                               memory=suffix_memory(self.path, options, self.store.root, rt.facts.n_vocab))
        calibrate = self.batch_options.calibrate_when_idle and given is None and IdleCalibration.needed(costs, rt.n_batch)
        self._calibration = IdleCalibration(costs, self._core.idle_sequence) if calibrate else None
        self._cond = threading.Condition()
        self._inbox: collections.deque[RequestState] = collections.deque()
        self._calls: list[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = []  # run between steps
        self._submitted = 0
        self._closing = False
        self._closed = False
        self._dead: BaseException | None = None
        try:
            raise_if_cancelled(cancel, f"loading {self.name}")
            if spec is not None:
                self.prepare_speculation(spec, progress=progress, cancel=cancel)
        except BaseException:
            self._drafts.close()
            rt.close()
            raise
        self._thread = threading.Thread(target=self._run, name=f"edgeinfer-batch-{self.name}", daemon=True)
        self._thread.start()

    @classmethod
    def load(
        cls,
        model: str | Path | None = None,
        options: LoadOptions | None = None,
        batch: BatchOptions | None = None,
        *,
        store: Store | None = None,
        speculation: SpeculationOptions | str | None = None,
        progress: ProgressCallback | None = None,
        **load_options: Any,
    ) -> BatchEngine:
        """Load a model (store name, `.gguf` path, or None for the default) for parallel serving.

        `n_ctx` is the whole context, split evenly between the `batch.parallel` slots (as
        llama-server's -c and -np); keyword arguments are LoadOptions fields. `speculation`: the
        method requests may use besides off and lookup (e.g. "draft=MODEL", "self=Q4_K_M",
        "auto"), its draft model prepared now, reporting to `progress`. (edgeinfer.load is the
        same path: faces/loading.py.)"""
        return load_face(cls, model, options, store=store, speculation=speculation, progress=progress,
                         load_options=load_options, batch=batch)

    # -- facts -----------------------------------------------------------------------------------
    @property
    def parallel(self) -> int:
        return self.batch_options.parallel

    @property
    def kv_unified(self) -> bool:
        """Whether the slots share one KV cache (BatchOptions.kv_unified, or a model with MTP
        layers) rather than a stream each."""
        return self._runtime.kv_unified

    def _slots_count(self) -> int:
        return self.batch_options.parallel

    @property
    def closed(self) -> bool:
        """True once `close()` has begun: no new requests are taken."""
        return self._closing or self._closed

    @property
    def failure(self) -> BaseException | None:
        """What stopped the scheduler thread, if it died (every request then fails): a server
        loads the model again instead of serving from a dead engine."""
        return self._dead

    # -- speculation -----------------------------------------------------------------------------
    def prepare_speculation(self, speculation: SpeculationOptions | str, *,
                            progress: ProgressCallback | None = None, cancel: CancelToken = None) -> None:
        """Open the draft model `speculation` needs (a self-draft is made by the quantizer on first
        use) and make it the engine's method: requests may then use it, or off, or lookup.
        `cancel` (an Event or a callable) stops a self-draft's quantization with `Cancelled`."""
        self._check_open()
        spec = speculation_options(speculation)
        # A head, or a hybrid model's rollback snapshots, change the context: only before the thread runs.
        self._drafts.prepare(spec, progress, cancel,
                             exclusive=None if hasattr(self, "_thread") else contextlib.nullcontext)
        self.speculation = spec

    def _check_speculation(self, spec: SpeculationOptions) -> None:
        if spec.method in ("off", "lookup", "suffix") or (spec.method == "auto" and not spec.draft_model):
            return
        if draft_key(spec) != draft_key(self.speculation) or not self._drafts.is_ready(spec):
            raise InvalidOptionError(
                f"speculation {spec.method!r} with this draft model is not prepared on this engine "
                f"(it speculates with {self.speculation.method!r}; use off, lookup, suffix or that)")

    # -- requests --------------------------------------------------------------------------------
    def _checked(self, tokens: Sequence[int], options: GenerateOptions | None) -> tuple[GenerateOptions, Sampler | None]:
        options, sampler = super()._checked(tokens, options)
        try:
            self._check_speculation(options.speculation)
        except BaseException:
            if sampler is not None:
                sampler.close()
            raise
        return options, sampler

    def _start(self, tokens: list[int], options: GenerateOptions, sampler: Sampler | None, logprobs: int | None,
               notify: Callable[[], None] | None, tools: ToolCallParser | None) -> Generation:
        """Queue the request; it starts when a slot is free."""
        feed = ChannelFeed(tokens, options, sampler, logprobs, notify, self._wake, self._thread.is_alive,
                           self.batch_options.max_backlog)
        generation = Generation(feed, tools)  # (its reader's handle, before the scheduler sees the request)
        with self._cond:
            if self._closing or self._closed or self._dead is not None:
                feed.request.release()  # (its sampler: the request never reaches the core)
            if self._closing or self._closed:
                raise EngineClosedError("this engine is shutting down")
            if self._dead is not None:
                raise EngineClosedError(f"this engine's scheduler stopped: {self._dead}")
            self._inbox.append(feed.request)
            self._submitted += 1
            if self._calibration is not None and self._calibration.armed:
                self._calibration.interrupt()  # the request must not wait for a calibration decode
            self._cond.notify_all()
        return generation

    def cancel_all(self) -> None:
        """Cancel every queued and running request (each still ends with a DoneEvent)."""
        with self._cond:
            for r in list(self._inbox) + self._core.waiting + self._core.active:
                r.cancel.set()
            self._cond.notify_all()

    def metrics(self) -> BatchMetrics:
        """Counters and state now. The core steps on its own thread meanwhile, so every shared
        reference is read once and used as read (a slot's request checked and then read again
        could be one the scheduler has just ended: /metrics answered 500 under load)."""
        core = self._core
        with self._cond:
            slots = []
            for s in core.slots:
                r = s.request
                slots.append(SlotMetrics(s.index, r is not None, len(s.seq),
                                         r.decode_tok_s() if r is not None else s.decode_tok_s))
            active = list(core.active)
            c = core.counters
            return BatchMetrics(
                requests_submitted=self._submitted,
                requests_finished=dict(core.finished),
                prompt_tokens=c.prompt_tokens,
                cached_prompt_tokens=c.cached_tokens,
                generated_tokens=c.generated + sum(len(r.generated) for r in active),
                queue_depth=len(self._inbox) + len(core.waiting),
                active=len(active),
                steps=c.steps,
                rows=c.rows,
                drafted=c.drafted,
                accepted=c.accepted,
                slots=tuple(slots),
                calibrating=self._calibration is not None and self._calibration.pending(),
            )

    def cost_curve(self) -> dict[int, float]:
        """Seconds of one decode by number of rows at depth 0, as measured (the idle calibration,
        the store, or the steps taken); empty while nothing is measured but one row."""
        costs = self._core.costs
        out = {int(k): v for k, v in costs.to_dict().items() if k.isdigit()}
        return out if len(out) > 1 else {}

    # -- the context to itself, between two steps (a slot's KV state, a flash-attention measurement) --
    def _slots(self) -> list[Slot]:
        return self._core.slots

    def _exclusively(self, fn: Callable[[], T]) -> T:
        """Run fn() on the scheduler thread between two steps and return its result (or raise its error)."""
        self._check_open()
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cond:
            if self._closing or self._closed or self._dead is not None:
                raise EngineClosedError("this engine is shutting down")
            self._calls.append((fn, future))
            if self._calibration is not None and self._calibration.armed:
                self._calibration.interrupt()
            self._cond.notify_all()
        while True:
            try:
                return future.result(timeout=0.5)
            except concurrent.futures.TimeoutError:
                if not self._thread.is_alive() and not future.done():
                    raise EngineClosedError("the engine's scheduler stopped before it could run this") from None

    @staticmethod
    def _run_calls(calls: list[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]) -> None:
        for fn, future in calls:
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - the caller gets it; the scheduler goes on
                future.set_exception(e)

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self, grace: float = 0.0) -> None:
        """Stop accepting requests; let running ones finish for up to `grace` seconds, cancel
        the rest (they end with finish_reason "cancelled"), then free the model."""
        if self._closed:
            return
        deadline = time.monotonic() + grace
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            while self._busy() and time.monotonic() < deadline and self._thread.is_alive():
                self._cond.wait(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
        self.cancel_all()
        if self._calibration is not None:
            self._calibration.interrupt()
        self._thread.join()
        self._closed = True
        self._core.memory.save(force=True)  # (the scheduler thread is gone; on disk only when asked)
        self._close_embedder()
        self._drafts.close()
        self._runtime.close()

    def __enter__(self) -> BatchEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"BatchEngine({self.name!r}, parallel={self.parallel}, n_ctx={self.n_ctx_per_request} per request)"

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # -- the scheduler thread --------------------------------------------------------------------
    def _busy(self) -> bool:  # holds self._cond
        return bool(self._inbox or self._core.waiting or self._core.active)

    def _run(self) -> None:
        core = self._core
        try:
            while True:
                with self._cond:
                    while self._inbox:
                        core.submit(self._inbox.popleft())
                    for r in core.waiting + core.active:
                        if r.abandoned:  # its reader dropped the handle: nobody reads what it makes
                            r.cancel.set()
                    calls, self._calls = self._calls, []
                    if calls:
                        calibrate = False
                    elif not core.has_work():
                        if self._closing and not self._busy():
                            return
                        if self._calibration is not None and not self._closing and self._calibration.pending():
                            calibrate = True
                        else:  # (readers that are behind: look again for one that dropped its handle)
                            self._cond.wait(ABANDONED_CHECK_S if self._busy() else None)
                            continue
                    else:
                        calibrate = False
                if calls:
                    self._run_calls(calls)
                    continue
                if calibrate:
                    self._calibrate_once()
                    continue
                core.step()
                with self._cond:
                    self._cond.notify_all()  # close() waits for the last request
        except BaseException as e:  # noqa: BLE001 - a dead scheduler ends every reader with an error
            log.exception("the scheduler thread stopped")
            self._die(e)

    def _calibrate_once(self) -> None:
        """One calibration decode while idle; a request arriving meanwhile interrupts it."""
        cal = self._calibration
        assert cal is not None
        with self._cond:
            if self._inbox:
                return
            cal.armed = True
        try:
            cal.step(lambda: bool(self._inbox) or self._closing)
        finally:
            cal.armed = False
        if not cal.pending():
            self._remember_costs(self._core.costs)
            log.info("cost curve measured while idle: %s", cal.summary())

    def _die(self, error: BaseException) -> None:
        with self._cond:
            self._dead = error
            requests = list(self._inbox) + self._core.waiting + self._core.active
            self._inbox.clear()
            self._cond.notify_all()
        failure = EngineClosedError(f"the engine's scheduler stopped: {type(error).__name__}: {error}")
        for r in requests:
            if not r.finished:
                r.fail(failure if not isinstance(error, EdgeInferError) else error)
            r.release()
