"""The Engine's one llama.cpp context, used by one request at a time.

A request holds the slot from its first step to its end; requests of other threads wait for it
(and can be cancelled while they wait). What holds it is the request's feed (faces/inline.py),
never its public Generation: a holder whose generation was dropped (its weak reference is dead) or
cancelled, and which no thread is stepping, is ended by the next thread that wants the slot — on
that thread, not the garbage collector's. A thread that asks again while its own earlier, live
generation is suspended is told so (EngineBusyError) instead of waiting for itself for ever.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

from ...errors import EngineBusyError, EngineClosedError
from ..core.request import RequestState
from ..llama.runtime import LlamaRuntime

__all__ = ["RequestSlot", "Holder"]

# How often a thread waiting for the slot looks again at a holder: a generation dropped or cancelled
# meanwhile is noticed (and ended) within this, as is a cancel of the waiting request itself.
RECHECK_S = 0.05


class Holder(Protocol):
    """A generation's side of the slot (faces/inline.py's InlineFeed)."""

    request: RequestState

    def reclaim(self) -> bool:
        """End the request here (cancelled) and release the slot, unless a thread is stepping it
        right now (False: that thread ends it)."""


class RequestSlot:
    """Exclusive use of one runtime. `acquire`/`release` around a generation, `hold()` around a
    synchronous call; `abort` interrupts the holder's running decode; `close` ends it all."""

    def __init__(self, runtime: LlamaRuntime):
        self.runtime = runtime
        self._cond = threading.Condition()  # guards every field below
        self._holder: object | None = None
        self._holder_thread: int | None = None
        self.closed = False
        self._closing = False  # set before the holder is stopped: no waiter may slip in meanwhile

    def acquire(self, holder: object, *, wait: bool = True,
                cancelled: Callable[[], bool] = lambda: False) -> bool | None:
        """Hold the slot for `holder`. False when `cancelled()` turned true while waiting; None
        when `wait` is false and the slot is not free now. Raises EngineClosedError once the engine
        is closed, EngineBusyError when this thread's own unfinished generation holds it."""
        me = threading.get_ident()
        while True:
            with self._cond:
                if self.closed or self._closing:
                    raise EngineClosedError("this engine is closed")
                if self._holder is None:
                    self._holder, self._holder_thread = holder, me
                    self.runtime.abort_flag.clear()
                    return True
                stale = self._stale(me)
                if stale is None:
                    if cancelled():
                        return False
                    if not wait:
                        return None
                    self._cond.wait(RECHECK_S)
                    continue
            if not stale.reclaim():  # outside the lock: it steps the core and then releases the slot
                with self._cond:
                    self._cond.wait(RECHECK_S)

    def _stale(self, me: int) -> Holder | None:
        """The holder, when nobody will go on with it: its generation dropped or cancelled. Raises
        EngineBusyError when it is this very thread's live, unfinished generation. (Holds the lock.)"""
        holder = self._holder
        request = getattr(holder, "request", None)
        if request is None:  # a synchronous call (`hold`) of another thread: it ends on its own
            return None
        if request.abandoned or request.cancel.is_set():
            return holder  # type: ignore[return-value]
        if self._holder_thread == me:
            raise EngineBusyError(
                "this thread has an unfinished generation on this engine (its loop was left early); "
                "run it to the end, or cancel() or close() it, before starting another request")
        return None

    def release(self, holder: object) -> None:
        with self._cond:
            if self._holder is not holder:
                return
            self._holder = self._holder_thread = None
            if not self.closed:
                self.runtime.abort_flag.clear()
            self._cond.notify_all()

    def abort(self, holder: object) -> None:
        """Interrupt the running decode of `holder`, if it holds the slot."""
        with self._cond:
            if self._holder is holder and not self.closed:
                self.runtime.abort_flag.set()

    @contextlib.contextmanager
    def hold(self) -> Iterator[LlamaRuntime]:
        """Hold the slot around a synchronous call (logits, reset, a slot's KV state)."""
        token = object()
        self.acquire(token)
        try:
            yield self.runtime
        finally:
            self.release(token)

    def close(self, free: Callable[[], None]) -> None:
        """Stop the holder (cancel it; end it here when it is suspended), wait for the slot, then
        free the runtime with `free()`. Whoever waits for the slot afterwards gets EngineClosedError."""
        with self._cond:
            if self.closed or self._closing:
                return
            self._closing = True  # a request waiting for the slot must not take it when the holder lets go
            holder = self._holder
            self._cond.notify_all()
        request = getattr(holder, "request", None)
        if request is not None:
            request.cancel.set()
            self.abort(holder)
            holder.reclaim()  # type: ignore[union-attr]  # (stepped by another thread: it stops at the cancel)
        with self._cond:
            while self._holder is not None:
                self._cond.wait()
            self.closed = True
        free()
