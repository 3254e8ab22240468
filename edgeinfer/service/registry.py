"""The models a service holds, under one lock: their states and leases, room by count and memory,
and unloading.

The service holds at most `max_loaded` models and at most `max_memory` bytes of them (default: what
this machine has available when the service starts). To make room it unloads the least recently
used *idle* model (no lease: no request running or waiting on it) — never one with running
requests; a model whose need exceeds the whole budget is an error before anything is unloaded; when
every loaded model is busy, a request waits up to `room_wait_s` for one to become idle, then gets
`NoRoomError` (`Cancelled` at once when its `cancel` is set: its client has gone).

The lock guards the bookkeeping only: loads and unloads run outside it.
"""

from __future__ import annotations

import logging
import threading
import time

from ..engine.faces.batch import BatchEngine
from ..errors import Cancelled, EdgeInferError
from .memory import ModelPlan, gb_text

__all__ = ["HeldModel", "NoRoomError", "Registry"]

log = logging.getLogger(__name__)


class NoRoomError(EdgeInferError, RuntimeError):
    """No room for a model now: every loaded model that would have to go is busy."""


class HeldModel:
    """One model the service holds, in one of three states (guarded by the registry's lock)."""

    def __init__(self, plan: ModelPlan, keep_alive: float, *, pinned: bool = False):
        self.plan = plan
        self.state = "loading"  # -> ready -> unloading (then removed)
        self.engine: BatchEngine | None = None
        self.done = threading.Event()  # the load ended (self.error says how)
        self.error: BaseException | None = None
        self.leases = 0
        self.keep_alive = keep_alive
        self.last_used = time.monotonic()
        self.expires: float | None = None  # monotonic; None: busy or for ever
        self.loaded_at: float | None = None
        self.load_s: float | None = None
        self.pinned = pinned  # the caller's engine: never unloaded by the service
        self.wanted: list[threading.Event | None] = []  # while loading: the waiting requests' cancels

    @property
    def abandoned(self) -> bool:
        """While loading: every request that waited for it was cancelled (None: one that cannot be)."""
        return bool(self.wanted) and all(c is not None and c.is_set() for c in self.wanted)

    @property
    def idle(self) -> bool:
        return self.state == "ready" and self.leases == 0 and not self.pinned


class Registry:
    """The held models by key (the resolved file path: one engine per file) and the condition whose
    lock guards them; `cond` is notified on every change (a release, an unload)."""

    def __init__(self, max_loaded: int, budget: int):
        self.cond = threading.Condition()
        self.entries: dict[str, HeldModel] = {}
        self.closed = False
        self.max_loaded = max_loaded
        self.budget = budget
        self.evictions = 0
        self.expirations = 0

    def make_room(self, plan: ModelPlan, evict: bool) -> list[HeldModel] | None:
        """(holds the lock) The idle models to unload, least recently used first, so that `plan`
        fits in the count and the budget; [] when it fits as it is; None when it cannot fit now
        (models that are busy, loading or unloading hold the room: nothing is chosen)."""
        held = list(self.entries.values())

        def fits(gone: list[HeldModel]) -> bool:
            rest = [e for e in held if e not in gone]
            return len(rest) < self.max_loaded and \
                sum(e.plan.memory.total for e in rest) + plan.memory.total <= self.budget

        victims: list[HeldModel] = []
        idle = sorted((e for e in held if e.idle), key=lambda e: e.last_used)
        while not fits(victims):
            if not idle or not evict:
                return None
            victims.append(idle.pop(0))
        for v in victims:
            v.state = "unloading"
        self.evictions += len(victims)
        return victims

    def wait(self, deadline: float, cancel: threading.Event | None, plan: ModelPlan) -> None:
        """(holds the lock) Wait for a change (a release, an unload), up to the deadline."""
        left = deadline - time.monotonic()
        if cancel is not None and cancel.is_set():
            raise Cancelled(f"the request for {plan.name} was cancelled while it waited for room")
        if left <= 0:
            busy = [e.plan.name for e in self.entries.values() if not e.idle]
            raise NoRoomError(
                f"no room for {plan.name} (~{gb_text(plan.memory.total)}): {', '.join(busy) or 'the loaded models'} "
                f"{'is' if len(busy) == 1 else 'are'} busy or pinned ({len(self.entries)} of --max-loaded "
                f"{self.max_loaded}, {gb_text(self.reserved())} of {gb_text(self.budget)} held); retry later")
        self.cond.wait(timeout=min(left, 0.5))

    def reserved(self) -> int:
        """(holds the lock) Estimated bytes of the models held (loading and unloading ones too)."""
        return sum(e.plan.memory.total for e in self.entries.values())

    def release(self, entry: HeldModel, keep_alive: float | None) -> None:
        """One lease on `entry` ended: the last one starts its keep-alive countdown (keep_alive 0:
        due at once, for the janitor)."""
        with self.cond:
            entry.leases -= 1
            entry.last_used = time.monotonic()
            if keep_alive is not None:
                entry.keep_alive = keep_alive  # the last request's keep_alive wins (as Ollama's)
            if entry.leases == 0 and entry.state == "ready" and not entry.pinned:
                if entry.keep_alive == 0:
                    entry.state = "unloading"
                    entry.expires = entry.last_used
                elif entry.keep_alive > 0:
                    entry.expires = entry.last_used + entry.keep_alive
            self.cond.notify_all()  # room waiters, and the janitor (a new deadline)

    def unload(self, entry: HeldModel, grace: float) -> None:
        """Close an entry marked unloading (outside the lock), then forget it."""
        try:
            if entry.engine is not None and not entry.pinned:
                entry.engine.close(grace)
        except Exception:  # an engine that fails to close must not keep its room for ever
            log.exception("closing %s failed", entry.plan.name)
        finally:
            with self.cond:
                if self.entries.get(entry.plan.key) is entry:
                    del self.entries[entry.plan.key]
                self.cond.notify_all()
        log.info("unloaded %s", entry.plan.name)
