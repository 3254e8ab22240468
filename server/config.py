"""What a server is allowed to do: where it listens, who may call it, how big a request may be."""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass

import edgeinfer

__all__ = ["ServerConfig", "is_loopback", "check_credentials"]


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name or 0.0.0.0-like wildcard: reachable from elsewhere


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None  # Bearer token; required when host is not loopback
    max_body_bytes: int = 1 << 20  # 1 MiB of JSON is far more than any context holds
    max_tokens_limit: int | None = None  # None: the per-request context
    default_speculation: str = "off"  # off | lookup | auto
    shutdown_grace_s: float = 5.0  # Ctrl-C: running requests may finish for this long
    keepalive_s: float = 15.0  # SSE comment lines while a stream waits (queued requests)

    def validate(self) -> ServerConfig:
        if not is_loopback(self.host) and not self.api_key:
            raise edgeinfer.InvalidOptionError(
                f"refusing to listen on {self.host} without --api-key: anyone who can reach it could use it"
            )
        if not 0 <= self.port < 65536:
            raise edgeinfer.InvalidOptionError(f"port must be in [0, 65535], got {self.port}")
        if self.max_body_bytes < 1024:
            raise edgeinfer.InvalidOptionError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise edgeinfer.InvalidOptionError(f"max_tokens_limit must be at least 1, got {self.max_tokens_limit}")
        if self.default_speculation not in ("off", "lookup", "auto"):
            raise edgeinfer.InvalidOptionError(
                f"the server speculates with off, lookup or auto, not {self.default_speculation!r}"
            )
        return self


def check_credentials(config: ServerConfig, authorization: str | None) -> bool:
    """Whether a request's Authorization header passes (always, when no key is configured)."""
    if not config.api_key:
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), config.api_key.encode())
