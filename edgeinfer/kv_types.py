"""The KV-cache types llama.cpp's CPU path accepts: the one list the engine, fit, CLI and TUI use.

Each type has its ggml type id (what `llama_context_params.type_k/type_v` take) and its size in
the cache, block overhead included (q8_0 stores 32 elements in 34 bytes: an f16 scale + 32 int8).
llama.cpp refuses a quantized V cache without flash attention; `flash_attn_for` turns it on where
needed and names the conflict when a caller switched it off explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidOptionError

__all__ = ["KVCacheType", "KV_CACHE_TYPES", "KV_TYPE_NAMES", "kv_cache_type", "flash_attn_for"]


@dataclass(frozen=True)
class KVCacheType:
    name: str  # as llama.cpp's --cache-type-k/-v spell it
    ggml_type: int  # enum ggml_type
    block: int  # elements per block
    block_bytes: int  # bytes per block

    @property
    def bytes_per_element(self) -> float:
        return self.block_bytes / self.block

    @property
    def quantized(self) -> bool:
        return self.block > 1


KV_CACHE_TYPES: dict[str, KVCacheType] = {
    t.name: t
    for t in (
        KVCacheType("f32", 0, 1, 4),
        KVCacheType("f16", 1, 1, 2),
        KVCacheType("bf16", 30, 1, 2),
        KVCacheType("q8_0", 8, 32, 34),
        KVCacheType("q5_1", 7, 32, 24),
        KVCacheType("q5_0", 6, 32, 22),
        KVCacheType("q4_1", 3, 32, 20),
        KVCacheType("q4_0", 2, 32, 18),
        KVCacheType("iq4_nl", 20, 32, 18),
    )
}
KV_TYPE_NAMES: tuple[str, ...] = tuple(KV_CACHE_TYPES)


def kv_cache_type(name: str) -> KVCacheType:
    """The type called `name` (case-insensitive), or a one-line InvalidOptionError listing them all."""
    t = KV_CACHE_TYPES.get(str(name).lower())
    if t is None:
        raise InvalidOptionError(f"unknown KV-cache type {name!r}: choose one of {', '.join(KV_TYPE_NAMES)}")
    return t


def flash_attn_for(type_k: str, type_v: str, flash_attn: bool | None) -> bool | None:
    """The flash-attention setting to give llama.cpp (None: its own choice, on for CPU).

    A quantized V cache only works with flash attention: it is switched on, and an explicit False
    is an error rather than a context llama.cpp refuses to create."""
    kv_cache_type(type_k)
    if not kv_cache_type(type_v).quantized:
        return flash_attn
    if flash_attn is False:
        raise InvalidOptionError(
            f"a quantized V cache ({type_v}) needs flash attention, which was switched off; use an f16/bf16/f32 V cache "
            "or leave flash attention on"
        )
    return True
