"""The writer lock of each store name: the exclusive right to produce and register `name:tag`,
across processes (a file lock under $EDGEINFER_HOME/locks) and threads.

(The store lock, around every read-modify-write of manifests, is `Store.lock`.)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import filelock
from filelock import FileLock

from ..errors import StoreError
from .names import NAME_RE, parse_ref

__all__ = ["writer_busy", "writing"]

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


def _writer_lock_path(root: Path, name: str, tag: str) -> Path:
    return root / "locks" / name / f"{tag}.lock"


@contextlib.contextmanager
def writing(root: Path, name: str, tag: str, *, timeout: float = 0) -> Iterator[None]:
    """Hold the writer lock of `name:tag` in the store at `root` (Store.writing says how to use it)."""
    parse_ref(f"{name}:{tag}")
    path = _writer_lock_path(root, name, tag)
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


def writer_busy(root: Path, name: str, tag: str) -> bool:
    """Whether someone holds the writer lock of `name:tag` now."""
    path = _writer_lock_path(root, name, tag)
    if not NAME_RE.match(name) or not NAME_RE.match(tag) or not path.exists():
        return False
    lk = _writer_lock(path)
    try:
        lk.acquire(timeout=0)
    except filelock.Timeout:
        return True
    lk.release()
    return False
