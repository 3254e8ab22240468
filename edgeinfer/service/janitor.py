"""The service's janitor thread: it unloads the models whose keep-alive ran out (and those released
with keep_alive 0), never in the releasing thread (a server releases from its event loop)."""

from __future__ import annotations

import logging
import threading
import time

from .registry import Registry

__all__ = ["Janitor"]

log = logging.getLogger(__name__)


class Janitor:
    """Watches the registry's keep-alive deadlines until the registry closes (`join` then)."""

    def __init__(self, held: Registry):
        self._held = held
        self._thread = threading.Thread(target=self._run, name="edgeinfer-service-janitor", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        held = self._held
        while True:
            with held.cond:
                while True:
                    if held.closed:
                        return
                    now = time.monotonic()
                    due = [e for e in held.entries.values()
                           if e.leases == 0 and not e.pinned and e.expires is not None and e.expires <= now
                           and e.state in ("ready", "unloading") and e.engine is not None]
                    if due:
                        break
                    next_at = [e.expires for e in held.entries.values() if e.expires is not None and e.leases == 0]
                    held.cond.wait(timeout=max(0.01, min(next_at) - now) if next_at else None)
                for e in due:
                    if e.state == "ready":
                        held.expirations += 1
                    e.state = "unloading"
                    e.expires = None
            for e in due:
                log.info("unloading %s (keep_alive %s ran out)", e.plan.name, _duration_text(e.keep_alive))
                held.unload(e, 0.0)


def _duration_text(seconds: float) -> str:
    return "for ever" if seconds < 0 else f"{seconds:g} s"
