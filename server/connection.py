"""uvicorn's h11 connection with the deadlines and the limit it lacks.

uvicorn closes an idle keep-alive connection after a few seconds, but a connection that sends
part of a request head and then trickles it (slowloris), or a head and never its body, stays open
for as long as the client likes; so does one whose client stops reading its response (its
request would hold a slot, paused, forever). Each connection here is in at most one phase with a
deadline, and is aborted when it passes:

- head: from the connection's start, or a keep-alive request's first byte, to the end of the head;
- body: from the end of the head to the end of the body;
- stall: while the response cannot be written (the client's buffers are full), the client must
  take some of it every `stall_timeout_s`; one that reads nothing for that long is aborted, and
  the app sees an ordinary disconnect and cancels the request (a slow reader that keeps reading,
  e.g. a large response over a slow link, is not a stalled one).

The kernel's send buffer is held at 64 KiB: Linux grows it to ~4 MB on loopback, which would let
a client that never reads swallow thousands of tokens before anything noticed, and would cost
that much memory per connection.

A request arriving while more than `max_connections` connections are open gets a 503 with
Retry-After and its connection is closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .config import ServerConfig

__all__ = ["protocol_for", "SEND_BUFFER_BYTES"]

log = logging.getLogger("edgeinfer_server.connection")

SEND_BUFFER_BYTES = 64 * 1024


class _GuardedH11(H11Protocol):
    limits: ServerConfig  # set by protocol_for

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._phase: str | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._unsent = 0  # bytes waiting in the transport when the stall phase (re)started
        app = self.app

        async def limited(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
            if len(self.connections) > self.limits.max_connections:
                await _send_busy(send, self.limits.max_connections)
                return
            await app(scope, receive, send)

        self.app = limited

    # -- the asyncio.Protocol interface: each event may change the phase -------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            except OSError:  # pragma: no cover - not a TCP socket
                pass
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._arm(None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._watch()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._watch()

    # -- deadlines -------------------------------------------------------------------------------
    def _watch(self) -> None:
        phase = None
        if self.transport is not None and not self.transport.is_closing():
            their = self.conn.their_state
            if their is h11.IDLE:
                # a new connection, or a keep-alive one with part of its next head (an idle
                # keep-alive connection is uvicorn's: it closes it after timeout_keep_alive)
                if self.cycle is None or self.conn.trailing_data[0]:
                    phase = "head"
            elif their is h11.SEND_BODY:
                phase = "body"
            elif self.flow is not None and self.flow.write_paused:
                phase = "stall"
        self._arm(phase)

    def _arm(self, phase: str | None) -> None:
        if phase == self._phase:
            return  # a deadline runs from the start of its phase: more bytes do not extend it
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._phase = phase
        if phase is not None:
            if phase == "stall":
                self._unsent = self.transport.get_write_buffer_size()
            self._timer = self.loop.call_later(self._timeout(phase), self._expire, phase)

    def _timeout(self, phase: str) -> float:
        c = self.limits
        return {"head": c.header_timeout_s, "body": c.body_timeout_s, "stall": c.stall_timeout_s}[phase]

    def _expire(self, phase: str) -> None:
        self._timer = None
        if self.transport is None or self.transport.is_closing():
            return
        t = self._timeout(phase)
        if phase == "stall":
            unsent = self.transport.get_write_buffer_size()
            if unsent < self._unsent:  # it took some (while paused, only the client's reading shrinks the buffer)
                self._unsent = unsent
                self._timer = self.loop.call_later(t, self._expire, phase)
                return
        who = "%s:%d" % self.client if self.client else "a client"
        if phase == "stall":
            log.warning("%s read nothing of its response for %g s (--stall-timeout): connection closed, "
                        "its request cancelled", who, t)
        else:
            what = "head" if phase == "head" else "body"
            flag = "--header-timeout" if phase == "head" else "--body-timeout"
            log.info("%s sent no complete request %s within %g s (%s): connection closed", who, what, t, flag)
        self.transport.abort()  # not close(): that would wait for a stalled reader to take the buffer


async def _send_busy(send, limit: int) -> None:  # type: ignore[no-untyped-def]
    body = json.dumps({"error": {
        "message": f"the server has {limit} open connections (--max-connections): retry later",
        "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def protocol_for(config: ServerConfig) -> type[H11Protocol]:
    """The protocol class uvicorn instantiates per connection, bound to `config`'s limits."""
    return type("EdgeInferH11Protocol", (_GuardedH11,), {"limits": config})
