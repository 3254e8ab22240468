"""Engine's way of feeding a Generation: the scheduler core stepped inline, from the reader's own
`next()` (`InlineFeed`, the handle's strategy; faces/generation.py).

The engine's core has one slot; a request holds it (the engine's RequestSlot) from its first step
to its end, submits itself to the core and steps it until it has events to give, so no thread hop
lies between a token and its reader. A cancel from any thread reaches into a running prefill
decode through llama.cpp's abort callback. A request whose speculation needs a draft model not yet
open first prepares it in a worker thread, giving its SpeculationProgress events meanwhile.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

from ...cancel import CancelToken
from ...errors import Cancelled, EngineClosedError
from ..core.events import Event, SpeculationProgress
from ..core.options import GenerateOptions, SpeculationOptions
from ..core.request import RequestState
from ..core.sampler import Sampler
from ..core.scheduler import Scheduler
from .exclusive import RequestSlot
from .generation import GenerationState

__all__ = ["InlineFeed", "SpeculationSource"]


class SpeculationSource(Protocol):
    """How a request gets its draft model ready: the engine's side of speculation."""

    def is_ready(self, spec: SpeculationOptions) -> bool:
        """Whether `spec` needs no preparation (any draft model it names is open)."""

    def prepare(self, spec: SpeculationOptions, progress: Callable[[SpeculationProgress], None],
                cancel: CancelToken) -> None:
        """Find, make (quantize) and open the draft model `spec` names, reporting progress."""


class InlineFeed:
    """One request on an Engine, stepped by whichever thread reads it (one at a time: `_turn`)."""

    def __init__(self, slot: RequestSlot, core: Scheduler, tokens: list[int], options: GenerateOptions,
                 sampler: Sampler | None, logprobs: int | None, notify: Callable[[], None] | None,
                 speculation: SpeculationSource | None):
        """`sampler`: the request's, made when it was checked (where it has a grammar); it owns it."""
        self.slot = slot
        self.core = core
        self.speculation = speculation
        self.request = RequestState(tokens, options, self._collect, logprobs=logprobs, sampler=sampler)
        self._notify = notify
        self._phase: GenerationState = "new"
        self._pending: list[Event] = []  # what the core handed over and the reader has not taken
        self._turn = threading.Lock()  # held while a thread steps (or stops) this request
        self._preparation: _Preparation | None = None
        self._holding = False  # this request holds the engine's slot
        self._stopped = False  # closed (or given up): no more events are handed out

    @property
    def phase(self) -> GenerationState:
        return self._phase

    def _collect(self, events: list[Event], error: BaseException | None) -> None:
        self._pending.extend(events)  # (an error is the request's own: RequestState.error)
        if self._notify is not None:
            self._notify()

    # -- reading --------------------------------------------------------------------------------
    def take(self, wait: bool) -> list[Event]:
        if not self._turn.acquire(blocking=wait):
            return []  # another thread is stepping it: nothing without waiting
        try:
            return self._take(wait)
        finally:
            self._turn.release()

    def _take(self, wait: bool) -> list[Event]:
        req = self.request
        if not self._pending and not self._stopped and not req.finished:
            if self.slot.closed:
                raise EngineClosedError("the engine was closed before this generation finished")
            try:
                if self._phase == "new":
                    self._start()
                if self._phase == "preparing":
                    self._prepare(wait)
                if self._phase == "waiting":
                    self._enter(wait)
                if self._phase == "running":
                    self._step(wait)
            except BaseException:  # (EngineBusyError, a failed preparation, a Ctrl-C inside a step):
                self._stop()  # it ends here, as cancelled, and does not keep the engine
                raise
        if req.finished:  # (its last events may still be pending: the core is done with it)
            self._leave()
            if req.error is not None and not self._stopped and not self._pending:
                self._stopped = True
                raise req.error
        out, self._pending = self._pending, []
        return out

    def _start(self) -> None:
        spec = self.request.options.speculation
        if self.speculation is not None and not self.speculation.is_ready(spec):
            self._phase = "preparing"
            req = self.request
            self._preparation = _Preparation(self.speculation, spec, lambda: req.cancel.is_set() or req.abandoned)
        else:
            self._queued()

    def _queued(self) -> None:
        self._phase = "waiting"
        self.request.t_submit = time.perf_counter()  # ttft_s and queue_s count from here

    def _prepare(self, wait: bool) -> None:
        assert self._preparation is not None
        events, ready = self._preparation.take(wait)
        self._pending.extend(events)
        if ready is None:
            return
        self._preparation = None
        if ready:
            self._queued()
        else:
            self._end_unstarted()

    def _enter(self, wait: bool) -> None:
        req = self.request
        got = self.slot.acquire(self, wait=wait, cancelled=req.cancel.is_set)
        if got is None:  # (a poll: the engine is busy now)
            return
        if not got:
            self._end_unstarted()
            return
        self._holding = True
        self._phase = "running"
        if req.cancel.is_set():
            self.slot.abort(self)
        self.core.submit(req)

    def _step(self, wait: bool) -> None:
        req, core = self.request, self.core
        while not req.finished and not self._pending:
            if not core.step() and not req.finished:
                req.cancel.set()  # (the core had nothing to do for it, never expected: its next step ends it)
            if not wait:
                break

    def _end_unstarted(self) -> None:
        """Cancelled before it held the slot: the DoneEvent, without the core."""
        req = self.request
        self._pending.append(req.end("cancelled"))
        req.out.clear()
        req.release()  # (its sampler: the core never had it)
        self._phase = "done"

    def _leave(self) -> None:
        """The request ended: the slot is free for the next one."""
        self._phase = "done"
        if self._holding:
            self._holding = False
            self.slot.release(self)

    # -- stopping -------------------------------------------------------------------------------
    def interrupt(self) -> None:
        self.slot.abort(self)

    def close(self) -> None:
        self.request.cancel.set()
        self.slot.abort(self)
        with self._turn:  # a thread stepping it stops at the cancel
            self._stop()

    def reclaim(self) -> bool:
        if not self._turn.acquire(blocking=False):
            return False
        try:
            self._stop()
        finally:
            self._turn.release()
        return True

    def _stop(self) -> None:
        """End the request here, keeping what it generated (as cancelled); drop what was not read."""
        req = self.request
        self._stopped = True
        self._pending.clear()
        if self._preparation is not None:
            self._preparation.stop()
        try:
            if self._holding and not req.finished:
                req.cancel.set()
                while not req.finished and self.core.step():
                    pass
            if not req.finished:  # (never reached the core, or a step failed: nothing else frees it)
                req.end("cancelled")
                req.out.clear()
                req.release()
        finally:
            self._pending.clear()
            self._leave()


