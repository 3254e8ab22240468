"""A face's suffix memory: kept on disk when LoadOptions.suffix_memory says so (per model file,
per scope: speculation/suffix_file.py), else in memory only."""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path

from ..core.options import LoadOptions
from ..speculation.suffix import DEFAULT_MEMORY_TOKENS, SuffixMemory
from ..speculation.suffix_file import SuffixKeeper

__all__ = ["suffix_memory", "model_identity"]

log = logging.getLogger(__name__)


def model_identity(path: Path) -> str:
    """The model file's cheap identity (resolved path, size, modification time: the store's hash
    cache trusts the same): a file moved, rewritten or touched starts a fresh memory."""
    p = Path(path).resolve()
    st = p.stat()
    return f"{p}|{st.st_size}|{st.st_mtime_ns}"


def suffix_memory(path: Path, options: LoadOptions, store_root: Path, n_vocab: int) -> SuffixMemory:
    """The memory a face's scheduler keeps: with a keeper in `<folder>/<model>-<digest>/` when the
    options keep it on disk (a file that cannot be identified: in memory only, said once)."""
    folder = options.suffix_folder(store_root)
    if folder is None:
        return SuffixMemory()
    try:
        identity = model_identity(path)
    except OSError as e:
        log.warning("suffix memory: kept in memory only: cannot identify %s (%s)", path, e.strerror or e)
        return SuffixMemory()
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", Path(path).stem)[:64] or "model"
    digest = hashlib.sha256(identity.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    keeper = SuffixKeeper(folder / f"{stem}-{digest}", identity, n_vocab, DEFAULT_MEMORY_TOKENS)
    return SuffixMemory(DEFAULT_MEMORY_TOKENS, keeper=keeper)
