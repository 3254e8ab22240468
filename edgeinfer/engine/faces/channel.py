"""A BatchEngine request as its submitter sees it: the bounded channel the scheduler thread fills
and the reader drains (`BatchGeneration`, an iterator of events that also polls without blocking)."""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Iterator

from ...errors import EngineClosedError
from ..core.events import DoneEvent, Event, GenerationStats
from ..core.options import GenerateOptions
from ..core.request import RequestState

__all__ = ["Channel", "BatchGeneration"]

log = logging.getLogger(__name__)


class Channel:
    """What the scheduler thread and the reader of one request share: the queued events.

    The scheduler holds only this (as the request's sink), never the BatchGeneration, so a reader
    that drops its generation (garbage) cancels it at once."""

    def __init__(self, notify: Callable[[], None] | None, wake: Callable[[], None], alive: Callable[[], bool],
                 max_backlog: int):
        self.notify = notify
        self.wake = wake  # tells the scheduler that a paused request may go on
        self.alive = alive  # whether the scheduler thread still runs
        self.max_backlog = max_backlog
        self.cond = threading.Condition()
        self.events: collections.deque[Event] = collections.deque()
        self.error: BaseException | None = None
        self.finished = False  # the DoneEvent (or an error) has been queued

    def backlog(self) -> int:
        return len(self.events)

    def push(self, events: list[Event], error: BaseException | None = None) -> None:
        with self.cond:
            self.events.extend(events)
            if error is not None:
                self.error = error
            if error is not None or (events and isinstance(events[-1], DoneEvent)):
                self.finished = True
            self.cond.notify_all()
        if self.notify is not None:
            try:
                self.notify()
            except Exception:  # a closed event loop must not stop the scheduler
                log.debug("notify callback failed", exc_info=True)


class BatchGeneration(Iterator[Event]):
    """An iterator of TokenEvent… then one DoneEvent, fed by the engine's scheduler thread.

    `cancel()` works from any thread and frees the slot at the next step; dropping the object
    (or `close()`) cancels too. Async consumers pass `notify` to `submit` (called from the
    scheduler thread whenever events arrive) and drain with `poll()` instead of blocking. If the
    scheduler thread dies, every reader gets its error: none waits for ever.
    """

    def __init__(self, channel: Channel, request: RequestState):
        self._ch = channel
        self._req = request
        self.done: DoneEvent | None = None

    @property
    def options(self) -> GenerateOptions:
        return self._req.options

    @property
    def stats(self) -> GenerationStats:
        return self._req.stats

    @property
    def prompt_tokens(self) -> list[int]:
        return self._req.prompt

    def __iter__(self) -> BatchGeneration:
        return self

    def __next__(self) -> Event:
        ch = self._ch
        with ch.cond:
            while not ch.events and ch.error is None and self.done is None:
                if not ch.cond.wait(timeout=1.0) and not ch.alive() and not ch.events and ch.error is None:
                    ch.error = EngineClosedError("the engine's scheduler stopped before this request finished")
            before = len(ch.events)
            event = self._take()
        self._maybe_wake(before)
        return event

    def poll(self) -> list[Event]:
        """The events available now, without waiting (raises the engine's error, if any)."""
        ch = self._ch
        out: list[Event] = []
        with ch.cond:
            before = len(ch.events)
            while ch.events:
                out.append(self._take())
            if not out and ch.error is None and self.done is None and not ch.alive():
                ch.error = EngineClosedError("the engine's scheduler stopped before this request finished")
            if not out and ch.error is not None:
                self._take()
        self._maybe_wake(before)
        return out

    @property
    def finished(self) -> bool:
        """True once every event has been read."""
        return self.done is not None

    def _take(self) -> Event:  # holds the channel's lock
        ch = self._ch
        if ch.events:
            event = ch.events.popleft()
            if isinstance(event, DoneEvent):
                self.done = event
            return event
        if ch.error is not None:
            error, ch.error = ch.error, None
            self.done = DoneEvent("", [], "cancelled", self._req.stats)  # nothing more will come
            raise error
        raise StopIteration

    def _maybe_wake(self, backlog_before: int) -> None:
        if backlog_before >= self._ch.max_backlog:
            self._ch.wake()  # the request was paused for this reader: it can go on

    def cancel(self) -> None:
        """Stop as soon as possible; a DoneEvent with finish_reason "cancelled" still follows."""
        self._req.cancel.set()
        self._ch.wake()

    @property
    def cancelled(self) -> bool:
        return self._req.cancel.is_set()

    def result(self) -> DoneEvent:
        """Run to the end and return the DoneEvent."""
        for _ in self:
            pass
        assert self.done is not None
        return self.done

    def close(self) -> None:
        if not self._ch.finished:
            self.cancel()

    def __del__(self) -> None:  # an abandoned request frees its slot
        try:
            self.close()
        except Exception:  # pragma: no cover
            pass