class _Preparation:
    """A draft model made ready in a worker thread, its progress events queued for the reader."""

    def __init__(self, source: SpeculationSource, spec: SpeculationOptions, cancelled: Callable[[], bool]):
        self._events: queue.SimpleQueue[SpeculationProgress | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._failure: list[BaseException] = []
        self._cancelled = cancelled

        def work() -> None:
            try:
                source.prepare(spec, self._events.put, lambda: self._stop.is_set() or cancelled())
            except BaseException as e:  # noqa: BLE001 - handed to the reader's thread
                self._failure.append(e)
            finally:
                self._events.put(None)

        threading.Thread(target=work, name="edgeinfer-prepare-speculation", daemon=True).start()

    def take(self, wait: bool) -> tuple[list[Event], bool | None]:
        """Progress events so far and the outcome: None while it runs, True when the draft model is
        ready, False when the request was cancelled meanwhile (raises the preparation's error)."""
        out: list[Event] = []
        while True:
            try:
                # with `wait`, until one event (a timeout keeps Ctrl-C deliverable)
                event = self._events.get(timeout=0.1) if wait and not out else self._events.get_nowait()
            except queue.Empty:
                if wait and not out:
                    continue
                return out, None
            if event is None:
                break
            out.append(event)
        if self._failure:
            if isinstance(self._failure[0], Cancelled) and self._cancelled():
                return out, False
            raise self._failure[0]
        return out, not self._cancelled()

    def stop(self) -> None:
        """The request was closed: the preparation stops at its next tensor."""
        self._stop.set()
