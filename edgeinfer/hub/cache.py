"""The Hugging Face cache and what a repo holds at one commit (a snapshot).

The real `huggingface_hub` client supplies metadata (model info with per-file sizes, git blob ids
and LFS sha256), auth, the endpoint (`HF_ENDPOINT`), offline mode (`HF_HUB_OFFLINE`) and the cache
layout (`models--owner--name/{blobs,snapshots,refs}`), so files other tools downloaded are reused
and ours are theirs. Every path is re-checked after symlinks are resolved, so a hostile repo (or a
cache folder that links elsewhere) cannot make us write outside the cache.

`huggingface_hub` is imported inside the functions: it reads HF_ENDPOINT and HF_HOME once, at its
import, so importing edgeinfer must not import it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import AuthenticationError, EdgeInferError, HubError, ModelNotFoundError, OfflineError
from ..fsutil import is_inside
from .spec import COMMIT_RE, ETAG_RE, check_repo_path, check_revision

__all__ = [
    "HubFile",
    "Snapshot",
    "cache_dir",
    "endpoint",
    "is_offline",
    "storage_dir",
    "hub_errors",
    "snapshot",
    "paths_for",
    "link",
    "write_ref",
]

logger = logging.getLogger(__name__)


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


@dataclass
class Snapshot:
    """What a repo holds at one commit, from the Hub or (offline) from the cache's symlinks."""

    repo: str
    revision: str
    commit: str
    files: dict[str, HubFile]
    offline: bool = False
    storage: Path = field(default_factory=Path)  # the repo's folder in the cache


def cache_dir() -> Path:
    """The Hugging Face hub cache (HF_HUB_CACHE, else HF_HOME/hub), read now, not at import."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE).expanduser()


def endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT.rstrip("/")


def is_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.is_offline_mode()) or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def storage_dir(repo: str) -> Path:
    """The repo's folder in the cache: `models--owner--name`."""
    from huggingface_hub.file_download import repo_folder_name

    return cache_dir() / repo_folder_name(repo_id=repo, repo_type="model")


# -- the Hub's answers -----------------------------------------------------------------------------


class _ServerError(HubError):
    """A 5xx from the Hub: like huggingface_hub, fall back to the cache when it has the repo."""


@contextlib.contextmanager
def hub_errors(repo: str, revision: str) -> Iterator[None]:
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
        raise ModelNotFoundError(f"repository {repo} not found on {endpoint()}") from None
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


# -- snapshots: what the repo holds at one commit ----------------------------------------------------


def _remote_snapshot(repo: str, revision: str, token: str | None) -> Snapshot:
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint())
    with hub_errors(repo, revision):
        info = api.model_info(repo, revision=revision, files_metadata=True, token=token)
        commit = info.sha or ""
        if not COMMIT_RE.match(commit):
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
        check_repo_path(f.path)
        if not ETAG_RE.match(f.etag):
            raise HubError(f"the server gave an invalid hash {f.etag!r} for {f.path}")
        if f.size < 0:
            raise HubError(f"the server gave a negative size for {f.path}")
    return Snapshot(repo, revision, commit, files, storage=storage_dir(repo))


def _cached_snapshot(repo: str, revision: str) -> Snapshot | None:
    """The files of `repo` at `revision` that are in the HF cache, from the symlinks (no network)."""
    storage = storage_dir(repo)
    commit = revision if COMMIT_RE.match(revision) else None
    if commit is None:
        ref = storage / "refs" / revision
        if ref.is_file() and is_inside(ref, storage):
            commit = ref.read_text().strip()
    if not commit or not COMMIT_RE.match(commit):
        return None
    snap_dir = storage / "snapshots" / commit
    if not snap_dir.is_dir() or not is_inside(snap_dir, storage):
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
            if not ETAG_RE.match(etag) or not blob.is_file() or not is_inside(blob, cache_dir()):
                continue
            size = blob.stat().st_size
            files[rel] = HubFile(rel, size, etag if len(etag) == 40 else None, etag if len(etag) == 64 else None)
    if not files:
        return None
    return Snapshot(repo, revision, commit, files, offline=True, storage=storage)


def snapshot(repo: str, revision: str, token: str | None) -> Snapshot:
    """The repo at `revision` from the Hub; from the cache when offline, or when the Hub is
    unreachable or answers 5xx and the cache has it."""
    if is_offline():
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
            raise OfflineError(f"cannot reach {endpoint()} ({e}) and {repo} is not in the Hugging Face cache") from None
        logger.info("%s: the Hub failed (%s); using the cached snapshot %s", repo, e, snap.commit)
        return snap


# -- placing files ---------------------------------------------------------------------------------


def paths_for(snap: Snapshot, f: HubFile) -> tuple[Path, Path]:
    """(blob, pointer), both checked to stay inside the repo's cache folder."""
    storage = snap.storage
    blob = storage / "blobs" / f.etag
    pointer = storage / "snapshots" / snap.commit / Path(*check_repo_path(f.path).split("/"))
    for p, root in ((blob, storage / "blobs"), (pointer, storage / "snapshots" / snap.commit)):
        if not os.path.abspath(p).startswith(os.path.abspath(root) + os.sep):
            raise HubError(f"refusing to write {f.path}: it would land outside the cache")
        if root.exists() and not is_inside(root, storage):
            raise HubError(f"refusing to write into {root}: it is a link out of the cache")
    return blob, pointer


def link(blob: Path, pointer: Path, storage: Path) -> None:
    """The snapshot symlink, relative like huggingface_hub's, after checking nothing escapes."""
    pointer.parent.mkdir(parents=True, exist_ok=True)
    if not is_inside(pointer.parent, storage):
        raise HubError(f"refusing to write {pointer}: a folder on the way links out of the cache")
    if os.path.lexists(pointer):
        if os.path.islink(pointer) and os.path.realpath(pointer) == os.path.realpath(blob):
            return
        pointer.unlink()
    try:
        os.symlink(os.path.relpath(blob, pointer.parent), pointer)
    except OSError:  # no symlinks (some file systems): a copy, as huggingface_hub does
        shutil.copyfile(blob, pointer)


def write_ref(snap: Snapshot) -> None:
    """refs/<revision> → the commit, as huggingface_hub records a branch or tag it resolved."""
    if snap.offline or snap.revision == snap.commit:
        return
    ref = snap.storage / "refs" / Path(*check_revision(snap.revision).split("/"))
    ref.parent.mkdir(parents=True, exist_ok=True)
    if not is_inside(ref.parent, snap.storage):
        raise HubError(f"refusing to write the ref {snap.revision!r}: it would land outside the cache")
    if not ref.exists() or ref.read_text().strip() != snap.commit:
        tmp = ref.with_name(f".{ref.name}.{os.getpid()}.tmp")
        tmp.write_text(snap.commit)
        os.replace(tmp, ref)
