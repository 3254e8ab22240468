"""The tuned profile: `tune`'s choice, kept with the model in the store and used when it still holds.

It is a JSON file beside the tuned model's manifest, `manifests/<name>/<tag>.tuned` (written
atomically; `rm` deletes it with the manifest), with the picture beside it (`<tag>.tuned.svg`). It
holds the chosen setup, the table it was chosen from, and what it holds for (identity.py): this
machine, this llama.cpp build, and the files it names (the tuned model, the rung that runs, a draft
model). `run`, `chat` and `serve` use it for the model it was tuned for unless a flag sets a field
itself (`--untuned` ignores it); when anything it holds for has changed it is not used, and they
say why.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import StoreError
from ..fsutil import atomic_write_text
from ..store import SIDECAR_SUFFIXES
from .identity import build_key, describe_mismatch, file_identity, machine_key
from .pareto import Row
from .space import Setup

if TYPE_CHECKING:
    from ..store import ModelManifest, Store

__all__ = ["TunedProfile", "ProfileStatus", "profile_path", "plot_path", "save_profile", "read_profile",
           "tuned_status", "PROFILE_SUFFIX", "PLOT_SUFFIX"]

log = logging.getLogger(__name__)

PROFILE_SUFFIX, PLOT_SUFFIX = SIDECAR_SUFFIXES  # the store removes them with the manifest
_VERSION = 1
_MAX_BYTES = 4 << 20


def profile_path(store: Store, manifest: ModelManifest) -> Path:
    return store.manifests_dir / manifest.name / f"{manifest.tag}{PROFILE_SUFFIX}"


def plot_path(store: Store, manifest: ModelManifest) -> Path:
    return store.manifests_dir / manifest.name / f"{manifest.tag}{PLOT_SUFFIX}"


@dataclass(frozen=True)
class TunedProfile:
    model: str  # the store ref it was tuned for
    setup: Setup  # what runs
    reference: str  # what its KLD is against
    max_kld: float
    memory: int  # the memory budget it was tuned within, bytes
    workload: dict[str, str]  # {"name", "sha256"}
    machine: dict[str, Any]
    build: dict[str, str]
    files: dict[str, dict[str, Any]]  # store ref -> file identity
    predicted: dict[str, float]  # tok_s, ttft_s, kld, memory, level of the choice
    rows: tuple[Row, ...] = ()
    created: str = ""
    notes: tuple[str, ...] = field(default=())
    serve: dict[str, int] | None = None  # {"parallel", "ctx"} for `serve` (tune --serve), None: not tuned

    def to_json(self) -> str:
        data = {"version": _VERSION, "model": self.model, "setup": self.setup.to_dict(), "reference": self.reference,
                "max_kld": self.max_kld, "memory": self.memory, "workload": self.workload, "machine": self.machine,
                "build": self.build, "files": self.files, "predicted": self.predicted,
                "rows": [r.to_dict() for r in self.rows], "created": self.created, "notes": list(self.notes),
                "serve": self.serve}
        return json.dumps(data, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> TunedProfile:
        """ValueError (one line) for anything that is not a profile this version wrote."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"not JSON ({getattr(e, 'msg', 'nested too deeply')})") from None
        if not isinstance(data, dict) or data.get("version") != _VERSION:
            raise ValueError("not a version-1 tuned profile")
        for name, kind in (("model", str), ("reference", str), ("workload", dict), ("machine", dict), ("build", dict),
                           ("files", dict), ("predicted", dict), ("rows", list), ("created", str), ("notes", list)):
            if not isinstance(data.get(name), kind):
                raise ValueError(f"field {name!r} is missing or of the wrong type")
        max_kld, memory = data.get("max_kld"), data.get("memory")
        if isinstance(max_kld, bool) or not isinstance(max_kld, (int, float)) or max_kld < 0:
            raise ValueError("field 'max_kld' must be a number >= 0")
        if isinstance(memory, bool) or not isinstance(memory, int) or memory < 0:
            raise ValueError("field 'memory' must be an integer >= 0")
        if not all(isinstance(v, dict) for v in data["files"].values()):
            raise ValueError("field 'files' must map refs to file identities")
        serve = data.get("serve")
        if serve is not None and not (isinstance(serve, dict) and set(serve) == {"parallel", "ctx"} and all(
                isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 1 << 24 for v in serve.values())):
            raise ValueError("field 'serve' must be null or {\"parallel\": N, \"ctx\": N}")
        return cls(model=data["model"], setup=Setup.from_dict(data.get("setup")), reference=data["reference"],
                   max_kld=float(max_kld), memory=memory, workload=data["workload"], machine=data["machine"],
                   build=data["build"], files=data["files"], predicted=data["predicted"],
                   rows=tuple(Row.from_dict(r) for r in data["rows"]), created=data["created"],
                   notes=tuple(str(n) for n in data["notes"]), serve=serve)

    def stale(self) -> str | None:
        """Why the profile no longer holds (None: it does): the machine, the build or a file changed."""
        why = describe_mismatch("machine", self.machine, machine_key()) or \
            describe_mismatch("llama.cpp build", self.build, build_key())
        if why:
            return why
        for ref, ident in self.files.items():
            try:
                now = file_identity(ident.get("path", ""))
            except OSError:
                return f"the file of {ref} is gone ({ident.get('path')})"
            if describe_mismatch("file", ident, now):
                return f"the model file of {ref} changed since it was tuned"
        return None

    def summary(self) -> str:
        p = self.predicted
        return (f"{self.setup.label(short_model=False)}: {p.get('tok_s', 0):.1f} tok/s on the {self.workload.get('name')} "
                f"workload, KLD {p.get('kld', 0):.4f} (max {self.max_kld:g}), tuned {self.created}")


@dataclass(frozen=True)
class ProfileStatus:
    """The profile of a model as `run` sees it: usable, or why not (profile None: there is none)."""

    profile: TunedProfile | None
    reason: str | None  # None: usable

    @property
    def usable(self) -> bool:
        return self.profile is not None and self.reason is None


def save_profile(store: Store, manifest: ModelManifest, profile: TunedProfile, svg_text: str | None = None) -> Path:
    path = profile_path(store, manifest)
    with store.lock():
        if svg_text is not None:
            atomic_write_text(plot_path(store, manifest), svg_text)
        atomic_write_text(path, profile.to_json())
    return path


def read_profile(store: Store, manifest: ModelManifest) -> TunedProfile | None:
    """The stored profile; None when there is none; StoreError (one line) when it is damaged."""
    path = profile_path(store, manifest)
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StoreError(f"cannot read the tuned profile {path}: {e.strerror or e}") from None
    if len(raw) > _MAX_BYTES:
        raise StoreError(f"damaged tuned profile {path}: larger than {_MAX_BYTES >> 20} MiB")
    try:
        return TunedProfile.from_json(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise StoreError(f"damaged tuned profile {path}: {e} (`edgeinfer tune` writes a new one)") from None


def tuned_status(store: Store, manifest: ModelManifest | None) -> ProfileStatus:
    """The profile of `manifest` and whether it holds (a path, not a store model, has none)."""
    if manifest is None:
        return ProfileStatus(None, None)
    try:
        profile = read_profile(store, manifest)
    except StoreError as e:
        return ProfileStatus(None, str(e))
    if profile is None:
        return ProfileStatus(None, None)
    if profile.model != manifest.ref:
        return ProfileStatus(profile, f"it was tuned for {profile.model}")
    return ProfileStatus(profile, profile.stale())


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
