"""A request's hold on a loaded model."""

from __future__ import annotations

import threading

from ..engine.faces.batch import BatchEngine
from .registry import HeldModel, Registry

__all__ = ["Lease"]


class Lease:
    """A request's hold on a loaded model: the model is not unloaded by eviction or keep-alive
    while any lease is held. `release()` (idempotent; also on `with` exit) ends it; its
    `keep_alive` (None: the model's) then sets how long the idle model stays."""

    def __init__(self, held: Registry, entry: HeldModel, keep_alive: float | None):
        self._held = held
        self._entry = entry
        self.engine: BatchEngine = entry.engine  # type: ignore[assignment]
        self.plan = entry.plan
        self.keep_alive = keep_alive
        self._released = False
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.plan.name

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        self._held.release(self._entry, self.keep_alive)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:  # a lease dropped without release must not pin its model for ever
        try:
            self.release()
        except Exception:  # pragma: no cover
            pass
