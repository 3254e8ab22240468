"""A model service: every model of the store served by name, each by its own engine core.

`ModelService.acquire(name)` resolves a model as a request names it (a store name `name:tag`, a
name with one tag or a default tag, an alias, the file name of a model the operator configured),
loads it on first use — a `BatchEngine` of its own, with the settings `serve.toml` gives it — and
returns a `Lease` on that engine; `release()` ends the lease and starts the model's keep-alive
countdown (Ollama's `keep_alive`: 0 unloads it at once, a negative value keeps it for ever).

Memory. Each model's need is `edgeinfer.fit`'s estimate for the settings it is loaded with:
weights + KV cache for its context (all its slots) + compute buffers, + the interleaved copies
llama.cpp's CPU backend makes of Q4_0/Q4_K/IQ4_NL matrices (its CPU_REPACK buffer, beside the
mapped file), + the draft model it speculates with, where one is named. The service holds at most `max_loaded` models and at most
`max_memory` bytes of them (default: what this machine has available when the service starts).
To make room it unloads the least recently used *idle* model (no lease: no request running or
waiting on it) — never one with running requests; a model whose need exceeds the whole budget is
an error before anything is unloaded; when every loaded model is busy, a request waits up to
`room_wait_s` for one to become idle, then gets `NoRoomError`.

Concurrency. One lock guards the bookkeeping only. Loads run in the requesting thread, outside
the lock, so loads of different models proceed at once and a request for a loaded model never
waits for another model's load; requests for a model being loaded wait for that load only.
Unloads by keep-alive (and keep_alive 0) run on the service's janitor thread, never in the
releasing thread (a server releases from its event loop). `stop(name)` unloads at once and
cancels the model's running requests (each ends with finish_reason "cancelled").

Settings. `$EDGEINFER_HOME/serve.toml` (`read_settings_file`):

    [defaults]                              # every model without a table of its own
    parallel = 2
    [models."smollm2-135m-instruct:q8_0"]   # a store name, or a path (the operator's, not a request's)
    parallel = 1                            # slots
    ctx = 2048                              # whole context, split between the slots
    kv_type = "q8_0"                        # also kv_type_k, kv_type_v, flash_attn, kv_unified
    speculate = "lookup"                    # as --speculate
    keep_alive = "10m"                      # seconds or 30s / 5m / 1h; 0; -1 = for ever
    alias = ["fast"]                        # more names a request may use
    # threads, batch, gpu_layers, draft_gpu_layers, rpc, tensor_split: as the serve flags

A table's settings win over [defaults]; the server's flags win over both for the default model.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import re
import threading
import time
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar

from .engine.faces.batch import BatchEngine, BatchOptions
from .engine.faces.speculation_setup import ProgressCallback
from .engine.core.options import DEFAULT_LOAD, DEFAULT_SPECULATION, LoadOptions, SpeculationOptions
from .errors import EdgeInferError, InvalidOptionError, ModelNotFoundError
from .fit import available_memory, estimate_memory
from .gguf_file import GGUFInfo
from .store import ModelManifest, Store
from .validate import admit, validate_file

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

log = logging.getLogger(__name__)

DEFAULT_KEEP_ALIVE = 300.0  # seconds an idle model stays loaded (Ollama's 5 minutes)
DEFAULT_MAX_LOADED = 3  # models loaded at once (Ollama's default on a CPU)
DEFAULT_ROOM_WAIT = 60.0  # seconds a request waits for a busy model to become idle and make room
SETTINGS_FILE = "serve.toml"  # per-model settings, in the store's root
_CTX_BLOCK = 256  # llama.cpp gives each slot a multiple of this many positions (measured on 0.3.36)


class NoRoomError(EdgeInferError, RuntimeError):
    """No room for a model now: every loaded model that would have to go is busy."""


class ModelTooLargeError(EdgeInferError, MemoryError):
    """A model whose estimated memory exceeds the service's whole budget: it can never be loaded."""


class ModelNotLoadedError(ModelNotFoundError):
    """`stop` of a model that is not loaded."""


# -- durations, sizes --------------------------------------------------------------------------------

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h)")


def parse_duration(value: object, what: str = "keep_alive") -> float:
    """Seconds from a number or a duration text (Ollama's forms: "300", "30s", "5m", "1h30m",
    "0", "-1"); any negative value means for ever and is returned as -1."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise InvalidOptionError(f"{what} must be a number of seconds or a duration like 5m, got {value!r}")
    if isinstance(value, str):
        text = value.strip().lower()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = float(body)
        except ValueError:
            parts = _DURATION_PART.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise InvalidOptionError(f"{what} must be a number of seconds or a duration like 30s, 5m, 1h "
                                         f"(negative: for ever), got {value!r}") from None
            scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
            seconds = sum(float(n) * scale[u] for n, u in parts)
        seconds *= sign
    else:
        seconds = float(value)
    if math.isnan(seconds) or (math.isinf(seconds) and seconds > 0):
        raise InvalidOptionError(f"{what} must be a finite duration, got {value!r}")
    return -1.0 if seconds < 0 else seconds


_SIZE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)b?$")


def parse_size(value: str | int, what: str = "memory") -> int:
    """Bytes from 8000000000, "8G", "8GB" (powers of 1000) or "7.5GiB" (powers of 1024)."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = float(value)
    elif isinstance(value, str) and (m := _SIZE.match(value.strip().lower())):
        n = float(m.group(1)) * (1024 if m.group(3) else 1000) ** "_kmgt".index(m.group(2) or "_")
    else:
        raise InvalidOptionError(f"{what} must be a size like 8G, 7.5GiB or a number of bytes, got {value!r}")
    if not n >= 1:
        raise InvalidOptionError(f"{what} must be more than 0 bytes, got {value!r}")
    return int(n)


