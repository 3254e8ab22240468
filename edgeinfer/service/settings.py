"""How the service and each model are set up: `ServiceOptions`, and `$EDGEINFER_HOME/serve.toml`
checked by hand, strictly (`read_settings_file`):

    [defaults]                              # every model without a table of its own
    parallel = 2
    [models."smollm2-135m-instruct:q8_0"]   # a store name, or a path (the operator's, not a request's)
    parallel = 1                            # slots
    ctx = 2048                              # whole context, split between the slots
    kv_type = "q8_0"                        # also kv_type_k, kv_type_v, flash_attn, kv_unified
    speculate = "lookup"                    # as --speculate
    keep_alive = "10m"                      # seconds or 30s / 5m / 1h; 0; -1 = for ever
    suffix_memory = "store"                 # as --suffix-memory: "store", an absolute folder, or "off"
    alias = ["fast"]                        # more names a request may use
    # threads, batch, gpu_layers, draft_gpu_layers, rpc, tensor_split: as the serve flags
    [slots]                                 # the server's slot files (llama-server's --slot-save-path)
    path = "slots"                          # a folder (relative: to this file's); none: slot actions are off
    quota = "2G"                            # the most their files may take together (--slot-quota)

A table's settings win over [defaults]; the server's flags win over both for the default model
(and over [slots]).
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar

from ..engine.core.options import DEFAULT_LOAD, DEFAULT_SPECULATION, LoadOptions, SpeculationOptions
from ..engine.faces.batch import BatchOptions
from ..errors import InvalidOptionError
from .units import parse_duration, parse_size

__all__ = [
    "DEFAULT_KEEP_ALIVE",
    "DEFAULT_MAX_LOADED",
    "DEFAULT_ROOM_WAIT",
    "DEFAULT_SLOT_QUOTA",
    "SETTINGS_FILE",
    "ModelSettings",
    "ServiceOptions",
    "SlotSettings",
    "read_settings_file",
    "read_slot_settings",
]

DEFAULT_KEEP_ALIVE = 300.0  # seconds an idle model stays loaded (Ollama's 5 minutes)
DEFAULT_MAX_LOADED = 3  # models loaded at once (Ollama's default on a CPU)
DEFAULT_ROOM_WAIT = 60.0  # seconds a request waits for a busy model to become idle and make room
SETTINGS_FILE = "serve.toml"  # per-model settings, in the store's root
DEFAULT_SLOT_QUOTA = 4 << 30  # bytes the slot files of a server may take together (--slot-quota)


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
    speculate: str | None = None  # off | lookup | suffix | auto | auto=MODEL | draft=MODEL | self=QUANT
    keep_alive: float | None = None  # seconds; 0: unload after each request; -1: for ever
    alias: tuple[str, ...] = ()
    suffix_memory: str | None = None  # LoadOptions.suffix_memory: "store", a folder, "off"

    _LOAD: ClassVar[dict[str, str]] = {"ctx": "n_ctx", "batch": "n_batch", "threads": "n_threads", "kv_type": "kv_type",
             "kv_type_k": "kv_type_k", "kv_type_v": "kv_type_v", "flash_attn": "flash_attn",
             "gpu_layers": "n_gpu_layers", "draft_gpu_layers": "draft_gpu_layers", "rpc": "rpc",
             "tensor_split": "tensor_split", "suffix_memory": "suffix_memory"}

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
            elif key in ("kv_type", "kv_type_k", "kv_type_v", "speculate", "suffix_memory"):
                if not isinstance(v, str):
                    raise InvalidOptionError(f"{where}: {key} must be a string, got {v!r}")
                v = v.lower() if key not in ("speculate", "suffix_memory") else v
                if key == "suffix_memory" and v.strip().lower() not in ("store", "off") \
                        and not Path(v).expanduser().is_absolute():  # (relative to what? the server's cwd is no answer)
                    raise InvalidOptionError(f"{where}: suffix_memory must be 'store', 'off' or an absolute folder, "
                                             f"got {v!r}")
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
            settings = settings.validate()
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
        if self.keep_alive is not None and parse_duration(self.keep_alive) != self.keep_alive:
            return replace(self, keep_alive=parse_duration(self.keep_alive))  # clamped (or -1 for ever)
        return self


def _read_toml(path: Path) -> dict[str, Any]:
    """serve.toml's tables (absent file: none), its top level checked."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidOptionError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise InvalidOptionError(f"{path} is not valid TOML: {e}") from None
    unknown = sorted(set(data) - {"defaults", "models", "slots"})
    if unknown:
        raise InvalidOptionError(f"{path}: unknown table or key {unknown[0]!r} (known: [defaults], "
                                 "[models.\"NAME:TAG\"], [slots])")
    return data


