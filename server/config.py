"""What a server is allowed to do: where it listens, who may call it (API key, Host names, browser
origins), how big a request may be, how long a client may take, how many may wait."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import edgeinfer
from edgeinfer.service import DEFAULT_SLOT_QUOTA

__all__ = ["ServerConfig", "is_loopback", "check_credentials", "host_allowed", "normalize_origin"]


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name or 0.0.0.0-like wildcard: reachable from elsewhere


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def host_name(header: str) -> str:
    """The name of a Host header without its port, lower case, without a trailing dot
    ("[::1]:8080" -> "::1", "LocalHost.:80" -> "localhost")."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    name, sep, port = h.rpartition(":")
    if sep and port.isdigit() and ":" not in name:
        h = name
    return h.rstrip(".")


def normalize_origin(origin: str) -> str:
    return origin.strip().lower().rstrip("/")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None  # Bearer token; required when host is not loopback
    max_body_bytes: int = 1 << 20  # 1 MiB of JSON is far more than any context holds
    max_tokens_limit: int | None = None  # None: the per-request context
    shutdown_grace_s: float = 5.0  # Ctrl-C / SIGTERM: running requests may finish for this long
    keepalive_s: float = 15.0  # SSE comment lines while a stream waits (queued requests)
    # Browsers. Host names accepted besides localhost, *.localhost, IP addresses and `host`
    # ("*": any; ".example.org": that domain and its subdomains): DNS rebinding protection.
    allowed_hosts: tuple[str, ...] = ()
    # Origins (scheme://host[:port], "null", or "*") whose pages may call the API cross-origin;
    # any other cross-origin request is refused (CSRF protection).
    cors_origins: tuple[str, ...] = ()
    # Backpressure and timeouts.
    max_queue: int = 32  # requests waiting for a slot beyond the running ones; then 503
    max_connections: int = 128  # open connections; a request on one more gets 503
    header_timeout_s: float = 10.0  # a request's head must arrive within this of its first byte
    body_timeout_s: float = 30.0  # ... and its body within this of its head
    stall_timeout_s: float = 30.0  # a client that reads none of its response for this long is dropped
    # CPU-heavy steps (server/work.py): from its arrival, a tokenizer call, a chat template, an
    # embeddings call gets this long, then a 503; one embeddings call embeds at most this many tokens.
    work_timeout_s: float = 300.0  # (6 x 1,024 tokens embedded in 130 s on the default model at a load of 20)
    max_embed_tokens: int = 32768
    # Slot files (POST /slots/{id}?action=save|restore, server/slots.py): a folder the operator
    # gives (llama-server's --slot-save-path; None: the actions are off), and the bytes they may take.
    slot_save_path: Path | None = None
    slot_quota: int = DEFAULT_SLOT_QUOTA

    def validate(self) -> ServerConfig:
        if not is_loopback(self.host) and not self.api_key:
            raise edgeinfer.InvalidOptionError(
                f"refusing to listen on {self.host} without an API key (--api-key-file FILE or EDGEINFER_API_KEY): "
                "anyone who can reach it could use it"
            )
        if self.api_key is not None and (not self.api_key or any(c.isspace() for c in self.api_key)):
            raise edgeinfer.InvalidOptionError("an API key must be non-empty and contain no whitespace")
        if not 0 <= self.port < 65536:
            raise edgeinfer.InvalidOptionError(f"port must be in [0, 65535], got {self.port}")
        if self.max_body_bytes < 1024:
            raise edgeinfer.InvalidOptionError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise edgeinfer.InvalidOptionError(f"max_tokens_limit must be at least 1, got {self.max_tokens_limit}")
        if self.max_queue < 0:
            raise edgeinfer.InvalidOptionError(f"max_queue must be at least 0, got {self.max_queue}")
        if self.max_connections < 1:
            raise edgeinfer.InvalidOptionError(f"max_connections must be at least 1, got {self.max_connections}")
        if self.slot_save_path is not None and not Path(self.slot_save_path).is_dir():
            raise edgeinfer.InvalidOptionError(f"the slot folder {self.slot_save_path} is not a directory "
                                               "(--slot-save-path)")
        if isinstance(self.slot_quota, bool) or not isinstance(self.slot_quota, int) or self.slot_quota < 1:
            raise edgeinfer.InvalidOptionError(f"slot_quota must be a positive number of bytes, got {self.slot_quota!r}")
        if isinstance(self.max_embed_tokens, bool) or not isinstance(self.max_embed_tokens, int) \
                or not 1 <= self.max_embed_tokens < 1 << 31:
            raise edgeinfer.InvalidOptionError(f"max_embed_tokens must be a positive integer, got {self.max_embed_tokens!r}")
        for name in ("shutdown_grace_s", "keepalive_s", "header_timeout_s", "body_timeout_s", "stall_timeout_s",
                     "work_timeout_s"):
            v = getattr(self, name)
            zero_ok = name == "shutdown_grace_s"
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or not (v >= 0 if zero_ok else v > 0):
                raise edgeinfer.InvalidOptionError(
                    f"{name} must be a finite number of seconds {'>= 0' if zero_ok else '> 0'}, got {v!r}")
        for h in self.allowed_hosts:
            if not h or h != h.strip() or "/" in h or any(c.isspace() for c in h):
                raise edgeinfer.InvalidOptionError(
                    f"allowed host {h!r} is not a host name (give names like example.org or .example.org, or *)")
        for o in self.cors_origins:
            if o in ("*", "null"):
                continue
            parts = urlsplit(o)
            if parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/") \
                    or parts.query or parts.fragment:
                raise edgeinfer.InvalidOptionError(
                    f"CORS origin {o!r} is not an origin (give scheme://host[:port], e.g. http://localhost:3000, or *)")
        return self

    # -- browsers --------------------------------------------------------------------------------
    def origin_allowed(self, origin: str) -> bool:
        """Whether a cross-origin page at `origin` may call the API."""
        allowed = {normalize_origin(o) for o in self.cors_origins}
        return "*" in allowed or normalize_origin(origin) in allowed