# -- per-model settings ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSettings:
    """How one model is served; None leaves a setting to the layer below (a [models] table over
    [defaults] over the library's defaults). Names are the serve flags'."""

    parallel: int | None = None  # slots (BatchOptions.parallel)
    ctx: int | None = None  # whole context, split between the slots (LoadOptions.n_ctx)
    batch: int | None = None  # LoadOptions.n_batch
    threads: int | None = None
    kv_type: str | None = None
    kv_type_k: str | None = None
    kv_type_v: str | None = None
    flash_attn: bool | None = None
    kv_unified: bool | None = None  # one KV cache for all slots (BatchOptions.kv_unified)
    gpu_layers: int | str | None = None
    draft_gpu_layers: int | str | None = None
    rpc: tuple[str, ...] | None = None
    tensor_split: tuple[float, ...] | None = None
    speculate: str | None = None  # off | lookup | auto | auto=MODEL | draft=MODEL | self=QUANT
    keep_alive: float | None = None  # seconds; 0: unload after each request; -1: for ever
    alias: tuple[str, ...] = ()

    _LOAD: ClassVar[dict[str, str]] = {"ctx": "n_ctx", "batch": "n_batch", "threads": "n_threads", "kv_type": "kv_type",
             "kv_type_k": "kv_type_k", "kv_type_v": "kv_type_v", "flash_attn": "flash_attn",
             "gpu_layers": "n_gpu_layers", "draft_gpu_layers": "draft_gpu_layers", "rpc": "rpc",
             "tensor_split": "tensor_split"}

    @classmethod
    def from_table(cls, table: Mapping[str, Any], where: str) -> ModelSettings:
        """Settings from a TOML table, strictly: an unknown key or a wrong type is one line naming
        `where` and the key."""
        if not isinstance(table, Mapping):
            raise InvalidOptionError(f"{where} must be a table")
        known = [f.name for f in fields(cls)]
        values: dict[str, Any] = {}
        for key, v in table.items():
            if key not in known:
                raise InvalidOptionError(f"{where}: unknown setting {key!r} (known: {', '.join(known)})")
            bad = InvalidOptionError(f"{where}: {key} = {v!r} is not valid")
            if key in ("parallel", "ctx", "batch", "threads"):
                if isinstance(v, bool) or not isinstance(v, int):
                    raise InvalidOptionError(f"{where}: {key} must be an integer, got {v!r}")
            elif key in ("kv_type", "kv_type_k", "kv_type_v", "speculate"):
                if not isinstance(v, str):
                    raise InvalidOptionError(f"{where}: {key} must be a string, got {v!r}")
                v = v.lower() if key != "speculate" else v
            elif key in ("flash_attn", "kv_unified"):
                if not isinstance(v, bool):
                    raise InvalidOptionError(f"{where}: {key} must be true or false, got {v!r}")
            elif key in ("gpu_layers", "draft_gpu_layers"):
                if not (isinstance(v, int) and not isinstance(v, bool)) and v not in ("all", "auto"):
                    raise InvalidOptionError(f"{where}: {key} must be a number of layers, 'all' or 'auto', got {v!r}")
            elif key == "rpc":
                v = (v,) if isinstance(v, str) else v
                if not isinstance(v, list | tuple) or not all(isinstance(x, str) for x in v):
                    raise bad
                v = tuple(v)
            elif key == "tensor_split":
                if not isinstance(v, list) or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in v):
                    raise InvalidOptionError(f"{where}: tensor_split must be a list of numbers, got {v!r}")
                v = tuple(float(x) for x in v)
            elif key == "keep_alive":
                v = parse_duration(v, f"{where}: keep_alive")
            elif key == "alias":
                v = (v,) if isinstance(v, str) else v
                if not isinstance(v, list | tuple) or not all(isinstance(x, str) and x.strip() for x in v):
                    raise InvalidOptionError(f"{where}: alias must be a name or a list of names, got {v!r}")
                v = tuple(x.strip() for x in v)
            values[key] = v
        settings = cls(**values)
        try:
            settings.validate()
        except InvalidOptionError as e:
            raise InvalidOptionError(f"{where}: {e}") from None
        return settings

    def over(self, base: ModelSettings) -> ModelSettings:
        """These settings where they are set, `base`'s elsewhere (aliases: both)."""
        merged = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        merged["alias"] = tuple(dict.fromkeys(base.alias + self.alias))
        return replace(base, **merged)

    def load_options(self, base: LoadOptions = DEFAULT_LOAD) -> LoadOptions:
        given = {self._LOAD[k]: getattr(self, k) for k in self._LOAD if getattr(self, k) is not None}
        return replace(base, **given).validate()

    def batch_options(self) -> BatchOptions:
        given = {k: getattr(self, k) for k in ("parallel", "kv_unified") if getattr(self, k) is not None}
        return BatchOptions(**given).validate()

    def speculation(self) -> SpeculationOptions:
        return SpeculationOptions.parse(self.speculate) if self.speculate is not None else DEFAULT_SPECULATION

    def validate(self) -> ModelSettings:
        self.load_options()
        self.batch_options()
        self.speculation()
        if self.keep_alive is not None:
            parse_duration(self.keep_alive)
        return self


