"""Files under the store that nothing uses — partial writes of killed processes, model files no
manifest names — listed by `Store.garbage()` and removed by `Store.collect_garbage()`."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import stat
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..fsutil import PARTIAL_SUFFIX, being_written, is_inside
from .locks import writer_busy
from .manifest import MAX_MANIFEST_BYTES, ModelManifest

__all__ = ["Garbage", "collect_garbage", "find_garbage"]


@dataclass(frozen=True)
class Garbage:
    """A file under the store that nothing uses."""

    path: Path
    size: int
    kind: str  # "partial": a write whose process is gone; "orphan": a model file no manifest names


class _Folders(Protocol):
    """What the collector reads of a Store."""

    @property
    def root(self) -> Path: ...

    @property
    def manifests_dir(self) -> Path: ...

    @property
    def models_dir(self) -> Path: ...

    def list(self) -> list[ModelManifest]: ...

    def lock(self) -> contextlib.AbstractContextManager[None]: ...


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


def find_garbage(store: _Folders, names: Collection[str] | None = None) -> list[Garbage]:
    """What `Store.garbage` lists (its docstring says what counts)."""
    started = _process_start()
    named = {os.path.realpath(m.file) for m in store.list()}
    for path in store.manifests_dir.glob("*/*.json"):  # a damaged manifest may still name its file
        with contextlib.suppress(OSError, ValueError, RecursionError):
            data = json.loads(path.read_bytes()[:MAX_MANIFEST_BYTES]) if path.is_file() else None
            if isinstance(data, dict) and isinstance(data.get("file"), str):
                named.add(os.path.realpath(data["file"]))
    out = []
    for top in (store.models_dir, store.manifests_dir):
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
                elif top == store.models_dir and fname.endswith(".gguf"):
                    if os.path.realpath(path) in named or _writer_busy_for(store.root, path):
                        continue
                    kind = "orphan"
                else:
                    continue
                out.append(Garbage(path, st.st_size, kind))
    return out


def _writer_busy_for(root: Path, model_file: Path) -> bool:
    """Whether the `writing` lock of the entry a store file would belong to is held."""
    name = model_file.parent.name
    prefix = f"{name}-"
    if not model_file.name.startswith(prefix):
        return False
    return writer_busy(root, name, model_file.name[len(prefix):].removesuffix(".gguf"))


def collect_garbage(store: _Folders, names: Collection[str] | None = None) -> list[Garbage]:
    """What `Store.collect_garbage` deletes, re-checked under the store lock; returns what went."""
    removed = []
    with store.lock():
        for g in find_garbage(store, names):
            if not is_inside(g.path.parent, store.root):
                continue
            try:
                g.path.unlink()
            except FileNotFoundError:
                continue
            removed.append(g)
            parent = g.path.parent
            if parent not in (store.models_dir, store.manifests_dir) and is_inside(parent, store.root):
                with contextlib.suppress(OSError):
                    parent.rmdir()  # only when empty
    return removed
