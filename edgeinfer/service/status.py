"""What the service reports: the models it holds (`ps`), the models a request may name (`catalog`),
and what a `stop` ended."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..store import ModelManifest
from .memory import MemoryParts

__all__ = ["CatalogEntry", "ModelStatus", "StopResult"]


@dataclass(frozen=True)
class ModelStatus:
    """One model the service holds (`ps`)."""

    name: str
    path: str
    state: str  # loading | ready | unloading
    memory: MemoryParts
    parallel: int
    n_ctx: int
    n_ctx_per_request: int
    speculation: str
    requests: int  # leases held: requests running, queued or being prepared
    slots_busy: int
    queue_depth: int
    calibrating: bool
    idle_s: float | None  # seconds since the last request ended (None while busy)
    keep_alive: float  # seconds (-1: for ever)
    expires_in_s: float | None  # None: busy, or for ever
    expires_at: float | None  # epoch seconds
    loaded_at: float | None  # epoch seconds
    load_s: float | None  # how long the load took
    pinned: bool  # given to the service by its caller: never unloaded
    aliases: tuple[str, ...] = ()
    kv_unified: bool = False  # one KV cache for all slots (else a stream per slot)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["memory"] = self.memory.to_dict()
        out["aliases"] = list(self.aliases)
        return out


@dataclass(frozen=True)
class CatalogEntry:
    """A model a request may name (`/v1/models`)."""

    name: str
    manifest: ModelManifest | None
    status: ModelStatus | None  # None: not loaded
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class StopResult:
    name: str
    cancelled: int  # requests that were running or waiting on it