def read_settings_file(path: Path) -> tuple[ModelSettings, dict[str, ModelSettings]]:
    """`serve.toml`: the [defaults] table and the [models."REF"] tables (absent file: none)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return ModelSettings(), {}
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidOptionError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise InvalidOptionError(f"{path} is not valid TOML: {e}") from None
    unknown = sorted(set(data) - {"defaults", "models"})
    if unknown:
        raise InvalidOptionError(f"{path}: unknown table or key {unknown[0]!r} (known: [defaults], [models.\"NAME:TAG\"])")
    defaults = ModelSettings.from_table(data.get("defaults", {}), f"{path}: [defaults]")
    models = data.get("models", {})
    if not isinstance(models, Mapping):
        raise InvalidOptionError(f"{path}: models must be tables like [models.\"NAME:TAG\"]")
    return defaults, {ref: ModelSettings.from_table(t, f"{path}: [models.{ref!r}]") for ref, t in models.items()}


# -- what a model needs ------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryParts:
    """Estimated bytes of one loaded model, by part: edgeinfer.fit's estimate (weights, KV cache,
    compute buffers), the copies llama.cpp's CPU backend makes of some weights, a draft model."""

    weights: int
    kv_cache: int
    compute: int
    repack: int = 0  # interleaved copies of Q4_0/Q4_K/IQ4_NL matrices (llama.cpp's CPU_REPACK buffer)
    draft: int = 0  # the draft model a `draft=`/`auto=` speculation opens (all its parts)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.compute + self.repack + self.draft

    def to_dict(self) -> dict[str, int]:
        return {"weights": self.weights, "kv_cache": self.kv_cache, "compute": self.compute, "repack": self.repack,
                "draft": self.draft, "total": self.total}


# The weight types llama.cpp's CPU backend copies into interleaved blocks at load (its CPU_REPACK
# buffer), for the matrices of the layers, where the CPU has the kernels (feature REPACK): the
# mapped file stays resident beside the copy. Measured on 0.3.36 (AVX2/AVX512): the CPU_REPACK
# buffer is exactly the bytes of these tensors (Q8_0, Q3_K, Q5_K, Q6_K, NVFP4 and the rest: not
# copied; an MXFP4 copy of the default model: 53 MiB CPU_REPACK, its MXFP4 bytes).
_REPACKED_TYPES = frozenset({"Q4_0", "Q4_K", "IQ4_NL", "MXFP4"})


@functools.cache
def _cpu_repacks() -> bool:
    try:
        from .devices import build_info

        return build_info().cpu_features.get("REPACK") == "1"
    except Exception as e:  # noqa: BLE001 - an estimate must not fail a load
        log.debug("CPU features unknown (%s): repacked weights not counted", e)
        return False


def _repack_bytes(info: GGUFInfo) -> int:
    if not _cpu_repacks():
        return 0
    return sum(t.n_bytes for t in info.tensors
               if t.name.startswith("blk.") and len(t.shape) == 2 and t.type_name in _REPACKED_TYPES)


def _memory(info: GGUFInfo, load: LoadOptions, n_ctx: int, draft: int = 0) -> MemoryParts:
    """What a model needs loaded with `load` and an n_ctx context (the host's part: a placement
    over GPUs or RPC workers is not split here)."""
    type_k, type_v = load.kv_types
    est = estimate_memory(info, n_ctx, type_k, load.n_batch, load.flash_attn, kv_type_k=type_k, kv_type_v=type_v)
    return MemoryParts(est.weights, est.kv_cache, est.compute, _repack_bytes(info), draft)


@dataclass(frozen=True)
class ModelPlan:
    """A model resolved and sized, before (or after) it loads."""

    key: str  # the resolved file path: one engine per file
    name: str  # as responses name it: the store ref, else the file name
    path: Path
    manifest: ModelManifest | None
    info: GGUFInfo
    load: LoadOptions
    batch: BatchOptions
    speculation: SpeculationOptions
    keep_alive: float | None  # the model's own (serve.toml), None: the service's
    aliases: tuple[str, ...]
    n_ctx: int  # the whole context it gets (after llama.cpp's rounding)
    memory: MemoryParts

    @property
    def parallel(self) -> int:
        return self.batch.parallel

    @property
    def n_ctx_per_request(self) -> int:
        return self.n_ctx // self.batch.parallel


