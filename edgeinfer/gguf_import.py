"""`edgeinfer import PATH`: a GGUF file the user already has, copied into the store and registered,
so that every command, the chat's model picker and the server's /v1/models see it by name.

The store gets its own copy, never a link to the user's file:

- a symbolic link would make the store depend on a path outside it (the file moved or deleted, the
  model is gone; a link is also what `rm` must never follow);
- a hard link shares the bytes: a tool that edits the original in place (gguf-py's
  `gguf_set_metadata.py` does, a re-download resumed over it would) silently changes the store's
  model under the sha256 its manifest records;
- so the file is cloned where the file system can (FICLONE: btrfs, XFS, bcachefs — instant, no
  space used until one side changes), else copied (the free space is checked first).

Only a regular file is read (a directory, FIFO or device is one line, never opened), it is
validated as every store model is (edgeinfer.validate) before anything is written, and the copy is
validated again before it is registered, so a file changed mid-copy is refused. Nothing outside the
store is written; a copy that fails or is cancelled leaves no file behind.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .cancel import CancelToken, raise_if_cancelled
from .errors import InvalidModelError, InvalidOptionError, ModelNotFoundError, StoreError
from .fsutil import atomic_path, ensure_free_space, is_inside
from .gguf_file import GGUFInfo
from .store import ManifestError, ModelManifest, Store, normalize_name, parse_ref
from .validate import validate_file

__all__ = ["import_gguf", "ImportProgress", "ImportResult", "default_import_name", "refuse_local_file"]

log = logging.getLogger(__name__)

_CHUNK = 8 << 20
_FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)
# A quant at the end of a file name ("…-Q4_K_M", "….f16"), dropped from the default name: it is the tag.
_QUANT_SUFFIX = re.compile(r"[-_.](?:I?Q\d+(?:_[a-z0-9]+)*|B?F16|F32|MXFP4(?:_MOE)?|NVFP4|TQ\d_\d)$", re.IGNORECASE)


@dataclass(frozen=True)
class ImportProgress:
    """Bytes copied so far (a clone reports its whole size at once)."""

    done: int
    total: int


@dataclass(frozen=True)
class ImportResult:
    manifest: ModelManifest
    method: str  # "clone" (copy-on-write, no space used) or "copy"
    seconds: float


def default_import_name(path: Path, file_type: str | None) -> tuple[str, str]:
    """(name, tag) for a file imported without --name: the file name without its quant, and the
    quant as the tag (`Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf` → qwen2.5-coder-1.5b-instruct:q4_k_m)."""
    stem = path.name[: -len(".gguf")] if path.name.lower().endswith(".gguf") else path.name
    stem = _QUANT_SUFFIX.sub("", stem)
    return normalize_name(stem), normalize_name(file_type or "latest")


def refuse_local_file(text: str, wanted: str) -> None:
    """For commands that take a store name or a Hub repo (`pull`, `recommend`): a GGUF file on this
    machine given instead is an error that says how it gets into the store. `wanted`: what the
    command takes ("pull takes a Hugging Face repo, owner/name")."""
    s = str(text).strip()
    looks_local = s.lower().endswith(".gguf") and (s.startswith(("/", ".", "~")) or s.count("/") != 1)
    if looks_local or (s and os.path.isfile(os.path.expanduser(s))):
        raise InvalidOptionError(f"{s} is a file on this machine and {wanted}: `edgeinfer import {s}` copies it "
                                 "into the store under a name")


def _regular_file(path: Path) -> os.stat_result:
    """The file's stat (symbolic links followed), or a one-line error for anything but a regular file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ModelNotFoundError(f"no such file: {path}") from None
    except OSError as e:
        raise InvalidOptionError(f"cannot read {path}: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise InvalidOptionError(f"{path} is a directory: give the path of a .gguf file")
    if not stat.S_ISREG(st.st_mode):
        kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else "a device"
        raise InvalidOptionError(f"{path} is {kind}, not a file: give the path of a .gguf file")
    return st


def _target_name(name: str | None, path: Path, file_type: str | None) -> tuple[str, str]:
    if name is None:
        return default_import_name(path, file_type)
    try:
        base, tag = parse_ref(name)
    except ModelNotFoundError as e:  # a name like ../x or Foo: the store's own rule, said as an option error
        raise InvalidOptionError(f"--name: {e}") from None
    return base, tag or normalize_name(file_type or "latest")


def _clone(src_fd: int, dst_fd: int) -> bool:
    """A copy-on-write clone of the whole file, where the file system has one."""
    try:
        import fcntl

        fcntl.ioctl(dst_fd, _FICLONE, src_fd)
        return True
    except (ImportError, OSError) as e:
        if isinstance(e, OSError) and e.errno not in (errno.EOPNOTSUPP, errno.EXDEV, errno.EINVAL, errno.ENOTTY,
                                                      errno.EBADF, errno.ENOSYS, errno.EPERM):
            raise
        return False


def _copy(src: int, dst: int, total: int, on_progress: Callable[[ImportProgress], None] | None,
          cancel: CancelToken) -> str:
    """Copy `total` bytes from fd to fd; returns their sha256 (what register would read again)."""
    h = hashlib.sha256()
    done = 0
    while done < total:
        raise_if_cancelled(cancel, "import cancelled")
        block = os.read(src, min(_CHUNK, total - done))
        if not block:
            raise InvalidModelError(f"the file shrank while it was copied ({done} of {total} bytes)")
        h.update(block)
        view = memoryview(block)
        while view:
            view = view[os.write(dst, view):]
        done += len(block)
        if on_progress is not None:
            on_progress(ImportProgress(done, total))
    if os.read(src, 1):
        raise InvalidModelError("the file grew while it was copied")
    os.fsync(dst)
    return h.hexdigest()


def _copy_into(src: Path, st: os.stat_result, target: Path, on_progress: Callable[[ImportProgress], None] | None,
               cancel: CancelToken) -> tuple[str, str | None, GGUFInfo]:
    """Clone or copy `src` to `target` (atomically: a partial file until it is complete and
    checked); returns the method, the sha256 when the copy computed it, and the copy's GGUF info."""
    # Opened without blocking and checked again: a path swapped for a FIFO since the stat cannot hang us.
    fd = os.open(src, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InvalidOptionError(f"{src} is not a regular file")
        os.set_blocking(fd, True)
        with atomic_path(target) as tmp:
            with open(tmp, "r+b") as out:
                method, sha256 = "clone", None
                if not _clone(fd, out.fileno()):
                    method = "copy"
                    ensure_free_space(target.parent, st.st_size, f"a copy of {src.name}")
                    sha256 = _copy(fd, out.fileno(), st.st_size, on_progress, cancel)
                elif on_progress is not None:
                    on_progress(ImportProgress(st.st_size, st.st_size))
            return method, sha256, validate_file(tmp)  # the bytes the store keeps, checked as every store model
    finally:
        os.close(fd)


def import_gguf(
    path: str | Path,
    name: str | None = None,
    *,
    store: Store | None = None,
    on_progress: Callable[[ImportProgress], None] | None = None,
    cancel: CancelToken = None,
) -> ImportResult:
    """Copy the GGUF at `path` into the store as `name` (`name` or `name:tag`; default: from the
    file name, the quant as the tag) and register it. One-line errors: not a regular file, not a
    valid GGUF, a split GGUF, an invalid name, a name already in the store, too little space."""
    started = time.monotonic()
    store = store or Store()
    src = Path(path).expanduser()
    st = _regular_file(src)
    if is_inside(src, store.root):
        raise InvalidOptionError(f"{src} is already inside the store ({store.root})")
    info = validate_file(src)  # a non-GGUF, a truncated or hostile one: refused before a byte is copied
    parts = info.metadata.get("split.count", 1)
    if isinstance(parts, int) and not isinstance(parts, bool) and parts > 1:
        raise InvalidOptionError(f"{src.name} is one part of a GGUF split in {parts}: merge the parts into one file "
                                 "first (llama.cpp's `llama-gguf-split --merge`)")
    base, tag = _target_name(name, src, info.file_type)
    ref = f"{base}:{tag}"
    with store.writing(base, tag, timeout=0):
        try:
            existing = store.find(ref)
        except ManifestError:
            existing = True
        if existing is not None or store.model_path(base, tag).exists():
            raise StoreError(f"{ref} is already in the store: choose another name (--name NAME[:TAG]) or "
                             f"remove it first (edgeinfer rm {ref})")
        target = store.model_path(base, tag)
        try:
            method, sha256, copied = _copy_into(src, st, target, on_progress, cancel)
            manifest = store.register(target, base, tag, source={"kind": "import", "path": str(src.resolve())},
                                      sha256=sha256, info=copied)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                target.unlink()
            with contextlib.suppress(OSError):
                target.parent.rmdir()  # only when empty (another tag of the name keeps it)
            raise
    log.info("imported %s as %s (%s, %.1f s)", src, ref, method, time.monotonic() - started)
    return ImportResult(manifest, method, time.monotonic() - started)
