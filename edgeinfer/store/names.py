"""Store names: models are named like Ollama tags, `name:tag` (the tag is usually the quant, e.g.
`q4_k_m`); a path to a `.gguf` file works wherever a store name does."""

from __future__ import annotations

import re

from ..errors import ModelNotFoundError

__all__ = ["NAME_RE", "SHOWN_CHARS", "looks_like_path", "normalize_name", "parse_ref", "shown"]

NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}\Z")  # \Z, not $: "name\n" is no name
SHOWN_CHARS = 80  # of a name an error message repeats


def shown(name: str, limit: int = SHOWN_CHARS) -> str:
    """A name as an error message shows it: quoted, at most `limit` characters of it (a request's
    10 kB name is not echoed back whole)."""
    if len(name) <= limit:
        return repr(name)
    return f"{name[:limit]!r}... ({len(name)} characters)"


def normalize_name(text: str) -> str:
    """Turn free text (a repo id, a file stem) into a valid store name or tag."""
    out = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-.")
    return out[:128] or "model"


def parse_ref(ref: str) -> tuple[str, str | None]:
    """Split `name:tag` (tag optional) and validate both parts."""
    name, _, tag = ref.partition(":")
    if not NAME_RE.match(name):
        raise ModelNotFoundError(f"invalid model name {shown(ref)}: use lowercase letters, digits, '.', '_', '-'")
    if tag and not NAME_RE.match(tag):
        raise ModelNotFoundError(f"invalid tag in {shown(ref)}: use lowercase letters, digits, '.', '_', '-'")
    return name, (tag or None)


def looks_like_path(ref: str) -> bool:
    return ref.endswith(".gguf") or "/" in ref or ref.startswith(".") or ref.startswith("~")
