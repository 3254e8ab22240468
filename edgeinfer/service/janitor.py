"""The service's janitor thread: it unloads the models whose keep-alive ran out (and those released
with keep_alive 0), never in the releasing thread (a server releases from its event loop).

It cannot die silently: a failure in one round is logged and the next round goes on (after a
pause that doubles up to a minute while failures repeat); each unload runs in a thread of its own,
so an engine slow to close holds up no other model's unload; no wait is longer than MAX_WAIT (a
deadline years away never reaches Python's limit on waits). Should the thread still end,
`ensure_running` (called by the service's health check and its leases) starts it again, and it
takes up every model left marked for it.
"""

from __future__ import annotations

import logging
import threading
import time

from .registry import HeldModel, Registry

__all__ = ["Janitor", "MAX_WAIT"]

log = logging.getLogger(__name__)

MAX_WAIT = 60.0  # seconds between two looks at the deadlines, at most
_FIRST_PAUSE = 1.0  # seconds after a failed round (doubling up to MAX_WAIT while they repeat)


class Janitor:
    """Watches the registry's keep-alive deadlines until the registry closes (`join` then)."""

    def __init__(self, held: Registry):
        self._held = held
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.restarts = 0  # times the thread was found dead and started again
        self.ensure_running()

    def ensure_running(self) -> bool:
        """Start the thread where it is not running (unless the registry closed); False when it
        had stopped (logged: a bug), True when it was running."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return True
            if self._held.closed:
                return True
            died = self._thread is not None
            if died:
                self.restarts += 1
                log.error("the service's janitor thread had stopped: started again")
            self._thread = threading.Thread(target=self._run, name="edgeinfer-service-janitor", daemon=True)
            self._thread.start()
            return not died

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        pause = _FIRST_PAUSE
        while True:
            try:
                due = self._wait_for_due()
                if due is None:
                    return
                self._unload(due)
                pause = _FIRST_PAUSE
            except Exception:  # noqa: BLE001 - logged; the janitor goes on
                log.exception("the service's janitor failed a round (it goes on in %.0f s)", pause)
                with self._held.cond:
                    self._held.cond.wait(timeout=pause)
                pause = min(pause * 2, MAX_WAIT)

    def _wait_for_due(self) -> list[HeldModel] | None:
        """The models to unload now, marked as the janitor's (None: the registry closed)."""
        held = self._held
        with held.cond:
            while True:
                if held.closed:
                    return None
                now = time.monotonic()
                due = [e for e in held.entries.values() if _due(e, now)]
                if due:
                    for e in due:
                        if e.state == "ready":
                            held.expirations += 1
                            e.mark_unloading()
                        e.claimed = True
                        e.expires = None
                    return due
                next_at = [e.expires for e in held.entries.values()
                           if e.expires is not None and e.leases == 0 and e.state == "ready"]
                held.cond.wait(timeout=min(MAX_WAIT, max(0.01, min(next_at) - now)) if next_at else MAX_WAIT)

    def _unload(self, due: list[HeldModel]) -> None:
        failed: list[HeldModel] = []
        for e in due:
            try:
                log.info("unloading %s (keep_alive %s ran out)", e.plan.name, _duration_text(e.keep_alive))
                self._held.unload_in_background(e, 0.0)
            except Exception:  # noqa: BLE001 - e.g. no thread to be had: that model waits for the next round
                log.exception("unloading %s failed to start (tried again later)", e.plan.name)
                failed.append(e)
        if failed:
            with self._held.cond:
                for e in failed:
                    e.claimed = False
            raise RuntimeError(f"{len(failed)} unload(s) did not start")


def _due(e: HeldModel, now: float) -> bool:
    """(holds the lock) An idle model whose keep-alive ran out, or one released with keep_alive 0."""
    if e.leases or e.pinned or e.engine is None or e.claimed:
        return False
    if e.state == "unloading":
        return True
    return e.state == "ready" and e.expires is not None and e.expires <= now


def _duration_text(seconds: float) -> str:
    return "for ever" if seconds < 0 else f"{seconds:g} s"
