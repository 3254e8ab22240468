"""Reading a GGUF's metadata and tensors as the rules need them: typed values, per-layer values, a
tensor of a given shape, and the one-line error that names the file."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidModelError
from ..gguf_file import ArraySummary, GGUFInfo

__all__ = ["MAX_CONTEXT", "MAX_EMBEDDING", "MAX_EXPERTS", "MAX_LAYERS", "check_shape", "fail", "get_float", "get_int",
           "ints", "ints_of", "per_layer", "split_count"]

# llama.cpp's limits (llama-hparams.h) and our own plausibility bounds.
MAX_LAYERS = 512
MAX_EXPERTS = 1024
MAX_CONTEXT = 1 << 27
MAX_EMBEDDING = 1 << 20


def fail(info: GGUFInfo, problem: str) -> InvalidModelError:
    return InvalidModelError(f"{info.path.name}: {problem}")


def ints(value: Any) -> list[int] | None:
    """The integers of a scalar or per-layer array; None for a skipped (summarized) array."""
    if isinstance(value, ArraySummary):
        return None
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)] if values else []


def get_int(info: GGUFInfo, key: str, *, required: bool = False) -> int | None:
    value = info.metadata.get(key)
    if value is None:
        if required:
            raise fail(info, f"{key} is missing")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise fail(info, f"{key} must be an integer, not {type(value).__name__}")
    return value


def get_float(info: GGUFInfo, key: str) -> float | None:
    value = info.metadata.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise fail(info, f"{key} must be a number, not {type(value).__name__}")
    return float(value)


def per_layer(info: GGUFInfo, key: str, n_layer: int) -> list[int] | None:
    """A hyper-parameter stored as one integer or as one per layer (llama.cpp's get_key_or_arr)."""
    value = info.metadata.get(key)
    if value is None:
        return None
    if isinstance(value, ArraySummary):
        if value.length != n_layer:
            raise fail(info, f"{key} has {value.length} entries for {n_layer} layers")
        return None
    values = ints(value)
    if values is None or len(values) != (len(value) if isinstance(value, list) else 1):
        raise fail(info, f"{key} must hold integers")
    if isinstance(value, list) and len(values) != n_layer:
        raise fail(info, f"{key} has {len(values)} entries for {n_layer} layers")
    return values


def ints_of(info: GGUFInfo, key: str) -> list[int] | None:
    value = get_int(info, key)
    return None if value is None else [value]


def check_shape(info: GGUFInfo, by_name: dict[str, Any], name: str, shape: tuple[int, ...] | None,
                required: bool = True) -> Any:
    t = by_name.get(name)
    if t is None:
        if required:
            raise fail(info, f"tensor {name!r} is missing")
        return None
    if shape is not None and t.shape != shape:
        raise fail(info, f"tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
    return t


def split_count(info: GGUFInfo) -> int:
    count = info.metadata.get("split.count", 1)
    return count if isinstance(count, int) and not isinstance(count, bool) else 1
