"""What a model needs: its plan (the file resolved, its settings, its context) and its memory estimate.

Each model's need is `edgeinfer.fit`'s estimate for the settings it is loaded with: weights + KV
cache for its context (all its slots) + compute buffers, + the interleaved copies llama.cpp's CPU
backend makes of Q4_0/Q4_K/IQ4_NL matrices (its CPU_REPACK buffer, beside the mapped file), + the
draft model it speculates with, where one is named.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

from ..engine.core.options import LoadOptions, SpeculationOptions
from ..engine.faces.batch import BatchOptions
from ..fit import estimate_memory
from ..gguf_file import GGUFInfo
from ..store import ModelManifest

__all__ = ["MemoryParts", "ModelPlan", "expected_ctx", "gb_text", "model_memory"]

log = logging.getLogger(__name__)

_CTX_BLOCK = 256  # llama.cpp gives each slot a multiple of this many positions (measured on 0.3.36)


@dataclass(frozen=True)
class MemoryParts:
    """Estimated bytes of one loaded model, by part: edgeinfer.fit's estimate (weights, KV cache,
    compute buffers), the copies llama.cpp's CPU backend makes of some weights, a draft model."""

    weights: int
    kv_cache: int
    compute: int
    repack: int = 0  # interleaved copies of Q4_0/Q4_K/IQ4_NL matrices (llama.cpp's CPU_REPACK buffer)
    draft: int = 0  # the draft model a `draft=`/`auto=` speculation opens (all its parts)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.compute + self.repack + self.draft

    def to_dict(self) -> dict[str, int]:
        return {"weights": self.weights, "kv_cache": self.kv_cache, "compute": self.compute, "repack": self.repack,
                "draft": self.draft, "total": self.total}


# The weight types llama.cpp's CPU backend copies into interleaved blocks at load (its CPU_REPACK
# buffer), for the matrices of the layers, where the CPU has the kernels (feature REPACK): the
# mapped file stays resident beside the copy. Measured on 0.3.36 (AVX2/AVX512): the CPU_REPACK
# buffer is exactly the bytes of these tensors (Q8_0, Q3_K, Q5_K, Q6_K and the rest: not copied).
_REPACKED_TYPES = frozenset({"Q4_0", "Q4_K", "IQ4_NL"})


@functools.cache
def _cpu_repacks() -> bool:
    try:
        from ..devices import build_info

        return build_info().cpu_features.get("REPACK") == "1"
    except Exception as e:  # noqa: BLE001 - an estimate must not fail a load
        log.debug("CPU features unknown (%s): repacked weights not counted", e)
        return False


def _repack_bytes(info: GGUFInfo) -> int:
    if not _cpu_repacks():
        return 0
    return sum(t.n_bytes for t in info.tensors
               if t.name.startswith("blk.") and len(t.shape) == 2 and t.type_name in _REPACKED_TYPES)


def model_memory(info: GGUFInfo, load: LoadOptions, n_ctx: int, draft: int = 0) -> MemoryParts:
    """What a model needs loaded with `load` and an n_ctx context (the host's part: a placement
    over GPUs or RPC workers is not split here)."""
    type_k, type_v = load.kv_types
    est = estimate_memory(info, n_ctx, type_k, load.n_batch, load.flash_attn, kv_type_k=type_k, kv_type_v=type_v)
    return MemoryParts(est.weights, est.kv_cache, est.compute, _repack_bytes(info), draft)


@dataclass(frozen=True)
class ModelPlan:
    """A model resolved and sized, before (or after) it loads."""

    key: str  # the resolved file path: one engine per file
    name: str  # as responses name it: the store ref, else the file name
    path: Path
    manifest: ModelManifest | None
    info: GGUFInfo
    load: LoadOptions
    batch: BatchOptions
    speculation: SpeculationOptions
    keep_alive: float | None  # the model's own (serve.toml), None: the service's
    aliases: tuple[str, ...]
    n_ctx: int  # the whole context it gets (after llama.cpp's rounding)
    memory: MemoryParts

    @property
    def parallel(self) -> int:
        return self.batch.parallel

    @property
    def n_ctx_per_request(self) -> int:
        return self.n_ctx // self.batch.parallel


def expected_ctx(info: GGUFInfo, load: LoadOptions, parallel: int) -> int:
    """The context llama.cpp will give: each slot's share rounded up to a multiple of 256."""
    n_ctx = load.n_ctx or min(info.context_length or 4096, 4096)
    per_slot = -(-n_ctx // parallel)
    return -(-per_slot // _CTX_BLOCK) * _CTX_BLOCK * parallel


def gb_text(n: float) -> str:
    """Bytes as the service's messages and log say them."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"