def _expected_ctx(info: GGUFInfo, load: LoadOptions, parallel: int) -> int:
    """The context llama.cpp will give: each slot's share rounded up to a multiple of 256."""
    n_ctx = load.n_ctx or min(info.context_length or 4096, 4096)
    per_slot = -(-n_ctx // parallel)
    return -(-per_slot // _CTX_BLOCK) * _CTX_BLOCK * parallel


# -- what the service reports ------------------------------------------------------------------------


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


Loader = Callable[[ModelPlan, "ProgressCallback | None"], BatchEngine]


@dataclass(frozen=True)
class ServiceOptions:
    """How many models, how much memory, how long they stay; the per-model settings."""

    keep_alive: float = DEFAULT_KEEP_ALIVE  # seconds; 0: unload after each request; -1: for ever
    max_loaded: int = DEFAULT_MAX_LOADED
    max_memory: int | None = None  # bytes; None: what the machine has available when the service starts
    room_wait_s: float = DEFAULT_ROOM_WAIT
    default_model: str | Path | None = None  # what a request without `model` gets (None: the store's default)
    defaults: ModelSettings = ModelSettings()  # serve.toml's [defaults]
    models: Mapping[str, ModelSettings] = field(default_factory=dict)  # serve.toml's [models."REF"] tables
    default_settings: ModelSettings = ModelSettings()  # the default model's flags (over its table)

    def validate(self) -> ServiceOptions:
        parse_duration(self.keep_alive, "keep_alive")
        if isinstance(self.max_loaded, bool) or not isinstance(self.max_loaded, int) or not 1 <= self.max_loaded <= 64:
            raise InvalidOptionError(f"max_loaded must be an integer in [1, 64], got {self.max_loaded!r}")
        if self.max_memory is not None and (isinstance(self.max_memory, bool) or not isinstance(self.max_memory, int)
                                            or self.max_memory < 1):
            raise InvalidOptionError(f"max_memory must be a positive number of bytes, got {self.max_memory!r}")
        if not (isinstance(self.room_wait_s, int | float) and math.isfinite(self.room_wait_s) and self.room_wait_s >= 0):
            raise InvalidOptionError(f"room_wait_s must be a finite number of seconds >= 0, got {self.room_wait_s!r}")
        for s in (self.defaults, self.default_settings, *self.models.values()):
            s.validate()
        return self


# -- the service ---------------------------------------------------------------------------------


class _Entry:
    """One model the service holds, in one of three states (guarded by the service's lock)."""

    def __init__(self, plan: ModelPlan, keep_alive: float, *, pinned: bool = False):
        self.plan = plan
        self.state = "loading"  # -> ready -> unloading (then removed)
        self.engine: BatchEngine | None = None
        self.done = threading.Event()  # the load ended (self.error says how)
        self.error: BaseException | None = None
        self.leases = 0
        self.keep_alive = keep_alive
        self.last_used = time.monotonic()
        self.expires: float | None = None  # monotonic; None: busy or for ever
        self.loaded_at: float | None = None
        self.load_s: float | None = None
        self.pinned = pinned  # the caller's engine: never unloaded by the service

    @property
    def idle(self) -> bool:
        return self.state == "ready" and self.leases == 0 and not self.pinned


class Lease:
    """A request's hold on a loaded model: the model is not unloaded by eviction or keep-alive
    while any lease is held. `release()` (idempotent; also on `with` exit) ends it; its
    `keep_alive` (None: the model's) then sets how long the idle model stays."""

    def __init__(self, service: ModelService, entry: _Entry, keep_alive: float | None):
        self._service = service
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
        self._service._release(self._entry, self.keep_alive)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:  # a lease dropped without release must not pin its model for ever
        try:
            self.release()
        except Exception:  # pragma: no cover
            pass


def _load_engine(store: Store) -> Loader:
    def load(plan: ModelPlan, progress: ProgressCallback | None) -> BatchEngine:
        info = admit(plan.path, store, plan.manifest)  # validated, and loaded once in a child process
        return BatchEngine(plan.path, info, plan.load, plan.batch, manifest=plan.manifest, store=store,
                           speculation=plan.speculation, progress=progress)

    return load


def _looks_like_path(name: str) -> bool:
    return "/" in name or "\\" in name or name.startswith((".", "~"))


class ModelService:
    """Models loaded on demand by name, kept warm, evicted by memory (see the module docstring).

    Thread safety: every public method may be called from any thread."""

    def __init__(self, options: ServiceOptions | None = None, *, store: Store | None = None,
                 loader: Loader | None = None, progress: ProgressCallback | None = None):
        self.options = (options or ServiceOptions()).validate()
        self.store = store or Store()
        self.budget = self.options.max_memory or available_memory()
        self._loader = loader or _load_engine(self.store)
        self._progress = progress
        self._cond = threading.Condition()
        self._entries: dict[str, _Entry] = {}
        self._plans: dict[str, tuple[tuple[Any, ...], ModelPlan]] = {}
        self._closed = False
        self.loads = 0
        self.evictions = 0
        self.expirations = 0
        # Settings by file: [models] tables and the default model resolved once (a table naming a
        # model that is not there is a warning: it may be pulled later, and then it applies).
        self._tables: dict[str, ModelSettings] = {}
        self._names: dict[str, str | Path] = {}  # aliases and configured file names -> the operator's reference
        for ref, settings in self.options.models.items():
            target: str | Path = Path(ref).expanduser() if _looks_like_path(ref) else ref
            try:
                key = self._key_of(*self._resolve_ref(target))
            except ModelNotFoundError:
                log.warning("serve settings for %s: no such model (the table is ignored)", ref)
                continue
            self._tables[key] = settings
            for alias in settings.alias:
                self._names[alias] = target
        self._default_key: str | None = None
        try:
            self._default_key = self._key_of(*self._resolve_ref(self.options.default_model))
        except ModelNotFoundError:
            if self.options.default_model is not None:
                raise
        self._janitor = threading.Thread(target=self._janitor_loop, name="edgeinfer-service-janitor", daemon=True)
        self._janitor.start()

    @classmethod
    def adopt(cls, engine: BatchEngine, options: ServiceOptions | None = None) -> ModelService:
        """A service over an engine its caller loaded and keeps (and closes): it is the default
        model, never unloaded; other models load on demand beside it."""
        base = options or ServiceOptions()
        default = engine.manifest.ref if engine.manifest is not None else engine.path
        service = cls(replace(base, default_model=default), store=engine.store)
        plan = service._plan_for(engine.path, engine.manifest, settings=ModelSettings(), engine=engine)
        entry = _Entry(plan, -1.0, pinned=True)
        entry.engine, entry.state, entry.loaded_at, entry.load_s = engine, "ready", time.time(), 0.0
        entry.done.set()
        with service._cond:
            service._entries[plan.key] = entry
        return service

    # -- names -----------------------------------------------------------------------------------
    def _resolve_ref(self, ref: str | Path | None) -> tuple[Path, ModelManifest | None]:
        """A reference the operator or the library's caller gives (a path may be one: a store
        model's file is that model, by its store name)."""
        path, manifest = self.store.resolve(ref)
        path = Path(path)
        if manifest is None:  # a file the operator named: its file name (and stem) names it too
            self._names.setdefault(path.name, path)
            self._names.setdefault(path.stem, path)
            real = path.resolve()
            manifest = next((m for m in self.store.list() if m.path.resolve() == real), None)
        return path, manifest

    @staticmethod
    def _key_of(path: Path, manifest: ModelManifest | None) -> str:
        return str(Path(path).resolve())

    def resolve(self, model: str | Path | None) -> tuple[Path, ModelManifest | None]:
        """A model as a request names it. A str is a name — a store name (`name:tag`, a name with
        one or a default tag), an alias, or the file name of a model the operator configured or
        the store holds — never a path (the server's disk is not a client's to choose); a Path is
        a file (the caller's choice); None or "" is the default model."""
        if isinstance(model, Path):
            return self._resolve_ref(model.expanduser())
        if model is None or model == "":
            return self._resolve_ref(self.options.default_model)
        if not isinstance(model, str):
            raise InvalidOptionError(f"a model name must be a string, got {type(model).__name__}")
        configured = self._names.get(model)
        if configured is not None:
            return self._resolve_ref(configured)
        if _looks_like_path(model):
            raise ModelNotFoundError(f"model {model[:200]!r} looks like a path: name a model of the store "
                                     "(`edgeinfer list`) or an alias the server configures")
        if model.endswith(".gguf"):
            for m in self.store.list():
                if Path(m.file).name == model and m.path.exists():
                    return m.path, m
            raise ModelNotFoundError(f"no model file named {model[:200]!r} in the store (see `edgeinfer list`)")
        return self._resolve_ref(model)

    def _settings(self, key: str) -> ModelSettings:
        settings = self._tables.get(key, ModelSettings()).over(self.options.defaults)
        if key == self._default_key:
            settings = self.options.default_settings.over(settings)
        return settings

    def plan(self, model: str | Path | None) -> ModelPlan:
        """The model a request names, sized with its settings (reads only its header)."""
        path, manifest = self.resolve(model)
        return self._plan_for(path, manifest)

    def _plan_for(self, path: Path, manifest: ModelManifest | None, *, settings: ModelSettings | None = None,
                  engine: BatchEngine | None = None) -> ModelPlan:
        key = self._key_of(path, manifest)
        with self._cond:
            entry = self._entries.get(key)
            if entry is not None and engine is None:
                return entry.plan  # what is loaded (or loading) is what a request gets
        st = path.stat()
        identity = (st.st_size, st.st_mtime_ns, st.st_ino, manifest.ref if manifest else None)
        cached = self._plans.get(key)
        if cached is not None and cached[0] == identity and engine is None:
            return cached[1]
        settings = settings if settings is not None else self._settings(key)
        if engine is not None:
            load, batch, spec, info = engine.options, engine.batch_options, engine.speculation, engine.info
            n_ctx = engine.n_ctx
        else:
            load, batch, spec = settings.load_options(), settings.batch_options(), settings.speculation()
            info = validate_file(path, self.store)
            n_ctx = _expected_ctx(info, load, batch.parallel)
        memory = _memory(info, load, n_ctx, self._draft_bytes(spec, load, n_ctx))
        plan = ModelPlan(key, manifest.ref if manifest else path.name, path, manifest, info, load, batch, spec,
                         settings.keep_alive, settings.alias, n_ctx, memory)
        if engine is None:
            self._plans[key] = (identity, plan)
        return plan

    def _draft_bytes(self, spec: SpeculationOptions, load: LoadOptions, n_ctx: int) -> int:
        """The draft model's estimate, where the speculation names one (a self-draft's file may not
        exist yet: not counted)."""
        if not spec.draft_model or spec.method not in ("draft", "auto"):
            return 0
        try:
            path, _ = self.store.resolve(spec.draft_model)
            info = validate_file(path, self.store)
        except (EdgeInferError, OSError) as e:
            log.debug("draft model %s not sized: %s", spec.draft_model, e)
            return 0
        return _memory(info, load.draft_options(n_ctx), n_ctx).total

    # -- leases ----------------------------------------------------------------------------------
    def acquire(self, model: str | Path | None = None, *, keep_alive: float | None = None,
                cancel: threading.Event | None = None, evict: bool = True) -> Lease:
        """A lease on the model `model` names, loaded now if it is not (see `resolve` for names).

        `keep_alive` (seconds; 0, or negative for ever): how long the model stays once idle after
        this lease, None for its own (serve.toml) or the service's. ModelTooLargeError when it can
        never fit; NoRoomError when every model that would have to go stays busy for room_wait_s
        (or at once with evict=False, which never unloads another model); the load's own error."""
        if keep_alive is not None:
            keep_alive = parse_duration(keep_alive)
        plan = self.plan(model)
        if plan.memory.total > self.budget:
            raise ModelTooLargeError(
                f"{plan.name} needs about {_gb(plan.memory.total)} (weights {_gb(plan.memory.weights)}, KV cache "
                f"{_gb(plan.memory.kv_cache)}, compute {_gb(plan.memory.compute)}"
                f"{', repacked weights ' + _gb(plan.memory.repack) if plan.memory.repack else ''}"
                f"{', draft ' + _gb(plan.memory.draft) if plan.memory.draft else ''}) but the memory budget is "
                f"{_gb(self.budget)} (--max-memory): lower its ctx or parallel, or pick a smaller quant")
        deadline = time.monotonic() + (self.options.room_wait_s if evict else 0.0)
        while True:
            victims: list[_Entry] = []
            wait_load: _Entry | None = None
            with self._cond:
                self._check_open()
                entry = self._entries.get(plan.key)
                dead = None
                if entry is not None and entry.state == "ready" and entry.leases == 0 and \
                        getattr(entry.engine, "failure", None) is not None:
                    log.warning("the engine of %s stopped (%s): loading it again", plan.name, entry.engine.failure)
                    entry.state, dead = "unloading", entry
                elif entry is not None and entry.state == "ready":
                    entry.leases += 1
                    entry.expires = None
                    entry.last_used = time.monotonic()
                    return Lease(self, entry, keep_alive)
                if dead is not None:
                    pass  # closed below, outside the lock; then loaded again
                elif entry is not None and entry.state == "loading":
                    wait_load = entry
                elif entry is not None:  # unloading: wait until it is gone, then load it again
                    self._wait(deadline, cancel, plan)
                    continue
                else:
                    victims_or_none = self._make_room(plan, evict)
                    if victims_or_none is None:
                        self._wait(deadline, cancel, plan)
                        continue
                    victims = victims_or_none
                    entry = _Entry(plan, self._keep_alive_of(plan))
                    entry.leases = 1  # the loader's own lease: nothing unloads it before its request runs
                    self._entries[plan.key] = entry
            if dead is not None:
                self._close_entry(dead, 0.0)
                continue
            if wait_load is not None:
                wait_load.done.wait()
                if wait_load.error is not None:
                    raise _copy_error(wait_load.error)
                continue
            return self._load(entry, victims, keep_alive)

    def _load(self, entry: _Entry, victims: list[_Entry], keep_alive: float | None) -> Lease:
        plan = entry.plan
        for v in victims:
            log.info("unloading %s to make room for %s (idle %.1f s)", v.plan.name, plan.name,
                     time.monotonic() - v.last_used)
            self._close_entry(v, 0.0)
        started = time.perf_counter()
        try:
            engine = self._loader(plan, self._progress)
        except BaseException as e:
            with self._cond:
                entry.error = e
                if self._entries.get(plan.key) is entry:
                    del self._entries[plan.key]
                entry.done.set()
                self._cond.notify_all()
            log.info("loading %s failed: %s", plan.name, e)
            raise
        load_s = time.perf_counter() - started
        exact = self._plan_for(plan.path, plan.manifest, settings=self._settings(plan.key), engine=engine)
        exact = replace(exact, keep_alive=plan.keep_alive, aliases=plan.aliases)
        with self._cond:
            closed = self._closed
            entry.plan, entry.engine, entry.state = exact, engine, "unloading" if closed else "ready"
            entry.loaded_at, entry.load_s = time.time(), load_s
            entry.last_used = time.monotonic()
            self.loads += 1
            entry.done.set()
            self._cond.notify_all()
        log.info("loaded %s in %.2f s (%d slots of %d tokens, ~%s)", plan.name, load_s, exact.parallel,
                 exact.n_ctx_per_request, _gb(exact.memory.total))
        if closed:  # the service closed while this loaded: nobody will unload it
            self._close_entry(entry, 0.0)
            raise _closed_error()
        return Lease(self, entry, keep_alive)

    def _keep_alive_of(self, plan: ModelPlan) -> float:
        return plan.keep_alive if plan.keep_alive is not None else self.options.keep_alive

    def _make_room(self, plan: ModelPlan, evict: bool) -> list[_Entry] | None:
        """(holds the lock) The idle models to unload, least recently used first, so that `plan`
        fits in the count and the budget; [] when it fits as it is; None when it cannot fit now
        (models that are busy, loading or unloading hold the room: nothing is chosen)."""
        held = list(self._entries.values())

        def fits(gone: list[_Entry]) -> bool:
            rest = [e for e in held if e not in gone]
            return len(rest) < self.options.max_loaded and \
                sum(e.plan.memory.total for e in rest) + plan.memory.total <= self.budget

        victims: list[_Entry] = []
        idle = sorted((e for e in held if e.idle), key=lambda e: e.last_used)
        while not fits(victims):
            if not idle or not evict:
                return None
            victims.append(idle.pop(0))
        for v in victims:
            v.state = "unloading"
        self.evictions += len(victims)
        return victims

    def _wait(self, deadline: float, cancel: threading.Event | None, plan: ModelPlan) -> None:
        """(holds the lock) Wait for a change (a release, an unload), up to the deadline."""
        left = deadline - time.monotonic()
        if left <= 0 or (cancel is not None and cancel.is_set()):
            busy = [e.plan.name for e in self._entries.values() if not e.idle]
            raise NoRoomError(
                f"no room for {plan.name} (~{_gb(plan.memory.total)}): {', '.join(busy) or 'the loaded models'} "
                f"{'is' if len(busy) == 1 else 'are'} busy or pinned ({len(self._entries)} of --max-loaded "
                f"{self.options.max_loaded}, {_gb(self._reserved())} of {_gb(self.budget)} held); retry later")
        self._cond.wait(timeout=min(left, 0.5))

    def _reserved(self) -> int:
        return sum(e.plan.memory.total for e in self._entries.values())

    def _release(self, entry: _Entry, keep_alive: float | None) -> None:
        with self._cond:
            entry.leases -= 1
            entry.last_used = time.monotonic()
            if keep_alive is not None:
                entry.keep_alive = keep_alive  # the last request's keep_alive wins (as Ollama's)
            if entry.leases == 0 and entry.state == "ready" and not entry.pinned:
                if entry.keep_alive == 0:
                    entry.state = "unloading"
                    entry.expires = entry.last_used
                elif entry.keep_alive > 0:
                    entry.expires = entry.last_used + entry.keep_alive
            self._cond.notify_all()  # room waiters, and the janitor (a new deadline)

    def preload(self, model: str | Path | None) -> ModelStatus:
        """Load `model` now, without unloading any other (NoRoomError instead); its keep-alive
        countdown starts at once."""
        with self.acquire(model, evict=False) as lease:
            return next(s for s in self.ps() if s.path == lease.plan.key)

    # -- unloading -------------------------------------------------------------------------------
    def stop(self, model: str | Path, *, grace: float = 0.0) -> StopResult:
        """Unload `model` now; its running and queued requests are cancelled after `grace`
        seconds (each ends with finish_reason "cancelled"). ModelNotLoadedError if it is not loaded."""
        key = self._loaded_key(model)
        while True:
            with self._cond:
                entry = self._entries.get(key) if key is not None else None
                if entry is None:
                    raise ModelNotLoadedError(f"model {str(model)[:200]!r} is not loaded")
                if entry.pinned:
                    raise InvalidOptionError(f"{entry.plan.name} was given to this server by its caller and stays")
                if entry.state == "loading":
                    pass
                elif entry.state == "unloading":
                    self._cond.wait(timeout=0.5)
                    continue
                else:
                    entry.state = "unloading"
                    busy = entry.leases
                    break
            entry.done.wait()
        log.info("stopping %s (%d request(s) running or waiting)", entry.plan.name, busy)
        self._close_entry(entry, grace)
        return StopResult(entry.plan.name, busy)

    def _loaded_key(self, model: str | Path) -> str | None:
        """The key of a held model by any name a request may use, by its file name or alias as
        loaded (also after its store entry is gone)."""
        with self._cond:
            for key, e in self._entries.items():
                if isinstance(model, str) and model in (e.plan.name, e.plan.path.name, *e.plan.aliases):
                    return key
        try:
            path, manifest = self.resolve(model)
        except ModelNotFoundError:
            return None
        return self._key_of(path, manifest)

    def _close_entry(self, entry: _Entry, grace: float) -> None:
        """Close an entry marked unloading (outside the lock), then forget it."""
        try:
            if entry.engine is not None and not entry.pinned:
                entry.engine.close(grace)
        except Exception:  # an engine that fails to close must not keep its room for ever
            log.exception("closing %s failed", entry.plan.name)
        finally:
            with self._cond:
                if self._entries.get(entry.plan.key) is entry:
                    del self._entries[entry.plan.key]
                self._cond.notify_all()
        log.info("unloaded %s", entry.plan.name)

    def _janitor_loop(self) -> None:
        """Unload models whose keep-alive ran out (and those released with keep_alive 0)."""
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    now = time.monotonic()
                    due = [e for e in self._entries.values()
                           if e.leases == 0 and not e.pinned and e.expires is not None and e.expires <= now
                           and e.state in ("ready", "unloading") and e.engine is not None]
                    if due:
                        break
                    next_at = [e.expires for e in self._entries.values() if e.expires is not None and e.leases == 0]
                    self._cond.wait(timeout=max(0.01, min(next_at) - now) if next_at else None)
                for e in due:
                    if e.state == "ready":
                        self.expirations += 1
                    e.state = "unloading"
                    e.expires = None
            for e in due:
                log.info("unloading %s (keep_alive %s ran out)", e.plan.name, _duration_text(e.keep_alive))
                self._close_entry(e, 0.0)

    # -- what is held ----------------------------------------------------------------------------
    def ps(self) -> list[ModelStatus]:
        """Every model held (loading, ready, unloading), most recently used first."""
        with self._cond:
            entries = sorted(self._entries.values(), key=lambda e: -e.last_used)
            snapshot = [(e, e.state, e.leases, e.last_used, e.expires, e.keep_alive) for e in entries]
        now, wall = time.monotonic(), time.time()
        out = []
        for e, state, leases, last_used, expires, keep in snapshot:
            engine, plan = e.engine, e.plan
            busy = queued = 0
            calibrating = False
            if engine is not None and state == "ready":
                m = engine.metrics()
                busy, queued, calibrating = m.active, m.queue_depth, m.calibrating
            expires_in = None if expires is None or leases else max(0.0, expires - now)
            out.append(ModelStatus(
                name=plan.name, path=plan.key, state=state, memory=plan.memory, parallel=plan.parallel,
                n_ctx=plan.n_ctx, n_ctx_per_request=plan.n_ctx_per_request, speculation=plan.speculation.method,
                requests=leases, slots_busy=busy, queue_depth=queued, calibrating=calibrating,
                idle_s=None if leases else max(0.0, now - last_used), keep_alive=-1.0 if e.pinned else keep,
                expires_in_s=expires_in, expires_at=None if expires_in is None else wall + expires_in,
                loaded_at=e.loaded_at, load_s=e.load_s, pinned=e.pinned, aliases=plan.aliases,
                kv_unified=plan.batch.kv_unified))
        return out

    def catalog(self) -> list[CatalogEntry]:
        """Every model a request may name: the store's, and the files the operator configured,
        with the status of those held; the default model first, then the loaded ones."""
        held = {s.path: s for s in self.ps()}
        out: list[CatalogEntry] = []
        seen: set[str] = set()
        aliases: dict[str, list[str]] = {}
        for name, target in self._names.items():
            if isinstance(target, str) or name not in (target.name, target.stem):
                aliases.setdefault(str(target), []).append(name)
        for m in self.store.list():
            key = str(m.path.resolve())
            seen.add(key)
            out.append(CatalogEntry(m.ref, m, held.get(key), self._tables.get(key, ModelSettings()).alias))
        for target in dict.fromkeys(t for t in self._names.values() if isinstance(t, Path)):
            key = str(target.resolve())
            if key not in seen and target.exists():
                seen.add(key)
                out.append(CatalogEntry(target.name, None, held.get(key), self._tables.get(key, ModelSettings()).alias))
        for key, s in held.items():
            if key not in seen:
                out.append(CatalogEntry(s.name, None, s, s.aliases))
        default = self.default_name
        # the default model first, then the loaded ones (most recently used first), then the rest
        order = {s.name: i for i, s in enumerate(held.values())}
        return sorted(out, key=lambda e: (e.name != default, e.status is None, order.get(e.name, 0)))

    @property
    def default_name(self) -> str | None:
        """The name of the model a request without `model` gets (None: no default model)."""
        if self._default_key is None:
            return None
        try:
            return self.plan(None).name
        except EdgeInferError:
            return None

    @property
    def reserved(self) -> int:
        """Estimated bytes of the models held (loading and unloading ones too)."""
        with self._cond:
            return self._reserved()

    def engines(self) -> list[BatchEngine]:
        """The engines loaded now."""
        with self._cond:
            return [e.engine for e in self._entries.values() if e.engine is not None and e.state == "ready"]

    # -- lifecycle -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise _closed_error()

    @property
    def closed(self) -> bool:
        return self._closed

    def cancel_all(self) -> None:
        """Cancel every running and queued request of every loaded model."""
        for engine in self.engines():
            engine.cancel_all()

    def close(self, grace: float = 0.0) -> None:
        """Refuse new leases, let running requests finish for `grace` seconds, then unload every
        model the service loaded (an adopted engine stays its caller's; a load under way is
        unloaded by its loader when it ends)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            entries = [e for e in self._entries.values() if e.state == "ready"]
            for e in entries:
                e.state = "unloading"
            self._cond.notify_all()
        closers = [threading.Thread(target=self._close_entry, args=(e, grace), daemon=True) for e in entries]
        for t in closers:
            t.start()
        for t in closers:
            t.join()
        self._janitor.join(timeout=5)

    def __enter__(self) -> ModelService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _closed_error() -> EdgeInferError:
    from .errors import EngineClosedError

    return EngineClosedError("the model service is shutting down")


def _copy_error(error: BaseException) -> BaseException:
    """The error of a load another request started, for this request to raise (a copy: one
    exception object raised in several threads would share one traceback)."""
    try:
        return copy.copy(error)
    except Exception:  # pragma: no cover
        return EdgeInferError(str(error))


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def _duration_text(seconds: float) -> str:
    return "for ever" if seconds < 0 else f"{seconds:g} s"
