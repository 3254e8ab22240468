"""Small file-system helpers: atomic writes, hashing, free-space checks, "no space left" messages."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .errors import DiskSpaceError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: partial files are then judged by age alone
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "atomic_path",
    "atomic_write_text",
    "sha256_file",
    "ensure_free_space",
    "is_inside",
    "being_written",
    "no_space_error",
    "mount_point",
    "PARTIAL_SUFFIX",
    "NO_SPACE_ERRNOS",
]

# Files being written carry this suffix until they are complete; nothing ever reads them as models.
PARTIAL_SUFFIX = ".partial"

# errno values that mean "the file system is full" (EDQUOT: the user's quota is).
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_inside(path: Path | str, root: Path | str) -> bool:
    """True when `path`, with every symlink resolved, is `root` or lies below it."""
    real, base = os.path.realpath(path), os.path.realpath(root)
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


def mount_point(path: Path | str) -> Path:
    """The mount point of the file system holding `path` (or its nearest existing parent)."""
    probe = Path(os.path.realpath(path))
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    while not os.path.ismount(probe) and probe != probe.parent:
        probe = probe.parent
    return probe


def no_space_error(path: Path | str, cause: BaseException | None = None) -> DiskSpaceError:
    """The one message every full-disk failure reads: no space left on DEVICE while writing PATH."""
    where = mount_point(path)
    detail = f" ({cause})" if cause is not None and not isinstance(cause, OSError) else ""
    return DiskSpaceError(f"no space left on {where} while writing {path}{detail}")


def being_written(path: Path | str) -> bool:
    """True while a live process holds the lock `atomic_path` keeps on its temporary file."""
    if fcntl is None:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's own lock
    return False


@contextlib.contextmanager
def atomic_path(target: Path) -> Iterator[Path]:
    """Yield a temporary path beside `target`; rename it over `target` only if the block succeeds.

    On any exception (KeyboardInterrupt included) the temporary file is removed, so a
    half-written file never appears under the final name. While the block runs, an exclusive
    flock on the temporary file tells `being_written` (and so `edgeinfer gc`) that it is alive;
    a killed writer's lock goes with its process. A full disk inside the block becomes one
    DiskSpaceError naming the device and `target`.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=PARTIAL_SUFFIX, dir=target.parent)
    tmp = Path(tmp_name)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; a finished file gets the usual permissions
        try:
            yield tmp
            os.replace(tmp, target)
        except OSError as e:
            if e.errno in NO_SPACE_ERRNOS:
                raise no_space_error(target) from e
            raise
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    finally:
        os.close(fd)


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
