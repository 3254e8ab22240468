"""Durations and sizes as people write them: Ollama's keep_alive forms, memory budgets like 8G or 7.5GiB."""

from __future__ import annotations

import math
import re

from ..errors import InvalidOptionError

__all__ = ["parse_duration", "parse_size"]

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h)")


def parse_duration(value: object, what: str = "keep_alive") -> float:
    """Seconds from a number or a duration text (Ollama's forms: "300", "30s", "5m", "1h30m",
    "0", "-1"); any negative value means for ever and is returned as -1."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise InvalidOptionError(f"{what} must be a number of seconds or a duration like 5m, got {value!r}")
    if isinstance(value, str):
        text = value.strip().lower()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = float(body)
        except ValueError:
            parts = _DURATION_PART.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise InvalidOptionError(f"{what} must be a number of seconds or a duration like 30s, 5m, 1h "
                                         f"(negative: for ever), got {value!r}") from None
            scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
            seconds = sum(float(n) * scale[u] for n, u in parts)
        seconds *= sign
    else:
        seconds = float(value)
    if math.isnan(seconds) or (math.isinf(seconds) and seconds > 0):
        raise InvalidOptionError(f"{what} must be a finite duration, got {value!r}")
    return -1.0 if seconds < 0 else seconds


_SIZE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)b?$")


def parse_size(value: str | int, what: str = "memory") -> int:
    """Bytes from 8000000000, "8G", "8GB" (powers of 1000) or "7.5GiB" (powers of 1024)."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = float(value)
    elif isinstance(value, str) and (m := _SIZE.match(value.strip().lower())):
        n = float(m.group(1)) * (1024 if m.group(3) else 1000) ** "_kmgt".index(m.group(2) or "_")
    else:
        raise InvalidOptionError(f"{what} must be a size like 8G, 7.5GiB or a number of bytes, got {value!r}")
    if not n >= 1:
        raise InvalidOptionError(f"{what} must be more than 0 bytes, got {value!r}")
    return int(n)