def read_settings_file(path: Path) -> tuple[ModelSettings, dict[str, ModelSettings]]:
    """`serve.toml`: the [defaults] table and the [models."REF"] tables (absent file: none)."""
    data = _read_toml(path)
    read_slot_settings(path, data)  # checked with the rest: one line at start, not at the first slot action
    defaults = ModelSettings.from_table(data.get("defaults", {}), f"{path}: [defaults]")
    models = data.get("models", {})
    if not isinstance(models, Mapping):
        raise InvalidOptionError(f"{path}: models must be tables like [models.\"NAME:TAG\"]")
    return defaults, {ref: ModelSettings.from_table(t, f"{path}: [models.{ref!r}]") for ref, t in models.items()}


@dataclass(frozen=True)
class SlotSettings:
    """serve.toml's [slots] table: the folder where a server saves slot states (llama-server's
    --slot-save-path; None: slot actions are off) and the bytes their files may take together."""

    path: Path | None = None
    quota: int | None = None  # None: DEFAULT_SLOT_QUOTA


def read_slot_settings(path: Path, data: Mapping[str, Any] | None = None) -> SlotSettings:
    """`serve.toml`'s [slots] table (absent: none), strictly; a relative `path` is the file's folder's."""
    table = (_read_toml(path) if data is None else data).get("slots", {})
    where = f"{path}: [slots]"
    if not isinstance(table, Mapping):
        raise InvalidOptionError(f"{where} must be a table")
    unknown = sorted(set(table) - {"path", "quota"})
    if unknown:
        raise InvalidOptionError(f"{where}: unknown setting {unknown[0]!r} (known: path, quota)")
    folder = table.get("path")
    if folder is not None and (not isinstance(folder, str) or not folder.strip()):
        raise InvalidOptionError(f"{where}: path must be a folder's path, got {folder!r}")
    quota = table.get("quota")
    return SlotSettings(None if folder is None else path.parent / Path(folder).expanduser(),
                        None if quota is None else parse_size(quota, f"{where}: quota"))


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
        """These options checked; a copy where a duration was clamped (see parse_duration)."""
        keep_alive = parse_duration(self.keep_alive, "keep_alive")
        if isinstance(self.max_loaded, bool) or not isinstance(self.max_loaded, int) or not 1 <= self.max_loaded <= 64:
            raise InvalidOptionError(f"max_loaded must be an integer in [1, 64], got {self.max_loaded!r}")
        if self.max_memory is not None and (isinstance(self.max_memory, bool) or not isinstance(self.max_memory, int)
                                            or self.max_memory < 1):
            raise InvalidOptionError(f"max_memory must be a positive number of bytes, got {self.max_memory!r}")
        if not (isinstance(self.room_wait_s, int | float) and math.isfinite(self.room_wait_s) and self.room_wait_s >= 0):
            raise InvalidOptionError(f"room_wait_s must be a finite number of seconds >= 0, got {self.room_wait_s!r}")
        defaults, flags = self.defaults.validate(), self.default_settings.validate()
        models = {ref: s.validate() for ref, s in self.models.items()}
        if (keep_alive, defaults, flags, models) != (self.keep_alive, self.defaults, self.default_settings,
                                                     dict(self.models)):
            return replace(self, keep_alive=keep_alive, defaults=defaults, default_settings=flags, models=models)
        return self
