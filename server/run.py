"""Running the app under uvicorn with a clean Ctrl-C.

On the first Ctrl-C (or SIGTERM) uvicorn stops accepting connections and lets running responses
finish; after `shutdown_grace_s` the engine cancels whatever still runs, so every open stream ends
with a final chunk whose finish_reason is "cancelled" rather than a cut connection. A second
Ctrl-C exits at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import uvicorn

import edgeinfer

from .app import create_app
from .config import ServerConfig

__all__ = ["serve"]

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None], on_ready: Callable[[str], None] | None):
        super().__init__(config)
        self._on_exit = on_exit
        self._on_ready = on_ready
        self._exit_started = False

    async def startup(self, sockets=None) -> None:  # type: ignore[no-untyped-def]
        await super().startup(sockets=sockets)
        if self.started and self._on_ready is not None and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self._on_ready(f"http://{host}:{port}/v1")

    def handle_exit(self, sig: int, frame) -> None:  # type: ignore[no-untyped-def]
        if not self._exit_started:
            self._exit_started = True
            self._on_exit()
        super().handle_exit(sig, frame)


def serve(engine: edgeinfer.BatchEngine, config: ServerConfig, *, on_ready: Callable[[str], None] | None = None,
          log_level: str = "warning") -> None:
    """Serve until Ctrl-C; the engine stays the caller's to close. `on_ready` gets the base URL
    (with the real port when config.port is 0)."""
    config = config.validate()
    app = create_app(engine, config)
    grace = config.shutdown_grace_s
    timer = threading.Timer(grace, engine.cancel_all)
    timer.daemon = True
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level,
                               timeout_graceful_shutdown=int(grace) + 5, lifespan="off")
    server = _Server(uv_config, timer.start, on_ready)
    try:
        server.run()
    finally:
        timer.cancel()
