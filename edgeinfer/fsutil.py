"""Small file-system helpers: atomic writes, hashing, free-space checks."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .errors import DiskSpaceError

__all__ = ["atomic_path", "atomic_write_text", "sha256_file", "ensure_free_space", "PARTIAL_SUFFIX"]

# Files being written carry this suffix until they are complete; nothing ever reads them as models.
PARTIAL_SUFFIX = ".partial"


@contextlib.contextmanager
def atomic_path(target: Path) -> Iterator[Path]:
    """Yield a temporary path beside `target`; rename it over `target` only if the block succeeds.

    On any exception (KeyboardInterrupt included) the temporary file is removed, so a
    half-written file never appears under the final name.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=PARTIAL_SUFFIX, dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a finished file gets the usual permissions
    try:
        yield tmp
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def atomic_write_text(target: Path, text: str) -> None:
    """Write text durably: temp file, fsync, rename."""
    with atomic_path(target) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def ensure_free_space(directory: Path, needed_bytes: int, what: str = "this") -> None:
    """Raise DiskSpaceError when `directory`'s file system has less than `needed_bytes` free."""
    directory = Path(directory)
    probe = directory
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed_bytes > free:
        raise DiskSpaceError(
            f"not enough disk space for {what}: need {needed_bytes / 1e9:.2f} GB, "
            f"{free / 1e9:.2f} GB free in {probe}"
        )
