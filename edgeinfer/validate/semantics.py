"""The semantic check and the validation of a file: structure (gguf_file) and semantics, remembered
per file so that a second load of an unchanged file does not walk its vocabulary again."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from ..gguf_file import GGUFInfo, read_gguf
from .hyperparameters import check_hyperparameters
from .tensors import check_tensors
from .vocabulary import check_vocabulary

__all__ = ["JsonCache", "check_semantics", "validate_file"]

log = logging.getLogger(__name__)


class JsonCache(Protocol):
    """The store's small JSON caches (Store.read_cache / Store.write_cache)."""

    def read_cache(self, kind: str, key: str) -> Any | None: ...

    def write_cache(self, kind: str, key: str, value: Any) -> None: ...


def check_semantics(info: GGUFInfo) -> None:
    """Refuse what llama.cpp would abort on; raise InvalidModelError naming the key or tensor."""
    n_vocab = check_vocabulary(info)
    n_layer = check_hyperparameters(info)
    check_tensors(info, n_layer, n_vocab)


def validate_file(path: str | Path, cache: JsonCache | None = None) -> GGUFInfo:
    """Structural (gguf_file) and semantic validation: what must hold before llama.cpp sees a file.

    A file validated before and unchanged since (same path, size, mtime, ctime, inode) is read
    without walking its vocabulary again (read_gguf's known_spans): the walk is ~95 % of the time,
    and a second load should not pay it. Such files are remembered by this process, and with the
    store's `cache` across processes.
    """
    path = Path(path)
    key = str(path.resolve())
    try:
        identity = _identity(path)
    except OSError:
        identity = None  # read_gguf says what is wrong with the path
    known = None
    if identity is not None:
        remembered = _validated.get(key)
        if remembered is not None and remembered[0] == identity:
            known = remembered[1]
        elif cache is not None:
            entry = cache.read_cache(_SPANS, key)
            if isinstance(entry, dict) and entry.get("stat") == identity and isinstance(entry.get("spans"), dict):
                known = {k: tuple(v) for k, v in entry["spans"].items() if _is_span(v)}
    info = read_gguf(path, known_spans=known)
    check_semantics(info)
    if identity is not None and info.string_spans:
        if len(_validated) >= _VALIDATED_MAX:
            _validated.clear()
        _validated[key] = (identity, info.string_spans)
        if cache is not None and known is None:
            try:
                cache.write_cache(_SPANS, key, {"stat": identity, "spans": info.string_spans})
            except OSError as e:  # a read-only store only costs the walk next time
                log.debug("could not remember the layout of %s: %s", path.name, e)
    return info


# Files this process validated, for validate_file: resolved path -> (identity, string spans).
_validated: dict[str, tuple[list[int], dict[str, tuple[int, int]]]] = {}
_VALIDATED_MAX = 256
_SPANS = "gguf-spans"


def _identity(path: Path) -> list[int]:
    """What changes whenever a file's bytes do (ctime cannot be set back by a program)."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _is_span(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and v >= 0 for v in value)
