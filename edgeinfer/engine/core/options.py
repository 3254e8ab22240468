"""Options for loading a model and for one generation request, grouped in small dataclasses.

The dataclass defaults are the one source of every default; front ends read them from
DEFAULT_LOAD, DEFAULT_SAMPLING, DEFAULT_SPECULATION and DEFAULT_GENERATE rather than repeating
numbers. `validate()` refuses wrong types and values outside what the C side can hold with one
InvalidOptionError line.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from ...errors import InvalidOptionError
from ..structured.grammar import Grammar
from ...cpu import usable_cores
from ...llama_backend import env_threads, max_threads, threads_out_of_range
from ...kv_types import KV_TYPE_NAMES, flash_attn_for, kv_cache_type

__all__ = [
    "HEAD_METHODS",
    "KVType",
    "LoadOptions",
    "SamplingOptions",
    "SpeculationOptions",
    "GenerateOptions",
    "BatchOptions",
    "KV_TYPES",
    "SPECULATION_METHODS",
    "DEFAULT_LOAD",
    "DEFAULT_SAMPLING",
    "DEFAULT_SPECULATION",
    "DEFAULT_GENERATE",
]

KVType = Literal["f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl"]
KV_TYPES: tuple[str, ...] = KV_TYPE_NAMES  # edgeinfer.kv_types: the one list
SPECULATION_METHODS: tuple[str, ...] = ("off", "lookup", "suffix", "draft", "self", "auto", "mtp", "eagle3", "medusa")
HEAD_METHODS: tuple[str, ...] = ("mtp", "eagle3", "medusa")  # drafters that read the target's hidden states

_INT32_MAX = 2**31 - 1  # llama.cpp takes counts and sizes as int32/uint32: larger ones would wrap


def _int(owner: str, name: str, value: object, lo: int, hi: int = _INT32_MAX) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidOptionError(f"{owner}{name} must be an integer, got {type(value).__name__} {value!r}")
    if not lo <= value <= hi:
        raise InvalidOptionError(f"{owner}{name} must be in [{lo}, {hi}], got {value}")


def _number(owner: str, name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value) or math.isinf(value):
        raise InvalidOptionError(f"{owner}{name} must be a finite number, got {value!r}")


def _instance(owner: str, name: str, value: object, kind: type | tuple[type, ...], what: str) -> None:
    if not isinstance(value, kind):
        raise InvalidOptionError(f"{owner}{name} must be {what}, got {type(value).__name__} {value!r}")


@dataclass(frozen=True)
class LoadOptions:
    """How a model is loaded: context, threads, KV cache, and where its layers run."""

    n_ctx: int | None = None  # None: min(model's trained context, 4096)
    n_threads: int | None = None  # None: EDGEINFER_THREADS, else the cores others leave free (edgeinfer.cpu)
    n_batch: int = 512
    kv_type: str = "f16"  # type of both K and V caches (edgeinfer.kv_types.KV_TYPE_NAMES)
    # None: either face takes the store's measured verdict (engine/llama/flash_choice.py), else llama.cpp's
    # choice (on for the CPU); on whenever the V cache is quantized (llama.cpp needs it there)
    flash_attn: bool | None = None
    kv_type_k: str | None = None  # K cache type; None: kv_type
    kv_type_v: str | None = None  # V cache type; None: kv_type
    # Placement (edgeinfer.devices): layers on GPUs and RPC workers, N | "all" | "auto" (as many as
    # the devices' reported memory holds; 0 where the build has no device).
    n_gpu_layers: int | str = "auto"
    rpc: tuple[str, ...] = ()  # llama.cpp RPC workers, "host:port" (`edgeinfer rpc-worker`)
    # Shares of the layers: the host first, then each device (workers in `rpc` order, then local
    # GPUs); () = as many on the devices as n_gpu_layers says, split by their free memory.
    tensor_split: tuple[float, ...] = ()
    draft_gpu_layers: int | str | None = None  # a draft model's n_gpu_layers; None: the same as the target's
    # The suffix drafter's memory of earlier answers kept on disk (token ids per model file and
    # scope, speculation/suffix_file.py): "store" ($EDGEINFER_HOME/cache/suffix), a folder, or
    # None / "off": in memory only, gone when the model unloads.
    suffix_memory: str | os.PathLike[str] | None = None

    def draft_options(self, n_ctx: int | None = None) -> LoadOptions:
        """The LoadOptions of a draft model (draft=, self=, auto=) loaded beside this target: its
        threads and batch, and the target's placement unless draft_gpu_layers says otherwise."""
        gpu = self.n_gpu_layers if self.draft_gpu_layers is None else self.draft_gpu_layers
        split = self.tensor_split if self.draft_gpu_layers is None else ()
        return LoadOptions(n_ctx=n_ctx, n_threads=self.n_threads, n_batch=self.n_batch, n_gpu_layers=gpu,
                           rpc=self.rpc, tensor_split=split)

    def placement_fields(self, ll: Any, path: str | os.PathLike[str]) -> dict[str, Any]:
        """The llama_model_params fields that place a load of `path` (n_gpu_layers, devices,
        tensor_split; edgeinfer.fit.load_placement: probes RPC workers and refuses what a device
        cannot hold, before any weight moves)."""
        from ...fit import load_placement

        return load_placement(ll, path, self)

    def _suffix_keyword(self) -> str | None:
        """The keyword `suffix_memory` names ("store", or "off", which None means too); None: a folder."""
        setting = self.suffix_memory
        if setting is None:
            return "off"
        word = setting.strip().lower() if isinstance(setting, str) else None
        return word if word in ("store", "off") else None

    def suffix_folder(self, store_root: str | os.PathLike[str]) -> Path | None:
        """Where the suffix memory is kept (`suffix_memory`), given the store's root; None: not kept."""
        keyword = self._suffix_keyword()
        if keyword == "off":
            return None
        if keyword == "store":
            return Path(store_root) / "cache" / "suffix"
        return Path(self.suffix_memory).expanduser()  # type: ignore[arg-type]

    @property
    def kv_types(self) -> tuple[str, str]:
        """The (K, V) cache types in effect."""
        return (self.kv_type_k or self.kv_type).lower(), (self.kv_type_v or self.kv_type).lower()

    def validate(self) -> LoadOptions:
        if self.n_ctx is not None:
            _int("", "context size", self.n_ctx, -_INT32_MAX)
        if self.n_ctx is not None and self.n_ctx < 16:
            raise InvalidOptionError(f"context size must be at least 16, got {self.n_ctx}")
        if self.n_threads is not None:
            _int("", "threads", self.n_threads, -_INT32_MAX)
            if not 1 <= self.n_threads <= max_threads():
                raise threads_out_of_range("threads must be", self.n_threads)
        env_threads()  # a bad EDGEINFER_THREADS fails here, before anything loads
        _int("", "batch size", self.n_batch, 1)
        _instance("", "kv_type", self.kv_type, str, "a string")
        _instance("", "flash_attn", self.flash_attn, (bool, type(None)), "True, False or None")
        for name in ("kv_type_k", "kv_type_v"):
            if getattr(self, name) is not None:
                _instance("", name, getattr(self, name), str, "a string or None")
        kv_cache_type(self.kv_type)
        flash_attn_for(*self.kv_types, self.flash_attn)  # unknown types; quantized V with flash attention off
        _instance("", "suffix_memory", self.suffix_memory, (str, os.PathLike, type(None)),
                  "'store', 'off', a folder or None")
        if isinstance(self.suffix_memory, str) and not self.suffix_memory.strip():
            raise InvalidOptionError("suffix_memory must be 'store', 'off' or a folder, got an empty string")
        if self._suffix_keyword() is None:  # a folder: it may be missing (made at the first save), not be a file
            folder = Path(self.suffix_memory).expanduser()  # type: ignore[arg-type]
            if folder.exists() and not folder.is_dir():
                raise InvalidOptionError(f"suffix_memory: {folder} is not a folder")
        from ...devices import check_placement

        check_placement(self.n_gpu_layers, self.rpc, self.tensor_split, self.draft_gpu_layers)
        return self

    @property
    def pinned_threads(self) -> int | None:
        """n_threads, else EDGEINFER_THREADS; None leaves the count to the free cores (edgeinfer.cpu)."""
        return self.n_threads or env_threads()

    @property
    def threads(self) -> int:
        """The pinned thread count, or the cores this process may use (the most it gets unpinned)."""
        return self.pinned_threads or usable_cores()


