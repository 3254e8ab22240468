"""Bounded pools for the CPU-heavy steps of a request, off the event loop.

Tokenizing a large input, rendering a chat template, starting a generation (its grammar), an
embeddings call and encoding its vectors cost time that grows with the input. Each runs in a
`WorkPool`: a few daemon threads of its own (so a busy pool never holds up `/health`, the admin
routes or the process's exit), at most `max_waiting` jobs waiting for them (one more is a 503 with
Retry-After), and `timeout_s` for a job from its arrival to its end: then the request gets a 503
and the job is asked to stop (its cancel event; an embeddings call stops between two decodes, a
tokenizer call runs to its end, its result dropped).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from .errors import APIError

__all__ = ["WorkPool"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_Job = tuple[Callable[[threading.Event], Any], threading.Event, concurrent.futures.Future]


class WorkPool:
    """`await pool.run(fn)`: fn(cancel) in one of `workers` threads (see the module)."""

    def __init__(self, name: str, workers: int, max_waiting: int, timeout_s: float, flag: str = "--work-timeout"):
        self.name = name
        self.workers = workers
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self._flag = flag
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._waiting = 0  # jobs queued and not yet started
        self._running: set[threading.Event] = set()  # the cancel events of the jobs under way

    @property
    def waiting(self) -> int:
        return self._waiting

    async def run(self, fn: Callable[[threading.Event], T], what: str,
                  abandoned: Callable[[T], None] | None = None) -> T:
        """fn(cancel)'s result; APIError 503 when `max_waiting` jobs wait already, or when it takes
        longer than `timeout_s` (`cancel` is then set). `abandoned(result)` is called (in the
        worker) for a result nobody awaits any more (the request timed out or its client left)."""
        cancel = threading.Event()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            free = self._idle + self.workers - len(self._threads)  # threads that would take it now
            if self._waiting >= self.max_waiting + free:
                raise APIError(503, f"the server is busy: {self._waiting} {what} waiting for its {self.name} "
                               "threads; retry later", type="server_error", code="queue_full",
                               headers={"Retry-After": "1"})
            self._waiting += 1
            if self._idle < self._waiting and len(self._threads) < self.workers:
                thread = threading.Thread(target=self._work, name=f"edgeinfer-{self.name}-{len(self._threads)}",
                                          daemon=True)
                self._threads.append(thread)
                self._idle += 1
                thread.start()
        once = threading.Lock()  # a result nobody awaits is handed to `abandoned` once

        def drop(f: concurrent.futures.Future) -> None:
            if abandoned is not None and cancel.is_set() and f.done() and not f.cancelled() and \
                    f.exception() is None and once.acquire(blocking=False):
                abandoned(f.result())

        future.add_done_callback(drop)  # (a job that ends after its request gave up)
        self._jobs.put((fn, cancel, future))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except TimeoutError:
            cancel.set()
            drop(future)  # (a job that ended just as its request gave up: its callback saw no cancel)
            raise APIError(503, f"{what} took longer than {self.timeout_s:g} s ({self._flag}); retry later or send "
                           "less", type="server_error", code="timeout", headers={"Retry-After": "1"}) from None
        except asyncio.CancelledError:  # the request's task ended (its client left, or shutdown)
            cancel.set()
            drop(future)
            raise

    def cancel_all(self) -> None:
        """Ask every job under way to stop (shutdown)."""
        with self._lock:
            running = list(self._running)
        for cancel in running:
            cancel.set()

    def _work(self) -> None:
        while True:
            fn, cancel, future = self._jobs.get()
            with self._lock:
                self._idle -= 1
                self._waiting -= 1
                self._running.add(cancel)
            try:
                if cancel.is_set() or not future.set_running_or_notify_cancel():
                    continue  # its request gave up while it waited
                try:
                    result = fn(cancel)
                except BaseException as e:  # noqa: BLE001 - the awaiting request gets it
                    future.set_exception(e)
                else:
                    future.set_result(result)
            except Exception:  # noqa: BLE001 - a callback's failure must not end the thread
                log.exception("a %s job's result was not delivered", self.name)
            finally:
                with self._lock:
                    self._running.discard(cancel)
                    self._idle += 1
