"""A model service: every model of the store served by name, each by its own engine core.

`ModelService.acquire(name)` resolves a model as a request names it (a store name `name:tag`, a
name with one tag or a default tag, an alias, the file name of a model the operator configured),
loads it on first use — a `BatchEngine` of its own, with the settings `serve.toml` gives it — and
returns a `Lease` on that engine; `release()` ends the lease and starts the model's keep-alive
countdown (Ollama's `keep_alive`: 0 unloads it at once, a negative value keeps it for ever).

Concurrency. One lock guards the bookkeeping only. Loads run in the requesting thread, outside
the lock, so loads of different models proceed at once and a request for a loaded model never
waits for another model's load; requests for a model being loaded wait for that load only.
Unloads by keep-alive (and keep_alive 0) run on the service's janitor thread, never in the
releasing thread (a server releases from its event loop). `stop(name)` unloads at once and
cancels the model's running requests (each ends with finish_reason "cancelled"). A request that is
cancelled (its client gone: `acquire(cancel=)`) stops waiting at once and evicts nothing, and a
load that no request waits for any more is cancelled (between its stages, and within a self-draft's
quantization).

    service.py   ModelService: names, plans, leases, loads, stop, ps, catalog, close
    names.py     what a request's model name means; each model file's settings
    settings.py  ServiceOptions, per-model settings, serve.toml checked by hand
    units.py     durations (keep_alive) and sizes (--max-memory) as people write them
    memory.py    a model's plan and its memory estimate, by part
    registry.py  the models held, under one lock: room by count and memory, eviction, release, unload
    leases.py    a request's hold on a loaded model
    janitor.py   the thread that unloads models whose keep-alive ran out
    status.py    what the service reports (ps, catalog, stop)
"""

from __future__ import annotations

from .leases import Lease
from .memory import MemoryParts, ModelPlan
from .registry import NoRoomError
from .service import Loader, ModelNotLoadedError, ModelService, ModelTooLargeError
from .settings import (DEFAULT_KEEP_ALIVE, DEFAULT_MAX_LOADED, DEFAULT_ROOM_WAIT, SETTINGS_FILE, ModelSettings,
                       ServiceOptions, read_settings_file)
from .status import CatalogEntry, ModelStatus, StopResult
from .units import parse_duration, parse_size

__all__ = [
    "ModelService",
    "ServiceOptions",
    "ModelSettings",
    "ModelPlan",
    "MemoryParts",
    "ModelStatus",
    "CatalogEntry",
    "Lease",
    "StopResult",
    "NoRoomError",
    "ModelTooLargeError",
    "ModelNotLoadedError",
    "Loader",
    "DEFAULT_KEEP_ALIVE",
    "DEFAULT_MAX_LOADED",
    "DEFAULT_ROOM_WAIT",
    "SETTINGS_FILE",
    "parse_duration",
    "parse_size",
    "read_settings_file",
]