@dataclass(frozen=True)
class SamplingOptions:
    """Sampling through llama.cpp's sampler chain. temperature 0 means greedy.

    The chain, in llama.cpp's order: the request's grammar (GenerateOptions.grammar/json_schema),
    penalties, top-k, top-p, min-p, temperature, then a draw from what is left.

    Penalties (llama.cpp's penalties sampler) apply to the tokens *generated* by this request among
    its last `repeat_last_n`, never to the prompt's (llama-cpp-python's convention and OpenAI's, whose
    counts are of sampled tokens; llama-server also counts the prompt, so a chat's role markers and
    every word of the question would be penalized). For a token seen c > 0 times in that window the
    logit l becomes l / repeat_penalty (l > 0) or l * repeat_penalty (l <= 0), minus
    c * frequency_penalty + presence_penalty. repeat_last_n 0 turns all three off.

    seed: any 64-bit integer (OpenAI's range, negative too); None draws a random one per request.
    The seed is mixed into llama.cpp's 32-bit seed by a hash (`sampler.llama_seed`), never
    wrapped mod 2**32 and never llama.cpp's "random" value 0xFFFFFFFF: the same seed gives the same
    output on the same model, settings and engine shape.
    """

    temperature: float = 0.7
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # None: a random seed per request

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        """Whether any penalty is in effect (then the distribution depends on the tokens generated)."""
        return self.repeat_last_n > 0 and (
            self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0)

    def validate(self) -> SamplingOptions:
        def bad(msg: str) -> InvalidOptionError:
            return InvalidOptionError(f"invalid sampling option: {msg}")

        for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
            _number("invalid sampling option: ", name, getattr(self, name))
        _int("invalid sampling option: ", "top_k", self.top_k, -_INT32_MAX)
        _int("invalid sampling option: ", "repeat_last_n", self.repeat_last_n, -_INT32_MAX)
        if self.seed is not None:
            _int("invalid sampling option: ", "seed", self.seed, -(2**63), 2**63 - 1)
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
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repeat_last_n < 0:
            raise bad(f"repeat_last_n must be >= 0, got {self.repeat_last_n}")
        return self


