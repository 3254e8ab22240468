"""Running the app under uvicorn: the port taken first, a clean Ctrl-C or SIGTERM.

`bind()` takes the port before anything slow happens (the CLI calls it before loading the model),
so a port in use is one line, not a loaded model followed by uvicorn's own error and exit 3.

On the first Ctrl-C or SIGTERM uvicorn stops accepting connections and lets running responses
finish; after `shutdown_grace_s` every loaded model cancels whatever still runs (and the server's
worker pools their embeddings, between two decodes), so every open stream ends with a final chunk
whose finish_reason is "cancelled" rather than a cut connection. `serve` then
returns (the signal is not raised again: SIGTERM would kill the process before the caller closes
the engine). A second Ctrl-C exits at once.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import threading
from collections.abc import Callable, Iterator

import uvicorn

import edgeinfer
from edgeinfer.service import ModelService

from .app import create_app
from .config import ServerConfig
from .connection import protocol_for

__all__ = ["serve", "bind", "ListenError"]

log = logging.getLogger(__name__)

_BACKLOG = 2048  # uvicorn's default


class ListenError(edgeinfer.EdgeInferError, OSError):
    """The address or port cannot be listened on."""


def bind(host: str, port: int) -> socket.socket:
    """A socket listening on host:port (port 0: a free one)."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise ListenError(f"cannot listen on {where}: {getattr(e, 'strerror', None) or e}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(_BACKLOG)
    except OSError as e:
        sock.close()
        hint = {errno.EADDRINUSE: " (another program listens there: pick another --port, or 0 for a free one)",
                errno.EACCES: " (ports below 1024 need privileges: pick another --port)",
                errno.EADDRNOTAVAIL: " (no interface of this machine has that address: check --host)"}.get(e.errno, "")
        raise ListenError(f"cannot listen on {where}: {e.strerror or e}{hint}") from None
    sock.set_inheritable(True)
    return sock


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
            self._on_ready(f"http://[{host}]:{port}/v1" if ":" in host else f"http://{host}:{port}/v1")

    def handle_exit(self, sig: int, frame) -> None:  # type: ignore[no-untyped-def]
        if not self._exit_started:
            self._exit_started = True
            self._on_exit()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn raises a handled signal again once it has shut down, so that SIGTERM kills the
        # process (exit 143) before the caller can close the engine; the shutdown is done.
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals.clear()


def serve(models: ModelService | edgeinfer.BatchEngine, config: ServerConfig, *, sock: socket.socket | None = None,
          on_ready: Callable[[str], None] | None = None, on_signal: Callable[[], None] | None = None,
          log_level: str = "warning") -> None:
    """Serve until Ctrl-C or SIGTERM; the model service (or an engine, served as a service's
    default model) stays the caller's to close. `sock`: a socket from `bind()` (default: bound
    here). `on_ready` gets the base URL (with the real port when config.port is 0); `on_signal`
    is called at the first Ctrl-C or SIGTERM (the CLI arms its exit deadline there)."""
    config = config.validate()
    if isinstance(models, edgeinfer.BatchEngine):
        models = ModelService.adopt(models)
    app = create_app(models, config)
    if sock is None:
        sock = bind(config.host, config.port)
    grace = config.shutdown_grace_s
    timer = threading.Timer(grace, app.state.cancel_all)
    timer.daemon = True

    def on_exit() -> None:
        timer.start()
        if on_signal is not None:
            on_signal()

    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level, http=protocol_for(config),
                               timeout_graceful_shutdown=int(grace) + 5, lifespan="off")
    server = _Server(uv_config, on_exit, on_ready)
    try:
        server.run(sockets=[sock])
    finally:
        timer.cancel()
        sock.close()
