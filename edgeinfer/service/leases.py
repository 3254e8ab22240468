"""A request's hold on a loaded model.

Releasing is explicit: `release()`, or leaving a `with` block. Control flow does not depend on the
garbage collector: a lease dropped without release is reported (a ResourceWarning when it is
collected) and keeps its model busy until the model is stopped or the service closes.
"""

from __future__ import annotations

import threading
import warnings

from ..engine.faces.batch import BatchEngine
from .registry import HeldModel, Registry

__all__ = ["Lease"]


class Lease:
    """A request's hold on a loaded model: the model is not unloaded by eviction or keep-alive
    while any lease is held. `release()` (idempotent; also on `with` exit) ends it; its
    `keep_alive` (None: the model's) then sets how long the idle model stays. A lease is never
    released by the garbage collector."""

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

    def __del__(self) -> None:  # only a report: releasing takes the service's lock, never on the collector's thread
        if not self._released:
            warnings.warn(f"a lease on {self.plan.name} was never released: the model stays busy until it is stopped "
                          "(call release() or use `with`)", ResourceWarning, source=self, stacklevel=2)