@dataclass(frozen=True)
class SpeculationOptions:
    """Speculative decoding. Output is the same as without it (lossless); only speed changes.

    method: off | lookup (n-grams from prompt + output)
            | suffix (continuations of earlier answers and of prompt + output, scored by frequency:
              speculation/suffix.py) | draft (a smaller model, `draft_model`)
            | self (a quantized copy of the target, `self_quant`) | auto (pick what pays)
            | mtp (the model's own multi-token-prediction layer, e.g. Qwen3.5's)
            | eagle3 (an EAGLE-3 drafter for this model, `draft_model`)
            | medusa (Medusa heads for this model, a file converted from FasterDecoding/Medusa's
              layout, `draft_model`)
    """

    method: str = "off"
    draft_model: str | None = None  # store ref or path, for "draft", "eagle3" and "medusa" (auto: optional)
    self_quant: str = "Q3_K_M"  # quant type of the self-draft copy, for method="self"
    draft_max: int = 32
    draft_min: int = 0
    p_min: float = 0.5  # draft model: stop drafting when its top token's probability falls below this
    adaptive: bool = True
    # Whose earlier answers `suffix` and `auto` may draft from: requests of one scope share a loaded
    # model's memory of answers, no other scope sees it (a server sets one per API key).
    memory_scope: str = ""

    def validate(self) -> SpeculationOptions:
        _instance("speculation ", "method", self.method, str, "a string")
        _instance("speculation ", "draft_model", self.draft_model, (str, os.PathLike, type(None)), "a model name or path")
        _instance("speculation ", "self_quant", self.self_quant, str, "a quant type name")
        _int("", "draft_max", self.draft_max, -_INT32_MAX)
        _int("", "draft_min", self.draft_min, -_INT32_MAX)
        _number("", "p_min", self.p_min)
        _instance("speculation ", "adaptive", self.adaptive, bool, "True or False")
        _instance("speculation ", "memory_scope", self.memory_scope, str, "a string")
        if len(self.memory_scope) > 256:
            raise InvalidOptionError(f"memory_scope is at most 256 characters, got {len(self.memory_scope)}")
        if self.method not in SPECULATION_METHODS:
            raise InvalidOptionError(
                f"unknown speculation method {self.method!r}: choose one of {', '.join(SPECULATION_METHODS)}"
            )
        if self.method in ("draft", "eagle3", "medusa") and not self.draft_model:
            what = {"draft": "a draft model", "eagle3": "an EAGLE-3 drafter model",
                    "medusa": "a file of Medusa heads"}[self.method]
            raise InvalidOptionError(f"speculation method {self.method!r} needs {what} ({self.method}=MODEL)")
        if not 1 <= self.draft_max <= 64:
            raise InvalidOptionError(f"draft_max must be in [1, 64], got {self.draft_max}")
        if not 0 <= self.draft_min <= self.draft_max:
            raise InvalidOptionError(f"draft_min must be in [0, draft_max], got {self.draft_min}")
        if not 0.0 <= self.p_min < 1.0:
            raise InvalidOptionError(f"p_min must be in [0, 1), got {self.p_min}")
        return self

    @classmethod
    def parse(cls, spec: str, **overrides: object) -> SpeculationOptions:
        """Parse the CLI form: off | lookup | suffix | auto | auto=MODEL | draft=MODEL | self=Q3_K_M | mtp
        | eagle3=MODEL | medusa=HEADS (auto=MODEL: auto may also draft with MODEL where it pays)."""
        _instance("", "speculation", spec, str, "a string like 'lookup' or 'self=Q4_K_M'")
        spec = spec.strip()
        method, _, arg = spec.partition("=")
        kw: dict[str, object] = {"method": method}
        if method in ("draft", "eagle3", "medusa") or (method == "auto" and arg):
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
    """One request: how many tokens, when to stop, how to sample, whether to speculate.

    grammar (a Grammar, or GBNF text) or json_schema (a mapping or JSON text; at most one of the
    two) constrains the output (engine/structured/grammar.py); `resolved_grammar()` is the Grammar in effect.
    """

    max_tokens: int = 512
    stop: tuple[str, ...] = ()
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    speculation: SpeculationOptions = field(default_factory=SpeculationOptions)
    grammar: Grammar | str | None = None
    json_schema: Mapping[str, Any] | str | None = field(default=None, hash=False)

    def resolved_grammar(self) -> Grammar | None:
        """The Grammar that constrains this request: `grammar` (GBNF text becomes Grammar(text)), the
        compilation of `json_schema`, or None."""
        if self.grammar is not None and self.json_schema is not None:
            raise InvalidOptionError("give either grammar or json_schema, not both")
        if isinstance(self.grammar, str):
            return Grammar(self.grammar)
        if self.grammar is not None:
            _instance("", "grammar", self.grammar, Grammar, "a Grammar or GBNF text")
            return self.grammar
        if self.json_schema is not None:
            return Grammar.from_json_schema(self.json_schema)
        return None

    def validate(self) -> GenerateOptions:
        _int("", "max_tokens", self.max_tokens, -_INT32_MAX)
        if self.max_tokens < 1:
            raise InvalidOptionError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if isinstance(self.stop, str) or not isinstance(self.stop, (tuple, list)):
            raise InvalidOptionError(f"stop must be a tuple of strings, got {type(self.stop).__name__} {self.stop!r}")
        if any(not isinstance(s, str) for s in self.stop):
            raise InvalidOptionError("stop strings must be strings")
        if any(not s for s in self.stop):
            raise InvalidOptionError("stop strings must not be empty")
        _instance("", "sampling", self.sampling, SamplingOptions, "SamplingOptions")
        _instance("", "speculation", self.speculation, SpeculationOptions,
                  "SpeculationOptions (SpeculationOptions.parse('lookup') reads the CLI form)")
        self.sampling.validate()
        self.speculation.validate()
        _instance("", "json_schema", self.json_schema, (Mapping, str, type(None)), "a mapping, JSON text or None")
        grammar = self.resolved_grammar()
        if grammar is not None:
            grammar.validate()
        return self

    def with_sampling(self, **changes: object) -> GenerateOptions:
        try:
            return replace(self, sampling=replace(self.sampling, **changes))  # type: ignore[arg-type]
        except TypeError as e:  # an unknown field name
            raise InvalidOptionError(f"invalid sampling option: {e}") from None


