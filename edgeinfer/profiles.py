"""Quant profiles: named quantization recipes, one TOML file each.

Shipped profiles live in the `edgeinfer.quant_profiles` package (the repository's `quant_profiles/`
folder); a user's own profiles in `$EDGEINFER_HOME/profiles/*.toml` add to them, and one with the
same name replaces the shipped one. A file looks like:

    use_when = "the default: about a third of F16's size"   # one line, shown by `edgeinfer profiles`
    weights = "Q4_K_M"            # a quant type (llama.cpp's file type names)
    output_type = "Q6_K"          # optional: ggml type of output.weight
    embedding_type = "Q4_K"       # optional: ggml type of token_embd.weight
    kv_type = "f16"               # KV-cache type to load with: f16 | q8_0 | q4_0
    [overrides]                   # optional: tensor-name regex -> ggml type, first match wins
    'blk\\.0\\..*' = "Q8_0"

Unknown keys, unknown types and wrong value kinds are a ProfileError naming the file and the key.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from . import paths
from .errors import InvalidOptionError
from .kv_types import KV_TYPE_NAMES
from .quant_types import QUANT_TYPES, TENSOR_TYPES

__all__ = ["QuantProfile", "ProfileError", "load_profiles", "get_profile", "parse_profile", "KV_CACHE_TYPES"]

KV_CACHE_TYPES: tuple[str, ...] = KV_TYPE_NAMES  # the one list, in the bottom module edgeinfer.kv_types

_KEYS = {"use_when", "weights", "output_type", "embedding_type", "kv_type", "overrides"}


class ProfileError(InvalidOptionError):
    """A quant profile file that cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class QuantProfile:
    name: str
    weights: str  # quant type name, e.g. "Q4_K_M"
    use_when: str
    kv_type: str = "f16"
    output_type: str | None = None
    embedding_type: str | None = None
    overrides: tuple[tuple[str, str], ...] = ()  # (regex, ggml type), first match wins
    source: str = ""  # file the profile came from
    builtin: bool = True


def parse_profile(name: str, text: str, source: str = "<string>", builtin: bool = False) -> QuantProfile:
    """Parse one profile's TOML text; raise ProfileError naming `source` and the key on any problem."""

    def bad(key: str, problem: str) -> ProfileError:
        return ProfileError(f"quant profile {source}: key {key!r}: {problem}")

    try:
        data: dict[str, Any] = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"quant profile {source}: not valid TOML: {e}") from None
    for key in data:
        if key not in _KEYS:
            raise bad(key, f"unknown key (known: {', '.join(sorted(_KEYS))})")

    def string(key: str, required: bool = False) -> str | None:
        if key not in data:
            if required:
                raise bad(key, "missing")
            return None
        value = data[key]
        if not isinstance(value, str) or not value.strip():
            raise bad(key, f"must be a non-empty string, got {value!r}")
        return value.strip()

    use_when = string("use_when", required=True)
    assert use_when is not None
    if "\n" in use_when:
        raise bad("use_when", "must be one line")
    weights = string("weights", required=True)
    assert weights is not None
    if weights.upper() not in QUANT_TYPES:
        raise bad("weights", f"unknown quant type {weights!r} (known: {', '.join(QUANT_TYPES)})")

    def tensor_type(key: str, value: str | None) -> str | None:
        if value is None:
            return None
        if value.upper() not in TENSOR_TYPES:
            raise bad(key, f"unknown tensor type {value!r} (known: {', '.join(TENSOR_TYPES)})")
        return value.upper()

    output_type = tensor_type("output_type", string("output_type"))
    embedding_type = tensor_type("embedding_type", string("embedding_type"))
    kv_type = string("kv_type") or "f16"
    if kv_type.lower() not in KV_CACHE_TYPES:
        raise bad("kv_type", f"unknown KV-cache type {kv_type!r} (known: {', '.join(KV_CACHE_TYPES)})")

    overrides: list[tuple[str, str]] = []
    raw = data.get("overrides", {})
    if not isinstance(raw, dict):
        raise bad("overrides", "must be a table of 'regex' = \"TYPE\"")
    for pattern, value in raw.items():
        key = f"overrides.{pattern}"
        try:
            re.compile(pattern)
        except re.error as e:
            raise bad(key, f"not a valid regular expression: {e}") from None
        if not isinstance(value, str):
            raise bad(key, f"must be a tensor type string, got {value!r}")
        overrides.append((pattern, tensor_type(key, value) or ""))

    return QuantProfile(
        name=name,
        weights=weights.upper(),
        use_when=use_when,
        kv_type=kv_type.lower(),
        output_type=output_type,
        embedding_type=embedding_type,
        overrides=tuple(overrides),
        source=source,
        builtin=builtin,
    )


def _shipped_files() -> list[Any]:
    try:
        root: Any = resources.files("edgeinfer.quant_profiles")
    except ModuleNotFoundError:  # a source checkout that is not installed: the repository's folder
        root = Path(__file__).resolve().parent.parent / "quant_profiles"
    return sorted(root.iterdir(), key=lambda e: e.name)


def load_profiles(user_dir: Path | None = None) -> dict[str, QuantProfile]:
    """All profiles by name: the shipped ones, then the user's (which replace same-named ones)."""
    out: dict[str, QuantProfile] = {}
    for entry in _shipped_files():
        if entry.name.endswith(".toml"):
            name = entry.name.removesuffix(".toml")
            out[name] = parse_profile(name, entry.read_text(encoding="utf-8"), f"quant_profiles/{entry.name}", True)
    user_dir = user_dir if user_dir is not None else paths.profiles_dir()
    for file in sorted(Path(user_dir).glob("*.toml")):
        name = file.stem
        out[name] = parse_profile(name, file.read_text(encoding="utf-8"), str(file), False)
    return out


def get_profile(name: str, user_dir: Path | None = None) -> QuantProfile:
    profiles = load_profiles(user_dir)
    try:
        return profiles[name]
    except KeyError:
        raise ProfileError(f"no quant profile named {name!r} (known: {', '.join(profiles)})") from None
