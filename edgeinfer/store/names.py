"""Store names: models are named like Ollama tags, `name:tag` (the tag is usually the quant, e.g.
`q4_k_m`); a path to a `.gguf` file works wherever a store name does."""

from __future__ import annotations

import re

from ..errors import ModelNotFoundError

__all__ = ["NAME_RE", "looks_like_path", "normalize_name", "parse_ref"]

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")


def normalize_name(text: str) -> str:
    """Turn free text (a repo id, a file stem) into a valid store name or tag."""
    out = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-.")
    return out[:128] or "model"


def parse_ref(ref: str) -> tuple[str, str | None]:
    """Split `name:tag` (tag optional) and validate both parts."""
    name, _, tag = ref.partition(":")
    if not NAME_RE.match(name):
        raise ModelNotFoundError(f"invalid model name {ref!r}: use lowercase letters, digits, '.', '_', '-'")
    if tag and not NAME_RE.match(tag):
        raise ModelNotFoundError(f"invalid tag in {ref!r}: use lowercase letters, digits, '.', '_', '-'")
    return name, (tag or None)


def looks_like_path(ref: str) -> bool:
    return ref.endswith(".gguf") or "/" in ref or ref.startswith(".") or ref.startswith("~")