def host_allowed(config: ServerConfig, header: str | None) -> bool:
    """Whether a request's Host header may be answered. A page that rebinds its own DNS name to
    this machine sends that name as Host; an IP address or a localhost name cannot be rebound
    (browsers resolve *.localhost to loopback themselves), so only other names need listing."""
    if header is None:
        return True  # HTTP/1.0 without Host: not a browser
    name = host_name(header)
    if _is_ip(name) or name == "localhost" or name.endswith(".localhost"):
        return True
    if name == host_name(config.host):
        return True
    for allowed in config.allowed_hosts:
        a = allowed.lower().rstrip(".")
        if a == "*" or name == a or (a.startswith(".") and (name.endswith(a) or name == a[1:])):
            return True
    return False


def key_scope(headers: Mapping[str, str]) -> str:
    """The memory scope of a request (SpeculationOptions.memory_scope): a digest of the API key it
    presents (Authorization: Bearer KEY, or an x-api-key / api-key header), "" without one. Requests
    of one key share the suffix drafter's memory of earlier answers; no other key's requests draft
    from it. The key itself is never kept."""
    scheme, _, token = (headers.get("authorization") or "").partition(" ")
    key = token.strip() if scheme.lower() == "bearer" else ""
    key = key or (headers.get("x-api-key") or headers.get("api-key") or "").strip()
    return hashlib.sha256(b"edgeinfer-memory-scope\0" + key.encode()).hexdigest()[:32] if key else ""


def check_credentials(config: ServerConfig, authorization: str | None) -> bool:
    """Whether a request's Authorization header passes (always, when no key is configured)."""
    if not config.api_key:
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), config.api_key.encode())
