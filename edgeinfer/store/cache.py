"""The store's small JSON caches: values remembered by kind and key under $EDGEINFER_HOME/cache/<kind>.json
(measured decode costs, the flash-attention verdict, files validated or loaded before). A cache can
always be measured again, so an unreadable one reads as empty."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import StoreError
from ..fsutil import atomic_write_text
from .names import NAME_RE

__all__ = ["read_cache", "write_cache"]


def _cache_path(root: Path, kind: str) -> Path:
    if not NAME_RE.match(kind):
        raise StoreError(f"invalid cache kind {kind!r}: use lowercase letters, digits, '.', '_', '-'")
    return root / "cache" / f"{kind}.json"


def read_cache(root: Path, kind: str, key: str) -> Any | None:
    """The value under `kind`/`key` in the store at `root`, or None (Store.read_cache)."""
    try:
        data = json.loads(_cache_path(root, kind).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return data.get(key) if isinstance(data, dict) else None


def write_cache(root: Path, lock: Callable[[], contextlib.AbstractContextManager[None]], kind: str, key: str,
                value: Any) -> None:
    """Remember `value` under `kind`/`key`: read-modify-write under the store's `lock`, written
    atomically (Store.write_cache)."""
    path = _cache_path(root, kind)
    with lock():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            data = {}
        if not isinstance(data, dict):
            data = {}
        data[key] = value
        atomic_write_text(path, json.dumps(data, indent=1))
