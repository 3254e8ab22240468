"""A generation on `Engine`: the scheduler core stepped inline, from the caller's own `next()`.

The engine's core has one slot; a generation holds it (the engine's RequestSlot lock) from its
first step to its end, submits its one request and steps the core until the request is done,
yielding the events each step produced — no thread hop between a token and its caller. A cancel
from any thread reaches into a running prefill decode through llama.cpp's abort callback.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterator
from typing import Literal, Protocol

from ...cancel import CancelToken
from ...errors import Cancelled, EngineClosedError
from ..core.events import DoneEvent, Event, SpeculationProgress
from ..core.options import GenerateOptions, SpeculationOptions
from ..core.request import RequestState
from ..core.sampler import Sampler
from ..core.scheduler import Scheduler
from .exclusive import RequestSlot

__all__ = ["Generation", "SpeculationSource", "GenerationState"]

GenerationState = Literal["new", "preparing", "waiting", "running", "done"]


class SpeculationSource(Protocol):
    """How a generation gets its draft model ready: the engine's side of speculation."""

    def is_ready(self, spec: SpeculationOptions) -> bool:
        """Whether `spec` needs no preparation (any draft model it names is open)."""

    def prepare(self, spec: SpeculationOptions, progress: Callable[[SpeculationProgress], None],
                cancel: CancelToken) -> None:
        """Find, make (quantize) and open the draft model `spec` names, reporting progress."""


class _Request:
    """A generation's state, shared by its public handle and its loop. The loop never references
    the handle, so dropping the handle finalizes the loop (and frees the engine) at once."""

    def __init__(self, prompt: list[int], options: GenerateOptions, slot: RequestSlot, core: Scheduler,
                 speculation: SpeculationSource | None, sampler: Sampler | None = None):
        self.prompt = prompt
        self.options = options
        self.slot = slot
        self.core = core
        self.speculation = speculation
        self.cancel = threading.Event()
        self.events: list[Event] = []
        self.error: BaseException | None = None
        self.state = RequestState(prompt, options, self._collect, cancel=self.cancel, sampler=sampler)
        self.phase: GenerationState = "new"
        self.handle: weakref.ref[Generation] | None = None

    def _collect(self, events: list[Event], error: BaseException | None) -> None:
        self.events.extend(events)
        if error is not None:
            self.error = error


class Generation(Iterator[Event]):
    """An iterator of (PrefillProgress…) TokenEvent… then one DoneEvent. Cancel from any thread
    with `cancel()`.

    A generation whose speculation needs a draft model not yet open first prepares it (a
    self-draft copy may be quantized) and yields SpeculationProgress events meanwhile; call
    `Engine.prepare_speculation` beforehand to do that on your own terms.

    The engine runs one generation at a time: iterating takes the engine on the first `next()`
    and releases it when the generation ends, is closed, or is dropped (leaving a `for` loop over
    `engine.chat(...)` early drops it). A generation that is kept but not run to the end holds
    the engine: other threads wait for it, and a new request from its own thread raises
    EngineBusyError (unless it was cancelled: then it is closed first).
    """

    def __init__(self, slot: RequestSlot, core: Scheduler, prompt: list[int], options: GenerateOptions,
                 speculation: SpeculationSource | None = None, sampler: Sampler | None = None):
        """`sampler`: the request's, made when it was checked (where it has a grammar); it owns it."""
        self._req = _Request(prompt, options, slot, core, speculation, sampler)
        self._req.handle = weakref.ref(self)
        self._it = _run(self._req)

    # -- public ----------------------------------------------------------------------------------
    @property
    def options(self) -> GenerateOptions:
        return self._req.options

    @property
    def stats(self):  # noqa: ANN201 - GenerationStats
        return self._req.state.stats

    @property
    def done(self) -> DoneEvent | None:
        """The DoneEvent, once the generation has ended (also when it was closed early)."""
        return self._req.state.done

    @property
    def state(self) -> GenerationState:
        """new → (preparing →) waiting → running → done."""
        return self._req.phase

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> Event:
        if self._req.state.done is None and self._req.slot.closed:
            self._it.close()
            raise EngineClosedError("the engine was closed before this generation finished")
        return next(self._it)

    def cancel(self) -> None:
        """Stop as soon as possible (also inside a long prefill); a DoneEvent still follows."""
        self._req.cancel.set()
        self._req.slot.abort(self._req)

    @property
    def cancelled(self) -> bool:
        return self._req.cancel.is_set()

    def result(self) -> DoneEvent:
        """Run to the end and return the DoneEvent."""
        for _ in self:
            pass
        done = self._req.state.done
        if done is None:
            raise EngineClosedError("the engine was closed before this generation finished")
        return done

    def close(self) -> None:
        """Stop here and free the engine; `done` then holds what was generated, as cancelled."""
        self._it.close()
        req = self._req
        req.phase = "done"
        if req.state.done is None:  # closed before it ran
            req.state.end("cancelled")

    def __del__(self) -> None:
        try:
            self._it.close()
        except Exception:  # noqa: BLE001 - running in another thread: it ends on its own
            pass


# -- the loop -----------------------------------------------------------------------------------------


def _run(req: _Request) -> Iterator[Event]:
    spec = req.options.speculation
    if req.speculation is not None and not req.speculation.is_ready(spec):
        req.phase = "preparing"
        prepared = yield from _prepare(req)
        if not prepared:
            req.phase = "done"
            req.state.release()
            yield req.state.end("cancelled")
            return
    req.phase = "waiting"
    # Queued from now (after any draft-model preparation): ttft_s and queue_s count from here.
    req.state.t_submit = time.perf_counter()
    if not req.slot.acquire(req, req.handle, cancelled=req.cancel.is_set):
        req.phase = "done"
        req.state.release()
        yield req.state.end("cancelled")
        return
    core, state = req.core, req.state
    try:
        req.phase = "running"
        if req.cancel.is_set():
            req.slot.abort(req)
        core.submit(state)
        while not state.finished:
            core.step()
            if req.error is not None:
                raise req.error
            events, req.events = req.events, []
            yield from events
    finally:
        req.phase = "done"
        try:
            if not state.finished:  # closed early (or an error): keep what was generated, as cancelled
                state.cancel.set()
                while not state.finished and core.step():
                    pass
                if not state.finished:
                    state.end("cancelled")
        finally:
            req.slot.release(req)


def _prepare(req: _Request) -> Generator[SpeculationProgress, None, bool]:
    """Prepare the request's speculation in a worker thread and yield its progress events.
    False when the request was cancelled meanwhile."""
    assert req.speculation is not None
    events: queue.SimpleQueue[SpeculationProgress | None] = queue.SimpleQueue()
    stop = threading.Event()
    failure: list[BaseException] = []
    source, spec = req.speculation, req.options.speculation

    def work() -> None:
        try:
            source.prepare(spec, events.put, lambda: stop.is_set() or req.cancel.is_set())
        except BaseException as e:  # noqa: BLE001 - handed to the generation's thread
            failure.append(e)
        finally:
            events.put(None)

    threading.Thread(target=work, name="edgeinfer-prepare-speculation", daemon=True).start()
    try:
        while True:
            try:
                event = events.get(timeout=0.1)  # a timeout keeps Ctrl-C deliverable
            except queue.Empty:
                continue
            if event is None:
                break
            yield event
    finally:
        stop.set()  # a generation closed meanwhile stops the preparation at its next tensor
    if failure:
        if isinstance(failure[0], Cancelled) and req.cancel.is_set():
            return False
        raise failure[0]
    return not req.cancel.is_set()
