"""The engine's one llama.cpp context, used by one request at a time.

A request holds the slot from its first step to its end; requests of other threads wait for it
(and can be cancelled while they wait). The slot keeps only a weak reference to the public
generation holding it, so a generation its caller dropped is finalized — and the slot released —
at once, and a thread that asks again while its own earlier request is suspended is told so
instead of waiting for itself for ever.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from ...errors import EngineBusyError, EngineClosedError
from ..llama.runtime import LlamaRuntime

__all__ = ["RequestSlot"]


class RequestSlot:
    """Exclusive use of one runtime. `acquire`/`release` around a generation, `hold()` around a
    synchronous call; `abort` interrupts the holder's running decode; `close` ends it all."""

    def __init__(self, runtime: LlamaRuntime):
        self.runtime = runtime
        self._lock = threading.Lock()
        self._meta = threading.Lock()  # guards the holder fields and `closed`
        self._holder: object | None = None
        self._holder_thread: int | None = None
        self._holder_handle: weakref.ref[Any] | None = None
        self.closed = False
        self._closing = False  # set before the holder is stopped: no waiter may slip in meanwhile

    def acquire(self, request: object, handle: weakref.ref[Any] | None = None,
                cancelled: Callable[[], bool] = lambda: False) -> bool:
        """Hold the slot for `request` (`handle`: a weak reference to its public generation).

        False when `cancelled()` turned true while waiting. Raises EngineClosedError once the
        engine is closed, EngineBusyError when this thread's own unfinished generation holds it.
        """
        self._settle_own_thread()
        while not self._lock.acquire(timeout=0.05):
            if self._closing:
                raise EngineClosedError("this engine is closed")
            if cancelled():
                return False
        with self._meta:
            if self.closed or self._closing:
                self._lock.release()
                raise EngineClosedError("this engine is closed")
            self._holder, self._holder_thread, self._holder_handle = request, threading.get_ident(), handle
        self.runtime.abort_flag.clear()
        return True

    def release(self, request: object) -> None:
        with self._meta:
            if self._holder is not request:
                return
            self._holder = self._holder_thread = self._holder_handle = None
            if not self.closed:
                self.runtime.abort_flag.clear()
        self._lock.release()

    def abort(self, request: object) -> None:
        """Interrupt the running decode of `request`, if it holds the slot."""
        with self._meta:
            if self._holder is request and not self.closed:
                self.runtime.abort_flag.set()

    @contextlib.contextmanager
    def hold(self) -> Iterator[LlamaRuntime]:
        """Hold the slot around a synchronous call (logits, reset)."""
        token = object()
        self.acquire(token)
        try:
            yield self.runtime
        finally:
            self.release(token)

    def _settle_own_thread(self) -> None:
        """Waiting for a request this very thread holds would wait for ever. Such a request is
        suspended (its caller left the loop): close it when nothing references it any more or it
        was cancelled; otherwise refuse with EngineBusyError."""
        with self._meta:
            if self._holder is None or self._holder_thread != threading.get_ident():
                return
            handle = self._holder_handle
        if handle is not None:
            gc.collect()  # a generation dropped inside a reference cycle: finalizing it releases the slot
        generation = handle() if handle is not None else None
        if handle is not None and generation is None:
            return
        if generation is not None and generation.cancelled:
            generation.close()
            return
        raise EngineBusyError(
            "this thread has an unfinished generation on this engine (its loop was left early); "
            "run it to the end, or cancel() or close() it, before starting another request"
        )

    def close(self, free: Callable[[], None]) -> None:
        """Stop the holder (cancel it, close it when suspended), wait for the slot, then free the
        runtime with `free()`. Whoever waits for the slot afterwards gets EngineClosedError."""
        with self._meta:
            if self.closed or self._closing:
                return
            self._closing = True  # a request waiting for the slot must not take it when the holder lets go
            handle = self._holder_handle
        generation = handle() if handle is not None else None
        if generation is not None:
            generation.cancel()
            try:
                generation.close()
            except ValueError:
                pass  # it is running in another thread and stops at the cancel
        with self._lock:
            with self._meta:
                self.closed = True
            free()