IDLE_CALIBRATION_ENV = "EDGEINFER_IDLE_CALIBRATION"


def idle_calibration_default() -> bool:
    """BatchOptions.calibrate_when_idle's default: on, unless $EDGEINFER_IDLE_CALIBRATION is 0
    (the test suite's servers and engines set it: speculation/calibration.py is the calibration)."""
    return os.environ.get(IDLE_CALIBRATION_ENV, "1").strip() != "0"


@dataclass(frozen=True)
class BatchOptions:
    """How a BatchEngine schedules: slots, per-request buffering, drafting."""

    parallel: int = 4  # slots = sequences decoded together; the context is split between them
    # One KV cache for every slot (llama-server's -kvu): any mix of rows decodes as one ubatch, but
    # each row attends over every slot's cells. False: a stream per slot, as llama-server's -np N
    # (engine/llama/runtime.py says what each costs). A model with MTP layers keeps one cache.
    kv_unified: bool = False
    max_backlog: int = 256  # unread events after which a request pauses (a slow reader)
    # Most prompt rows a step takes while other requests decode; None: the cost curve's knee (see
    # engine/core/scheduler.py). Nothing decoding: waiting prompts fill the whole ubatch either way.
    prefill_chunk: int | None = None
    # While prompts are read, the longest a request already decoding waits for its next token, in
    # seconds (0: it takes every step). Each step it takes costs a ubatch of its own beside the
    # prompt chunk (a KV stream per slot) and staggers when the streams end; scheduler.py says why 10,
    # and why prompts submitted before a request's first token may hold it longer (0: never).
    decode_wait: float = 10.0
    draft_max: int = 16  # most drafted rows per slot and step
    margin: float = 0.03  # drafting must beat not drafting by this fraction
    # Seconds of one decode by rows, e.g. `cost_curve()` of an earlier engine on this machine;
    # None: the store's measurement (or the size prior), refined while idle and from every step.
    cost_curve: Mapping[int, float] | None = None
    # Measure the cost curve while no request runs (default: yes, unless $EDGEINFER_IDLE_CALIBRATION=0).
    calibrate_when_idle: bool = field(default_factory=idle_calibration_default)

    def validate(self) -> BatchOptions:
        _int("", "parallel", self.parallel, 1, 64)
        _instance("", "kv_unified", self.kv_unified, bool, "True or False")
        _int("", "max_backlog", self.max_backlog, 1)
        if self.prefill_chunk is not None:
            _int("", "prefill_chunk", self.prefill_chunk, 1)
        _number("", "decode_wait", self.decode_wait)
        if not 0 <= self.decode_wait <= 3600:
            raise InvalidOptionError(f"decode_wait must be seconds in [0, 3600], got {self.decode_wait!r}")
        _int("", "draft_max", self.draft_max, 0, 64)
        _number("", "margin", self.margin)
        if not 0 <= self.margin <= 1:
            raise InvalidOptionError(f"margin must be a fraction in [0, 1], got {self.margin!r}")
        _instance("", "calibrate_when_idle", self.calibrate_when_idle, bool, "True or False")
        if self.cost_curve is not None:
            _instance("", "cost_curve", self.cost_curve, Mapping, "seconds by row count (a mapping) or None")
            for rows, seconds in self.cost_curve.items():
                _int("cost_curve ", "rows", rows, 1)
                _number("cost_curve ", "seconds", seconds)
            if 1 not in self.cost_curve or any(not t > 0 for t in self.cost_curve.values()):
                raise InvalidOptionError("cost_curve needs positive seconds by row count, including 1 row")
        return self


# The defaults, for front ends to show and to use (one source: the dataclass fields above).
DEFAULT_LOAD = LoadOptions()
DEFAULT_SAMPLING = SamplingOptions()
DEFAULT_SPECULATION = SpeculationOptions()
DEFAULT_GENERATE = GenerateOptions()
