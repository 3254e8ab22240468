"""The download engine: one verified file in the Hugging Face cache, resumed across runs.

`huggingface_hub` does not verify what it downloads and keeps nothing of an interrupted download
across runs, so bodies are fetched here: into `blobs/<etag>.incomplete` (kept across Ctrl-C and
failures, resumed with a Range request), hashed while they arrive (sha256 for LFS files, the git
blob sha1 otherwise), and only a verified file is renamed to `blobs/<etag>` and linked from
`snapshots/<commit>/<file>`, exactly as `hf_hub_download` lays it out. A blob already in the cache
is re-hashed before it is trusted, since the client may have stored a damaged body under the right
name. The client still supplies the session, auth headers and error types.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..cancel import CancelToken, is_cancelled
from ..errors import Cancelled, IntegrityError, OfflineError
from ..fsutil import is_inside
from .cache import HubFile, Snapshot, cache_dir, endpoint, hub_errors, link, paths_for, write_ref

__all__ = [
    "PARTIAL_SUFFIX",
    "DownloadProgress",
    "Fetched",
    "ensure_file",
    "fetch_all",
]

logger = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".incomplete"  # the name older huggingface_hub versions resumed from, too

# Transient network failures: retried in the same call while bytes keep arriving; after this many
# attempts that bring nothing, the call fails and the partial file waits for the next run.
_RETRIES = 4
_BACKOFF_S = 0.5
_EMIT_EVERY_S = 0.1


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


DownloadCallback = Callable[[DownloadProgress], None] | None


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


@dataclass
class Fetched:
    """One file made present: its snapshot path and how many of its bytes came over the network."""

    path: Path
    downloaded: int
    reused: int


def ensure_file(
    snap: Snapshot,
    f: HubFile,
    token: str | None,
    on_progress: DownloadCallback,
    cancel: CancelToken,
    index: int,
    count: int,
) -> Fetched:
    """Make snapshots/<commit>/<f.path> a verified file; download (or resume) only what is missing."""
    from filelock import FileLock

    blob, pointer = paths_for(snap, f)
    storage = snap.storage
    start = time.monotonic()

    def progress(done: int, status: str, resumed: int = 0) -> None:
        if on_progress is not None:
            rate = (done - resumed) / max(time.monotonic() - start, 1e-6)
            on_progress(DownloadProgress(f.path, done, f.size, rate, status, resumed, index, count))

    locks = cache_dir() / ".locks" / storage.name
    locks.mkdir(parents=True, exist_ok=True)
    # The same lock file huggingface_hub takes for this blob: one writer at a time, ours or theirs.
    with FileLock(str(locks / f"{f.etag}.lock")):
        # inside the cache, not only blobs/: huggingface_hub may link a blob to its shared store
        if blob.is_file() and is_inside(blob, cache_dir()):
            last = [0.0]

            def verifying(done: int) -> None:
                if time.monotonic() - last[0] >= _EMIT_EVERY_S:
                    last[0] = time.monotonic()
                    progress(done, "verifying")
                if is_cancelled(cancel):
                    raise Cancelled("pull cancelled")

            if blob.stat().st_size == f.size and _hash_file(blob, f, verifying).matches():
                link(blob, pointer, storage)
                progress(f.size, "cached")
                return Fetched(pointer, 0, f.size)
            # A damaged blob (e.g. a body huggingface_hub stored unverified): drop it and fetch again.
            logger.info("%s: the cached blob does not match its hash; deleting it", f.path)
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
        link(blob, pointer, storage)
        progress(f.size, "done")
        return Fetched(pointer, downloaded, 0)


def fetch_all(
    snap: Snapshot, files: Sequence[HubFile], token: str | None, on_progress: DownloadCallback, cancel: CancelToken
) -> tuple[list[Path], int, int]:
    """Every file of `files` verified in the cache, then the ref → (snapshot paths, downloaded, reused)."""
    paths: list[Path] = []
    downloaded = reused = 0
    for i, f in enumerate(files, 1):
        r = ensure_file(snap, f, token, on_progress, cancel, i, len(files))
        paths.append(r.path)
        downloaded += r.downloaded
        reused += r.reused
    write_ref(snap)
    return paths, downloaded, reused


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
    snap: Snapshot,
    f: HubFile,
    partial: Path,
    token: str | None,
    progress: Callable[..., None],
    cancel: CancelToken,
) -> int:
    """Fetch f into `partial`, resuming what is there; verify; return the bytes fetched this run."""
    from urllib.parse import quote

    import httpx2
    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    url = f"{endpoint()}/{snap.repo}/resolve/{snap.commit}/{quote(f.path)}"
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
        if is_cancelled(cancel):
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
                with hub_errors(snap.repo, snap.revision):
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
                        if is_cancelled(cancel):
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
            logger.info("%s: connection lost at %d of %d bytes (%s); retrying", f.path, have, f.size, e)
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
