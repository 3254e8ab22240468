"""What `tune` searches: a setup (weight quant, K and V cache types, flash attention, threads,
speculation and its knobs), and the registry of speculation methods that proposes them.

A setup is everything `run` needs besides the prompt. Its *load key* (quant, cache types, flash
attention, threads) is what a model load fixes; the speculation is per request, so every
speculation of one load key is measured on one loaded engine. Its *quality key* (quant, cache
types) is what changes the output distribution: speculation is lossless and threads change only
speed, so the KLD of a setup is the KLD of its quality key (flash attention and thread count
change llama.cpp's rounding in the last bits, not the distribution; `tune` does not count it).

Speculation methods are a registry: a method is one `SpeculationMethod` entry whose `variants`
proposes the speculation specs worth trying for a rung (a method that needs nothing proposes its
name; a draft model proposes one spec per compatible store model). A method another part of the
program adds to `SPECULATION_METHODS` (engine/core/options.py) is one more `register_method` call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..engine.core.options import SPECULATION_METHODS, LoadOptions, SpeculationOptions
from ..errors import EdgeInferError, InvalidOptionError
from ..kv_types import KV_CACHE_TYPES

if TYPE_CHECKING:
    from ..gguf_file import GGUFInfo
    from ..store import ModelManifest, Store

__all__ = ["Setup", "SpeculationMethod", "SpaceContext", "METHODS", "register_method", "method_names",
           "KV_PAIRS", "untuned_setup"]

# K/V cache pairs searched by default: llama.cpp's f16, and the two quantized caches its CPU path is
# quickest with (benchmarks/RESULTS.md "KV-cache types": q8_0 halves the cache, q4_0 quarters it).
KV_PAIRS: tuple[tuple[str, str], ...] = (("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"))


@dataclass(frozen=True)
class Setup:
    """One way to run a model. None leaves a field to the runtime (flash attention: llama.cpp's
    choice; threads: the free cores, edgeinfer.cpu; draft_max: the library's default)."""

    model: str  # store ref of the rung that runs
    kv_type_k: str = "f16"
    kv_type_v: str = "f16"
    flash_attn: bool | None = None
    threads: int | None = None
    speculate: str = "off"  # the CLI form: off | lookup | auto | draft=MODEL | self=Q3_K_M | ...
    draft_max: int | None = None

    @property
    def load_key(self) -> tuple[str, str, str, bool | None, int | None]:
        return (self.model, self.kv_type_k, self.kv_type_v, self.flash_attn, self.threads)

    @property
    def quality_key(self) -> tuple[str, str, str]:
        return (self.model, self.kv_type_k, self.kv_type_v)

    @property
    def key(self) -> str:
        """A stable text key (the measurement journal's)."""
        fa = {None: "auto", True: "on", False: "off"}[self.flash_attn]
        return (f"{self.model}|{self.kv_type_k}/{self.kv_type_v}|fa={fa}|t={self.threads or 'auto'}|"
                f"{self.speculate}|dmax={self.draft_max or '-'}")

    def label(self, short_model: bool = True) -> str:
        """In words, as tables show it: 'q4_k_m kv q8_0 fa off 1t lookup'."""
        model = self.model.partition(":")[2] if short_model and ":" in self.model else self.model
        kv = self.kv_type_k if self.kv_type_k == self.kv_type_v else f"{self.kv_type_k}/{self.kv_type_v}"
        parts = [model, f"kv {kv}"]
        if self.flash_attn is not None:
            parts.append(f"fa {'on' if self.flash_attn else 'off'}")
        parts.append(f"{self.threads}t" if self.threads else "auto-t")
        parts.append(self.speculate + (f"/{self.draft_max}" if self.draft_max else ""))
        return " ".join(parts)

    def load_options(self, n_ctx: int | None = None, base: LoadOptions | None = None) -> LoadOptions:
        return replace(base or LoadOptions(), n_ctx=n_ctx, n_threads=self.threads, kv_type=self.kv_type_k,
                       kv_type_k=self.kv_type_k, kv_type_v=self.kv_type_v, flash_attn=self.flash_attn)

    def speculation(self) -> SpeculationOptions:
        return SpeculationOptions.parse(self.speculate, draft_max=self.draft_max)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> Setup:
        """From JSON (a stored profile or journal); ValueError naming the field when it does not fit."""
        if not isinstance(data, dict):
            raise ValueError("a setup must be an object")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown setup field(s) {sorted(unknown)}")
        if not isinstance(data.get("model"), str):
            raise ValueError("setup field 'model' must be a string")
        for name in ("kv_type_k", "kv_type_v"):
            if data.get(name, "f16") not in KV_CACHE_TYPES:
                raise ValueError(f"setup field {name!r} is not a KV-cache type: {data.get(name)!r}")
        if data.get("flash_attn") not in (None, True, False):
            raise ValueError("setup field 'flash_attn' must be true, false or null")
        for name in ("threads", "draft_max"):
            v = data.get(name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1024):
                raise ValueError(f"setup field {name!r} must be a positive integer or null, got {v!r}")
        if not isinstance(data.get("speculate", "off"), str):
            raise ValueError("setup field 'speculate' must be a string")
        setup = cls(**data)
        try:
            setup.speculation()
            setup.load_options().validate()
        except InvalidOptionError as e:
            raise ValueError(str(e)) from None
        return setup


def untuned_setup(model: str) -> Setup:
    """What `run MODEL` does without a profile: the library's defaults (LoadOptions, SpeculationOptions)."""
    load, spec = LoadOptions(), SpeculationOptions()
    k, v = load.kv_types
    return Setup(model=model, kv_type_k=k, kv_type_v=v, flash_attn=load.flash_attn, threads=load.n_threads,
                 speculate=spec.method)


@dataclass
class SpaceContext:
    """What a method needs to propose its specs: the rung it would run on, the ladder (every rung of
    the model's name, with their GGUF facts) and the store's other models."""

    rung: ModelManifest
    ladder: Sequence[ModelManifest]
    store: Store
    infos: dict[str, GGUFInfo] = field(default_factory=dict)  # ref -> GGUF facts (read on demand)

    def info(self, m: ModelManifest) -> GGUFInfo:
        if m.ref not in self.infos:
            from ..gguf_file import read_gguf

            self.infos[m.ref] = read_gguf(m.path)
        return self.infos[m.ref]


@dataclass(frozen=True)
class SpeculationMethod:
    """One speculation method of the search: `variants(ctx)` gives the (spec, draft_max) pairs worth
    measuring on `ctx.rung`; `fresh` says whether its measurement must start from empty caches (a
    drafter with a cache of its own: its prompt must be read again as a new request would)."""

    name: str
    variants: Callable[[SpaceContext], list[tuple[str, int | None]]]
    fresh: bool = False


METHODS: dict[str, SpeculationMethod] = {}


def register_method(method: SpeculationMethod) -> None:
    """Add (or replace) a method of the search; only methods the engine knows are registered."""
    if method.name not in SPECULATION_METHODS:
        raise InvalidOptionError(f"{method.name!r} is not a speculation method of this engine "
                                 f"({', '.join(SPECULATION_METHODS)})")
    METHODS[method.name] = method


def method_names() -> tuple[str, ...]:
    return tuple(METHODS)


def _vocab_signature(info: GGUFInfo) -> tuple[Any, ...]:
    """A cheap guess at "tokenizes the same": the tokenizer model, pre-tokenizer, size and EOS (the
    engine checks the vocabulary token by token when the draft model is opened)."""
    tokens = info.metadata.get("tokenizer.ggml.tokens")
    size = getattr(tokens, "length", None) or (len(tokens) if isinstance(tokens, list) else None)
    return (info.metadata.get("tokenizer.ggml.model"), info.metadata.get("tokenizer.ggml.pre"), size,
            info.metadata.get("tokenizer.ggml.eos_token_id"))


def _draft_models(ctx: SpaceContext) -> list[tuple[str, int | None]]:
    """One draft model per other store name of the same vocabulary and fewer parameters: its
    smallest file (a draft's cost is its speed)."""
    mine = _vocab_signature(ctx.info(ctx.rung))
    best: dict[str, ModelManifest] = {}
    for m in ctx.store.list():
        if m.name == ctx.rung.name or m.parameters >= ctx.rung.parameters or not Path(m.file).exists():
            continue
        if m.architecture in ("eagle3",) or m.name in best and best[m.name].size <= m.size:
            continue
        try:
            if _vocab_signature(ctx.info(m)) != mine:
                continue
        except (OSError, EdgeInferError):  # an unreadable file is no candidate
            continue
        best[m.name] = m
    return [(f"draft={m.ref}", None) for m in sorted(best.values(), key=lambda m: m.size)]


def _self_drafts(ctx: SpaceContext) -> list[tuple[str, int | None]]:
    """The smallest rung below this one whose tag is its quant type (what `self=QUANT` finds)."""
    lower = [m for m in ctx.ladder if m.quant and m.tag == m.quant.lower() and m.size < ctx.rung.size * 0.8]
    if not lower:
        return []
    smallest = min(lower, key=lambda m: m.size)
    return [(f"self={smallest.quant}", None)]


def _heads(kind: str) -> Callable[[SpaceContext], list[tuple[str, int | None]]]:
    def variants(ctx: SpaceContext) -> list[tuple[str, int | None]]:
        if kind == "mtp":
            from ..engine.speculation.head_models import mtp_layers

            return [("mtp", None)] if mtp_layers(ctx.info(ctx.rung)) == 1 else []
        return [(f"eagle3={m.ref}", None) for m in ctx.store.list() if m.architecture == "eagle3"]

    return variants


register_method(SpeculationMethod("off", lambda ctx: [("off", None)]))
# lookup at the library's draft_max (the policy sizes each draft) and with drafts capped short
register_method(SpeculationMethod("lookup", lambda ctx: [("lookup", None), ("lookup", 6)]))
register_method(SpeculationMethod("auto", lambda ctx: [("auto", None)]))
register_method(SpeculationMethod("draft", _draft_models, fresh=True))
register_method(SpeculationMethod("self", _self_drafts, fresh=True))
register_method(SpeculationMethod("mtp", _heads("mtp"), fresh=True))
register_method(SpeculationMethod("eagle3", _heads("eagle3"), fresh=True))
# suffix remembers answers: each measured run drafts from a fresh memory scope of its own
# (measure.py), so no run drafts from another's answers to the same prompts. A new method: one line.
register_method(SpeculationMethod("suffix", lambda ctx: [("suffix", None)]))
