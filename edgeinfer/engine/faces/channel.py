"""BatchEngine's way of feeding a Generation: the bounded channel the scheduler thread fills and
the reader drains (`ChannelFeed`, the handle's strategy; faces/generation.py)."""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

from ...errors import EngineClosedError
from ..core.events import DoneEvent, Event
from ..core.options import GenerateOptions
from ..core.request import RequestState
from ..core.sampler import Sampler
from .generation import GenerationState

__all__ = ["Channel", "ChannelFeed"]

log = logging.getLogger(__name__)


class Channel:
    """What the scheduler thread and the reader of one request share: the queued events.

    The scheduler holds only this (as the request's sink), never the Generation, so a reader that
    drops its generation leaves nothing behind that refers to it (the scheduler cancels the request
    at its next step: RequestState.abandoned)."""

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


class ChannelFeed:
    """A request queued on a BatchEngine, as its Generation reads it: blocking reads take one event
    at a time (so the channel's backlog is what the reader has not read, and a reader `max_backlog`
    behind pauses its own request), polls take all that is there. If the scheduler thread dies,
    every reader gets its error: none waits for ever."""

    def __init__(self, tokens: list[int], options: GenerateOptions, sampler: Sampler | None, logprobs: int | None,
                 notify: Callable[[], None] | None, wake: Callable[[], None], alive: Callable[[], bool],
                 max_backlog: int):
        self._ch = Channel(notify, wake, alive, max_backlog)
        self.request = RequestState(tokens, options, self._ch.push, logprobs=logprobs, sampler=sampler)
        self.request.backlog = self._ch.backlog
        self._ended = False  # the DoneEvent (or the error) has been taken

    @property
    def phase(self) -> GenerationState:
        req = self.request
        return "done" if req.finished else "running" if req.t_admit else "waiting"

    def take(self, wait: bool) -> list[Event]:
        ch = self._ch
        with ch.cond:
            if wait:
                while not ch.events and ch.error is None and not self._ended:
                    if not ch.cond.wait(timeout=1.0) and not ch.alive() and not ch.events and ch.error is None:
                        ch.error = EngineClosedError("the engine's scheduler stopped before this request finished")
            elif not ch.events and ch.error is None and not self._ended and not ch.alive():
                ch.error = EngineClosedError("the engine's scheduler stopped before this request finished")
            backlog = len(ch.events)
            if ch.events:
                out = [ch.events.popleft()] if wait else list(ch.events)
                if not wait:
                    ch.events.clear()
                self._ended = self._ended or isinstance(out[-1], DoneEvent)
            elif ch.error is not None and not self._ended:
                error, ch.error = ch.error, None
                self._ended = True
                raise error
            else:
                out = []
        if backlog >= ch.max_backlog:
            ch.wake()  # the request was paused for this reader: it can go on
        return out

    def interrupt(self) -> None:
        self._ch.wake()

    def close(self) -> None:
        if not self._ch.finished:
            self.request.cancel.set()
            self._ch.wake()
