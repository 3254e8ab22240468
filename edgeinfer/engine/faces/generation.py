"""A request as its caller holds it, on either face: `Generation`, an iterator of its events.

The two faces differ in one thing only, how the events reach the handle, and that is a small
strategy object, its `Feed`: on `Engine` the caller's own `next()` steps the one-slot core inline
(faces/inline.py: no thread hop between a token and its reader); on `BatchEngine` a scheduler thread
steps the core and the handle waits on the request's bounded channel (faces/channel.py). Everything
else is this one class: its properties, cancel and close from any thread, `poll()` for async
readers, `result()`, and the tool-call layer (chat/tool_parser.py) a chat with tools parses its
events through.

No code runs when a handle is garbage: the core holds the request, never the handle, and the
request keeps only a weak reference to it (`RequestState.owner`). A handle its reader dropped is
noticed by the request's owner — the scheduler thread at its next step, the next request that wants
an Engine's one slot — which cancels it there, on a thread of its own, never the collector's.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Iterator
from typing import Literal, Protocol

from ...errors import EngineClosedError
from ..chat.tool_parser import ToolCallParser
from ..core.events import DoneEvent, Event, GenerationStats
from ..core.options import GenerateOptions
from ..core.request import RequestState

__all__ = ["Generation", "Feed", "GenerationState"]

GenerationState = Literal["new", "preparing", "waiting", "running", "done"]


class Feed(Protocol):
    """How a Generation's events reach it: the one thing the two faces do differently."""

    request: RequestState

    @property
    def phase(self) -> GenerationState:
        """new → (preparing →) waiting → running → done."""

    def take(self, wait: bool) -> list[Event]:
        """The request's next events. `wait`: at least one unless the request's events are all
        given out ([] then); else what is available now ([] if nothing). Raises the error that
        ended the request, once."""

    def interrupt(self) -> None:
        """The request was cancelled: reach into a running decode, or wake the scheduler."""

    def close(self) -> None:
        """Stop the request (it ends as cancelled) and free its slot; events not taken are dropped."""


class Generation(Iterator[Event]):
    """An iterator of (SpeculationProgress… PrefillProgress…) TokenEvent… then one DoneEvent; a chat
    with tools also yields ToolCallEvents, and its DoneEvent carries `tool_calls`.

    `cancel()` from any thread stops it as soon as possible (also inside a long prefill); a
    DoneEvent with finish_reason "cancelled" still follows. `close()` stops it here and frees its
    slot: iteration ends, and `done` / `result()` give what was generated, as cancelled. `poll()`
    returns the events available without waiting (on an Engine, one step of the core), for a
    reader on an event loop; `notify=` (given when the request was made) says when to poll.

    On an Engine a generation takes the engine on its first `next()` and gives it back when it
    ends or is closed. One that is kept but not run to its end holds the engine: other threads
    wait for it, and a new request from its own thread raises EngineBusyError (unless it was
    cancelled). One that is dropped (leaving a `for` loop early) is given up by the next request.
    On a BatchEngine a dropped generation is cancelled at the scheduler's next step.
    """

    def __init__(self, feed: Feed, tools: ToolCallParser | None = None):
        self._feed = feed
        self._req = feed.request
        self._tools = tools  # the tool-call layer: content TokenEvents, ToolCallEvents, the calls in `done`
        self._ready: collections.deque[Event] = collections.deque()  # taken and parsed, not yet read
        self._done: DoneEvent | None = None
        self._over = False  # the feed has given its last event (or its error)
        self._closed = False
        self._req.owner = weakref.ref(self)

    # -- what the request is -----------------------------------------------------------------------
    @property
    def options(self) -> GenerateOptions:
        return self._req.options

    @property
    def prompt_tokens(self) -> list[int]:
        return self._req.prompt

    @property
    def stats(self) -> GenerationStats:
        return self._req.stats

    @property
    def state(self) -> GenerationState:
        """new → (preparing →) waiting → running → done."""
        return self._feed.phase

    @property
    def cancelled(self) -> bool:
        return self._req.cancel.is_set()

    @property
    def finished(self) -> bool:
        """True once every event has been read (or the generation was closed and has ended)."""
        return self._over and not self._ready

    @property
    def done(self) -> DoneEvent | None:
        """The DoneEvent once the generation has ended, read or not (also when it was closed early;
        with tools: content as `text`, the calls as `tool_calls`)."""
        if self._done is not None or self._req.done is None:
            return self._done
        if self._tools is None:
            return self._req.done
        while not self._over and not self._closed:  # ended, not read to the end: parse what is pending
            self._fill(wait=True)
        if self._done is None:  # closed (or stopped by the engine's close): what was read is what was parsed
            self._done = self._parse([self._req.done])[-1]  # type: ignore[assignment]
        return self._done

    # -- reading ------------------------------------------------------------------------------------
    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> Event:
        while not self._ready:
            if self._over or self._closed:
                raise StopIteration
            self._fill(wait=True)
        return self._ready.popleft()

    def poll(self) -> list[Event]:
        """The events available now, without waiting for another request (raises the request's
        error, if any)."""
        if not self._ready and not self._over and not self._closed:
            self._fill(wait=False)
        out = list(self._ready)
        self._ready.clear()
        return out

    def result(self) -> DoneEvent:
        """Run to the end and return the DoneEvent (after `close()`: wait for the end)."""
        for _ in self:
            pass
        while not self._over and self._feed.take(wait=True):
            pass  # closed: what comes before the end is dropped
        self._over = True
        done = self.done
        if done is None:
            raise EngineClosedError("the engine was closed before this generation finished")
        return done

    def _fill(self, wait: bool) -> None:
        try:
            events = self._feed.take(wait)
        except BaseException:  # (the feed gives nothing more after its error, or raises it again)
            if self._done is None:
                self._done = self._req.done or DoneEvent("", [], "cancelled", self._req.stats)
            raise
        if wait and not events:
            self._over = True
            return
        self._ready.extend(self._parse(events))

    def _parse(self, events: list[Event]) -> list[Event]:
        out = list(self._tools.events(events)) if self._tools is not None else events
        if out and isinstance(out[-1], DoneEvent):
            self._done = out[-1]
            self._over = True
        return out

    # -- stopping -----------------------------------------------------------------------------------
    def cancel(self) -> None:
        """Stop as soon as possible (also inside a long prefill); a DoneEvent still follows."""
        self._req.cancel.set()
        self._feed.interrupt()

    def close(self) -> None:
        """Stop here and free the slot; `done` then holds what was generated, as cancelled (on a
        BatchEngine from the scheduler's next step: `result()` waits for it)."""
        self._closed = True
        self._ready.clear()
        if not self._over:
            self._feed.close()
