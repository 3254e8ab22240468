"""Options for loading a model and for one generation request, grouped in small dataclasses."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Literal

from ..errors import InvalidOptionError

__all__ = [
    "KVType",
    "LoadOptions",
    "SamplingOptions",
    "SpeculationOptions",
    "GenerateOptions",
    "KV_TYPES",
    "SPECULATION_METHODS",
]

KVType = Literal["f16", "q8_0", "q4_0"]
KV_TYPES: tuple[str, ...] = ("f16", "q8_0", "q4_0")
SPECULATION_METHODS: tuple[str, ...] = ("off", "lookup", "draft", "self", "auto")


@dataclass(frozen=True)
class LoadOptions:
    """How a model is loaded: context, threads, KV cache."""

    n_ctx: int | None = None  # None: min(model's trained context, 4096)
    n_threads: int | None = None  # None: all cores
    n_batch: int = 512
    kv_type: str = "f16"  # type of both K and V caches
    flash_attn: bool | None = None  # None: on when the V cache is quantized (llama.cpp needs it there)

    def validate(self) -> LoadOptions:
        if self.n_ctx is not None and self.n_ctx < 16:
            raise InvalidOptionError(f"context size must be at least 16, got {self.n_ctx}")
        if self.n_threads is not None and self.n_threads < 1:
            raise InvalidOptionError(f"threads must be at least 1, got {self.n_threads}")
        if self.n_batch < 1:
            raise InvalidOptionError(f"batch size must be at least 1, got {self.n_batch}")
        if self.kv_type not in KV_TYPES:
            raise InvalidOptionError(f"unknown KV-cache type {self.kv_type!r}: choose one of {', '.join(KV_TYPES)}")
        return self

    @property
    def threads(self) -> int:
        return self.n_threads or os.cpu_count() or 1


@dataclass(frozen=True)
class SamplingOptions:
    """Sampling through llama.cpp's sampler chain. temperature 0 means greedy."""

    temperature: float = 0.7
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None  # None: a random seed per request

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self) -> SamplingOptions:
        def bad(msg: str) -> InvalidOptionError:
            return InvalidOptionError(f"invalid sampling option: {msg}")

        for name in ("temperature", "top_p", "min_p", "repeat_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or math.isnan(v) or math.isinf(v):
                raise bad(f"{name} must be a finite number, got {v!r}")
        if self.temperature < 0:
            raise bad(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise bad(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise bad(f"min_p must be in [0, 1), got {self.min_p}")
        if self.repeat_penalty <= 0:
            raise bad(f"repeat_penalty must be > 0, got {self.repeat_penalty}")
        if self.repeat_last_n < 0:
            raise bad(f"repeat_last_n must be >= 0, got {self.repeat_last_n}")
        if self.seed is not None and not 0 <= self.seed < 2**32:
            raise bad(f"seed must be in [0, 2**32), got {self.seed}")
        return self


@dataclass(frozen=True)
class SpeculationOptions:
    """Speculative decoding. Output is the same as without it (lossless); only speed changes.

    method: off | lookup (n-grams from prompt + output) | draft (a smaller model, `draft_model`)
            | self (a quantized copy of the target, `self_quant`) | auto (pick what pays)
    """

    method: str = "off"
    draft_model: str | None = None  # store ref or path, for method="draft"
    self_quant: str = "Q3_K_M"  # quant type of the self-draft copy, for method="self"
    draft_max: int = 32
    draft_min: int = 0
    p_min: float = 0.5  # draft model: stop drafting when its top token's probability falls below this
    adaptive: bool = True

    def validate(self) -> SpeculationOptions:
        if self.method not in SPECULATION_METHODS:
            raise InvalidOptionError(
                f"unknown speculation method {self.method!r}: choose one of {', '.join(SPECULATION_METHODS)}"
            )
        if self.method == "draft" and not self.draft_model:
            raise InvalidOptionError("speculation method 'draft' needs a draft model (draft=MODEL)")
        if not 1 <= self.draft_max <= 64:
            raise InvalidOptionError(f"draft_max must be in [1, 64], got {self.draft_max}")
        if not 0 <= self.draft_min <= self.draft_max:
            raise InvalidOptionError(f"draft_min must be in [0, draft_max], got {self.draft_min}")
        if not 0.0 <= self.p_min < 1.0:
            raise InvalidOptionError(f"p_min must be in [0, 1), got {self.p_min}")
        return self

    @classmethod
    def parse(cls, spec: str, **overrides: object) -> SpeculationOptions:
        """Parse the CLI form: off | lookup | auto | draft=MODEL | self=Q3_K_M."""
        spec = spec.strip()
        method, _, arg = spec.partition("=")
        kw: dict[str, object] = {"method": method}
        if method == "draft":
            kw["draft_model"] = arg or None
        elif method == "self":
            if arg:
                kw["self_quant"] = arg.upper()
        elif arg:
            raise InvalidOptionError(f"speculation method {method!r} takes no argument (got {spec!r})")
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw).validate()  # type: ignore[arg-type]


@dataclass(frozen=True)
class GenerateOptions:
    """One request: how many tokens, when to stop, how to sample, whether to speculate."""

    max_tokens: int = 512
    stop: tuple[str, ...] = ()
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    speculation: SpeculationOptions = field(default_factory=SpeculationOptions)

    def validate(self) -> GenerateOptions:
        if self.max_tokens < 1:
            raise InvalidOptionError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise InvalidOptionError("stop strings must not be empty")
        self.sampling.validate()
        self.speculation.validate()
        return self

    def with_sampling(self, **changes: object) -> GenerateOptions:
        return replace(self, sampling=replace(self.sampling, **changes))  # type: ignore[arg-type]
