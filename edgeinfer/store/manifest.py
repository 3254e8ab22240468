"""The manifest: one JSON file per model under $EDGEINFER_HOME/manifests/<name>/<tag>.json, what the
store knows about one model file.

The store trusts nothing it reads: a manifest is schema-checked (a damaged one is reported, never a
traceback), read without following links out of the store, without blocking on a FIFO planted in
its place, and only up to a size no manifest of ours reaches.
"""

from __future__ import annotations

import functools
import json
import math
import os
import stat
import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ..errors import StoreError
from ..fsutil import is_inside
from .names import NAME_RE

__all__ = ["MAX_MANIFEST_BYTES", "SIDECAR_SUFFIXES", "ManifestError", "ModelManifest", "read_manifest"]

MAX_MANIFEST_BYTES = 4 << 20  # a manifest is a few KB; a bigger file is not one of ours
# Files kept beside a manifest `<tag>.json` as `<tag><suffix>` (edgeinfer.tune's profile and its
# picture): removed with the manifest.
SIDECAR_SUFFIXES = (".tuned", ".tuned.svg")


class ManifestError(StoreError):
    """A manifest that cannot be trusted (unreadable, not JSON, not an object, a wrong field)."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"damaged manifest {path}: {reason}")
        self.path = Path(path)
        self.reason = reason


@dataclass
class ModelManifest:
    """What the store knows about one model file."""

    name: str
    tag: str
    file: str  # absolute path of the GGUF (inside the store, or an external file it references)
    sha256: str
    size: int
    architecture: str
    parameters: int
    context_length: int | None
    quant: str | None  # nominal file type, e.g. Q4_K_M
    bits_per_weight: float  # effective, from the tensor types actually in the file
    source: dict[str, Any] = field(default_factory=dict)  # e.g. {"kind": "hub", "repo": ..., "revision": ...}
    derived_from: str | None = None  # store ref or path of the model this was made from
    created: str = ""
    owned: bool = True  # the store deleted the file on `rm` only when it owns it
    metrics: dict[str, Any] = field(default_factory=dict)  # eval / bench results, keyed by kind
    load_checked: str | None = None  # the sha256 llama.cpp loaded in a child process (validate.admit)

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.tag}"

    @property
    def path(self) -> Path:
        return Path(self.file)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelManifest:
        """A manifest from parsed JSON; ValueError (one line) when it does not fit the schema."""
        if not isinstance(data, dict):
            raise ValueError(f"not a JSON object but {_json_kind(data)}")
        hints = _field_hints()
        values = {}
        for f in fields(cls):
            if f.name not in data:
                if f.default is MISSING and f.default_factory is MISSING:
                    raise ValueError(f"field {f.name!r} is missing")
                continue
            value = data[f.name]
            hint = hints.get(f.name, Any)
            if not _type_ok(value, hint):
                raise ValueError(f"field {f.name!r} is {_json_kind(value)}, expected {_hint_name(hint)}")
            values[f.name] = value
        for key in ("name", "tag"):
            if not NAME_RE.match(values[key]):
                raise ValueError(f"field {key!r} is not a valid store name: {values[key][:80]!r}")
        file = values["file"]
        if not file or "\x00" in file or not os.path.isabs(file):
            raise ValueError(f"field 'file' is not an absolute path: {file[:200]!r}")
        for key in ("size", "parameters", "context_length"):
            if values.get(key) is not None and values[key] < 0:
                raise ValueError(f"field {key!r} is negative")
        if not math.isfinite(values.get("bits_per_weight", 0.0)):
            raise ValueError("field 'bits_per_weight' is not a finite number")
        return cls(**values)


def _json_kind(value: object) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
             int: "an integer", float: "a number"}
    return names.get(type(value), type(value).__name__)


@functools.cache
def _field_hints() -> dict[str, Any]:
    try:
        return typing.get_type_hints(ModelManifest)
    except (NameError, TypeError):  # an annotation only a type checker can resolve: check the others
        return {}


def _type_ok(value: object, hint: Any) -> bool:
    """Whether a JSON value fits a dataclass annotation (int excludes bool; float accepts int)."""
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(hint))
    if hint is type(None):
        return value is None
    base = origin or hint
    if base is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if base in (list, tuple):
        return isinstance(value, list)
    return isinstance(value, base) if isinstance(base, type) else True


def _hint_name(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_hint_name(a) for a in typing.get_args(hint))
    base = typing.get_origin(hint) or hint
    return {dict: "an object", list: "an array", tuple: "an array", str: "a string", bool: "a boolean",
            type(None): "null", int: "an integer", float: "a number"}.get(base, str(hint))


def read_manifest(path: Path, manifests_dir: Path) -> ModelManifest:
    """Read and schema-check the manifest at `path` (under the store's `manifests_dir`):
    FileNotFoundError when absent, else ManifestError."""
    if not is_inside(path.parent, manifests_dir):
        raise ManifestError(path, "its folder is a link to outside the store")
    try:  # non-blocking: a FIFO planted as a manifest must not hang `list`
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ManifestError(path, "a symbolic link" if os.path.islink(path) else (e.strerror or str(e))) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ManifestError(path, "not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        raise ManifestError(path, e.strerror or str(e)) from None
    finally:
        os.close(fd)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(path, f"larger than {MAX_MANIFEST_BYTES >> 20} MiB")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ManifestError(path, "not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ManifestError(path, f"not valid JSON (truncated?): {e.msg} at line {e.lineno}") from None
    except RecursionError:
        raise ManifestError(path, "JSON nested too deeply") from None
    try:
        m = ModelManifest.from_dict(data)
    except ValueError as e:
        raise ManifestError(path, str(e)) from None
    if (m.name, m.tag) != (path.parent.name, path.stem):
        raise ManifestError(path, f"it names {m.ref} but is stored as {path.parent.name}:{path.stem}")
    return m
