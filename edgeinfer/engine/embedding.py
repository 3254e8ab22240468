"""Embeddings: one vector per text from a loaded model, pooled by llama.cpp.

An `Embedder` opens its own llama.cpp context (`embeddings=True`) on the model a `LlamaRuntime`
already holds: a second context on the same `llama_model*` shares the weights and costs only its
KV cache and compute buffers. Several inputs go into each `llama_decode`, one sequence each, in one
unified KV cache (as llama-cpp-python's `Llama.embed`); `llama_get_embeddings_seq` reads each
sequence's pooled vector.

The rules, in order:

- **Input**: a text is tokenized as llama-cpp-python's `embed` does (the vocabulary's BOS/EOS
  added, special-token text not parsed); a list of token ids is used as it is. An input longer than
  the context is an error, or with `truncate=True` cut to the context (a text keeps its trailing EOS
  where the vocabulary adds one, since last-token pooling reads it).
- **Prompt**: `prompt_name` prepends one of the prompts the model declares (converted from
  `config_sentence_transformers.json`: Qwen3-Embedding's "query" is its instruction format
  `Instruct: ...\\nQuery:`); `prompt` prepends a literal one; without either, the model's
  default prompt (if it declares one) is used. Prompts apply to texts only.
- **Pooling**: the GGUF's `<arch>.pooling_type` (mean, cls, last), unless `pooling` says otherwise.
  A model that declares none (a generative model) needs `pooling`; `rank` (a reranker) is refused.
- **Dimensions**: `dimensions` keeps the first N values of the pooled vector, where the model
  declares Matryoshka training (`edgeinfer.embedding.min_dimensions`, written by the converter
  from the model card); elsewhere only the full size is accepted.
- **Normalization** (after truncation, so a shortened vector is unit length too): L2 when
  `normalize` is True. Its default is the model's: `edgeinfer.embedding.normalize` when the GGUF
  says (the converter writes it from `modules.json`: a sentence-transformers Normalize module),
  else L2 for a model that declares a pooling type (an embedding model: llama.cpp's tools and the
  cards of such models normalize) and raw pooled values for a model that declares none.

The context starts at `min(max_tokens, 512)` tokens (llama.cpp's default physical batch) and
grows, doubling, to fit the longest input of a call, up to `max_tokens`: llama.cpp computes the
output layer for every token of an embedding batch, so its buffers grow with the vocabulary times
the batch (about 2 × 4 × n_vocab bytes per token), and short texts should not pay for long ones.

Thread safety: `embed` may be called from any thread; calls are serialized by a lock (one
context). Close the Embedder before the runtime whose model it uses.
"""

from __future__ import annotations

import ctypes
import json
import logging
import operator
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..cancel import CancelToken, raise_if_cancelled
from ..embedding_meta import (
    DEFAULT_PROMPT_KEY,
    MIN_DIMENSIONS_KEY,
    NORMALIZE_KEY,
    POOLING_CODES,
    POOLING_NAMES,
    POOLING_TYPES,
    PROMPTS_KEY,
    pooling_key,
)
from ..errors import (
    ContextLengthError,
    EngineClosedError,
    InvalidModelError,
    InvalidOptionError,
)
from ..llama_backend import backend
from .llama.context import DecodeRows, LlamaContext, context_params

if TYPE_CHECKING:
    from .llama.runtime import LlamaRuntime

__all__ = ["EmbedOptions", "EmbeddingResult", "Embedder", "POOLING_TYPES", "DEFAULT_EMBED_CTX"]

log = logging.getLogger(__name__)

DEFAULT_EMBED_CTX = 512  # the first context size (llama.cpp's default physical batch, llama-server's limit)
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class EmbedOptions:
    """How inputs become vectors (see the module's rules); `validate()` checks types and ranges."""

    pooling: str | None = None  # mean | cls | last; None: what the model declares
    normalize: bool | None = None  # None: the model's rule (L2 for embedding models)
    dimensions: int | None = None  # keep the first N values (Matryoshka models); None: all
    truncate: bool = False  # cut inputs longer than the context instead of refusing them
    prompt_name: str | None = None  # a prompt the model declares, e.g. "query"
    prompt: str | None = None  # a literal prefix for every text (not with prompt_name)

    def validate(self) -> EmbedOptions:
        if self.pooling is not None:
            if not isinstance(self.pooling, str):
                raise InvalidOptionError(f"pooling must be a string, got {type(self.pooling).__name__} {self.pooling!r}")
            name = self.pooling.lower()
            if name == "none":
                raise InvalidOptionError("pooling 'none' gives one vector per token, not an embedding: choose mean, cls or last")
            if name == "rank":
                raise InvalidOptionError("pooling 'rank' scores query/document pairs (a reranker): choose mean, cls or last")
            if name not in POOLING_TYPES:
                raise InvalidOptionError(f"unknown pooling {self.pooling!r}: choose mean, cls or last")
        for field_name in ("normalize",):
            value = getattr(self, field_name)
            if value is not None and not isinstance(value, bool):
                raise InvalidOptionError(f"{field_name} must be True, False or None, got {type(value).__name__} {value!r}")
        if not isinstance(self.truncate, bool):
            raise InvalidOptionError(f"truncate must be True or False, got {type(self.truncate).__name__} {self.truncate!r}")
        if self.dimensions is not None:
            if isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int):
                raise InvalidOptionError(f"dimensions must be an integer, got {type(self.dimensions).__name__} {self.dimensions!r}")
            if not 1 <= self.dimensions <= _INT32_MAX:
                raise InvalidOptionError(f"dimensions must be at least 1, got {self.dimensions}")
        for field_name in ("prompt_name", "prompt"):
            value = getattr(self, field_name)
            if value is not None and not isinstance(value, str):
                raise InvalidOptionError(f"{field_name} must be a string, got {type(value).__name__} {value!r}")
        if self.prompt_name is not None and not self.prompt_name:
            raise InvalidOptionError("prompt_name must not be empty")
        if self.prompt_name is not None and self.prompt is not None:
            raise InvalidOptionError("give either prompt_name or prompt, not both")
        return self


@dataclass(frozen=True)
class EmbeddingResult:
    """The vectors of one `embed` call, in input order, and what made them."""

    vectors: np.ndarray  # float32 [n_inputs, dimensions]
    token_counts: tuple[int, ...]  # tokens embedded per input (prompt included, after truncation)
    truncated: tuple[bool, ...]  # which inputs were cut to the context
    pooling: str
    normalized: bool

    @property
    def prompt_tokens(self) -> int:
        return sum(self.token_counts)

    @property
    def dimensions(self) -> int:
        return int(self.vectors.shape[1])

    def tolist(self) -> list[list[float]]:
        return self.vectors.tolist()

    def __len__(self) -> int:
        return int(self.vectors.shape[0])


@dataclass(frozen=True)
class _Plan:
    pooling: str
    normalize: bool
    dimensions: int
    prefix: str


class Embedder:
    """Embeddings from the model of `runtime` on a context of its own (see the module)."""

    def __init__(self, runtime: LlamaRuntime, *, max_tokens: int | None = None, n_seq_max: int | None = None):
        """`max_tokens`: the longest input accepted (default: the runtime's context, at most the
        model's trained one); `n_seq_max`: inputs per llama_decode (default: as many as llama.cpp
        allows, 256, as llama-cpp-python)."""
        if runtime.closed:
            raise EngineClosedError(f"{runtime.path.name}: this model was closed")
        self._rt = runtime
        self._ll = backend()  # the module every runtime uses, initialised once
        limit = min(runtime.n_ctx, runtime.facts.n_ctx_train)
        if max_tokens is not None:
            _check_int("max_tokens", max_tokens, 1)
            limit = min(max_tokens, runtime.facts.n_ctx_train)
        self.max_tokens = limit
        seq_cap = int(self._ll.llama_max_parallel_sequences())
        if n_seq_max is not None:
            _check_int("n_seq_max", n_seq_max, 1)
            if n_seq_max > seq_cap:
                raise InvalidOptionError(f"n_seq_max must be at most {seq_cap} (llama.cpp's limit), got {n_seq_max}")
        self._n_seq_max = n_seq_max or seq_cap
        self._lock = threading.Lock()
        self._context: LlamaContext | None = None
        self._ctx_tokens = 0  # tokens one decode takes in the open context
        self._ctx_pooling: str | None = None
        self._ctx_seqs = 0
        self._closed = False
        model = runtime.model
        self.arch = self._meta("general.architecture") or "?"
        self.dimensions = int(self._ll.llama_model_n_embd_out(model))
        declared = self._meta(pooling_key(self.arch))
        self.declared_pooling: str | None = POOLING_NAMES.get(int(declared)) if declared and declared.isdigit() else None
        self.normalize_default = self._meta_bool(NORMALIZE_KEY, self.declared_pooling in POOLING_TYPES)
        self.prompts: dict[str, str] = self._meta_prompts()
        self.default_prompt_name = self._meta(DEFAULT_PROMPT_KEY) or None
        min_dims = self._meta(MIN_DIMENSIONS_KEY)
        self.min_dimensions: int | None = int(min_dims) if min_dims and min_dims.isdigit() else None
        self._add_eos = bool(self._ll.llama_vocab_get_add_eos(runtime.vocab))

    # -- model facts -----------------------------------------------------------------------------
    def _meta(self, key: str) -> str | None:
        """A GGUF metadata value as llama.cpp renders it (None when absent)."""
        buf = ctypes.create_string_buffer(256)
        n = self._ll.llama_model_meta_val_str(self._rt.model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            n = self._ll.llama_model_meta_val_str(self._rt.model, key.encode(), buf, len(buf))
        return buf.raw[:n].decode("utf-8", errors="replace")

    def _meta_bool(self, key: str, default: bool) -> bool:
        value = self._meta(key)
        return default if value not in ("true", "false") else value == "true"

    def _meta_prompts(self) -> dict[str, str]:
        raw = self._meta(PROMPTS_KEY)
        if not raw:
            return {}
        try:
            prompts = json.loads(raw)
        except ValueError:
            prompts = None
        if not isinstance(prompts, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()):
            log.warning("%s: ignoring %s: not a JSON object of strings", self._rt.path.name, PROMPTS_KEY)
            return {}
        return prompts

    @property
    def n_ctx(self) -> int:
        """Tokens one decode takes now (the context grows up to `max_tokens` when needed)."""
        return self._ctx_tokens

    @property
    def closed(self) -> bool:
        return self._closed or self._rt.closed

    # -- the public call -------------------------------------------------------------------------
    def embed(self, items: str | Sequence[str | Sequence[int]], options: EmbedOptions | None = None, *,
              cancel: CancelToken = None) -> EmbeddingResult:
        """One vector per input: a text, or a list of token ids. A lone string is one input.
        Raises InvalidOptionError (bad input or options), ContextLengthError (an input longer than
        `max_tokens` without `truncate`), Cancelled (between decodes, when `cancel` is set)."""
        if options is None:
            options = EmbedOptions()
        elif not isinstance(options, EmbedOptions):
            raise InvalidOptionError(f"options must be EmbedOptions, got {type(options).__name__}")
        options.validate()
        if self.closed:
            raise EngineClosedError(f"{self._rt.path.name}: this model was closed")
        plan = self._plan(options)
        inputs = _inputs(items)
        if (options.prompt is not None or options.prompt_name is not None) and not all(isinstance(x, str) for x in inputs):
            raise InvalidOptionError("a prompt applies to texts: token-id inputs are used as they are")
        tokens, truncated = self._tokenize(inputs, plan.prefix, options.truncate)
        if not tokens:
            return EmbeddingResult(np.zeros((0, plan.dimensions), np.float32), (), (), plan.pooling, plan.normalize)
        with self._lock:
            if self.closed:
                raise EngineClosedError(f"{self._rt.path.name}: this model was closed")
            self._ensure_context(plan.pooling, max(len(t) for t in tokens))
            pooled = self._run(tokens, cancel)
        vectors = pooled[:, : plan.dimensions]
        if not np.isfinite(vectors).all():
            bad = int(np.flatnonzero(~np.isfinite(vectors).all(axis=1))[0])
            raise InvalidModelError(f"{self._rt.path.name}: the model produced non-finite values for input {bad}")
        if plan.normalize:
            v64 = vectors.astype(np.float64)
            norms = np.linalg.norm(v64, axis=1, keepdims=True)
            vectors = np.where(norms > 0, v64 / np.where(norms > 0, norms, 1.0), v64).astype(np.float32)
        else:
            vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        return EmbeddingResult(vectors, tuple(len(t) for t in tokens), tuple(truncated), plan.pooling, plan.normalize)

    def _plan(self, options: EmbedOptions) -> _Plan:
        name = self._rt.path.name
        pooling = options.pooling.lower() if options.pooling is not None else self.declared_pooling
        if pooling is None or pooling == "none":
            raise InvalidOptionError(
                f"{name} declares no pooling type (it is not an embedding model): choose mean, cls or last "
                "(`--pooling mean` on the command line, the `pooling` field in the API)")
        if pooling == "rank":
            raise InvalidOptionError(f"{name} is a reranker (pooling 'rank'), not an embedding model")
        normalize = self.normalize_default if options.normalize is None else options.normalize
        dims = self.dimensions
        if options.dimensions is not None and options.dimensions != dims:
            if options.dimensions > dims:
                raise InvalidOptionError(f"dimensions must be at most {dims} (the model's embedding size), got {options.dimensions}")
            if self.min_dimensions is None:
                raise InvalidOptionError(
                    f"{name} does not declare Matryoshka training: its vectors cannot be shortened "
                    f"(dimensions must be {dims})")
            if options.dimensions < self.min_dimensions:
                raise InvalidOptionError(
                    f"dimensions must be in [{self.min_dimensions}, {dims}] for {name}, got {options.dimensions}")
            dims = options.dimensions
        if options.prompt is not None:
            prefix = options.prompt
        elif options.prompt_name is not None:
            if options.prompt_name not in self.prompts:
                known = ", ".join(sorted(self.prompts)) or "none"
                raise InvalidOptionError(f"{name} declares no prompt named {options.prompt_name!r} (it declares: {known})")
            prefix = self.prompts[options.prompt_name]
        else:
            prefix = self.prompts.get(self.default_prompt_name, "") if self.default_prompt_name else ""
        return _Plan(pooling, normalize, dims, prefix)

    def _tokenize(self, inputs: list[str | list[int]], prefix: str, truncate: bool) -> tuple[list[list[int]], list[bool]]:
        rt = self._rt
        limit = self.max_tokens
        out: list[list[int]] = []
        cut: list[bool] = []
        for i, item in enumerate(inputs):
            if isinstance(item, str):
                try:
                    toks = rt.tokenize(prefix + item, True, False)
                except UnicodeEncodeError:
                    raise InvalidOptionError(f"input {i} is not valid Unicode (it holds a lone surrogate)") from None
                if not toks:
                    raise InvalidOptionError(f"input {i} has no tokens")
                keep_last = self._add_eos
            else:
                try:
                    toks = [rt.check_token(t) for t in item]
                except InvalidOptionError as e:
                    raise InvalidOptionError(f"input {i}: {e}") from None
                keep_last = False
            if len(toks) > limit:
                if not truncate:
                    raise ContextLengthError(
                        f"input {i} has {len(toks)} tokens, more than the {limit} an embedding takes here "
                        "(truncate=True cuts it; a larger context allows more)")
                toks = toks[: limit - 1] + toks[-1:] if keep_last else toks[:limit]
                cut.append(True)
            else:
                cut.append(False)
            out.append(toks)
        return out, cut

    # -- the context -----------------------------------------------------------------------------
    def _ensure_context(self, pooling: str, longest: int) -> None:
        """A context with this pooling that takes `longest` tokens in one decode (holds the lock)."""
        size = self._ctx_tokens
        if self._context is not None and self._ctx_pooling == pooling and longest <= size:
            return
        size = max(size, min(self.max_tokens, DEFAULT_EMBED_CTX))
        while size < longest:
            size = min(size * 2, self.max_tokens)
        self._free()
        rt = self._rt
        n_seq = min(self._n_seq_max, size)
        # one ubatch per decode (n_ubatch = n_batch = size): a pooled sequence must not be split
        cparams = context_params(rt.options, n_ctx=size, n_batch=size, threads=rt.threads, n_seq_max=n_seq,
                                 embeddings=True, pooling_type=POOLING_CODES[pooling])
        self._context = LlamaContext(rt.model, cparams, f"{rt.path.name}: llama.cpp could not create an embedding "
                                                        f"context of {size} tokens")
        self._ctx_tokens = size
        self._ctx_pooling = pooling
        self._ctx_seqs = n_seq
        log.info("%s: embedding context of %d tokens, %d sequences, %s pooling", rt.path.name, size, n_seq, pooling)

    def _run(self, tokens: list[list[int]], cancel: CancelToken) -> np.ndarray:
        """Pooled vectors [len(tokens), n_embd_out], packing inputs in order into decodes."""
        assert self._context is not None
        out = np.empty((len(tokens), self.dimensions), np.float32)
        threads = self._rt.threads
        self._ll.llama_set_n_threads(self._context.ctx, threads, threads)
        group: list[int] = []
        used = 0
        for i, t in enumerate(tokens):
            if group and (used + len(t) > self._ctx_tokens or len(group) >= self._ctx_seqs):
                self._decode(group, tokens, out, cancel)
                group, used = [], 0
            group.append(i)
            used += len(t)
        self._decode(group, tokens, out, cancel)
        return out

    def _decode(self, group: list[int], tokens: list[list[int]], out: np.ndarray, cancel: CancelToken) -> None:
        raise_if_cancelled(cancel, "embedding cancelled")
        ll, context = self._ll, self._context
        assert context is not None
        ll.llama_memory_clear(context.memory, True)
        rows = DecodeRows()
        for seq, i in enumerate(group):
            rows.extend(tokens[i], 0, seq, 0)  # an embedding context outputs every token (llama.cpp requires it)
        rc = context.decode(rows)
        if rc != 0:
            raise InvalidModelError(f"{self._rt.path.name}: llama_decode failed with code {rc} while embedding")
        for seq, i in enumerate(group):
            ptr = ll.llama_get_embeddings_seq(context.ctx, seq)
            if not ptr:
                raise InvalidModelError(f"{self._rt.path.name}: llama.cpp returned no pooled embedding for input {i}")
            out[i] = np.ctypeslib.as_array(ptr, shape=(self.dimensions,))

    # -- lifecycle -------------------------------------------------------------------------------
    def _free(self) -> None:
        if self._context is not None:
            self._context.close()
            self._context = None
        self._ctx_tokens = 0
        self._ctx_pooling = None

    def close(self) -> None:
        """Free the context (before the runtime's model is freed); later calls raise EngineClosedError."""
        with self._lock:
            self._closed = True
            self._free()

    def __enter__(self) -> Embedder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Embedder({self._rt.path.name}, dimensions={self.dimensions}, pooling={self.declared_pooling}, "
                f"max_tokens={self.max_tokens})")


def _check_int(name: str, value: object, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= _INT32_MAX:
        raise InvalidOptionError(f"{name} must be an integer in [{lo}, {_INT32_MAX}], got {value!r}")


def _inputs(items: object) -> list[str | list[int]]:
    """The inputs of one call as strings and token-id lists (ids checked against the vocabulary later)."""
    if isinstance(items, str):
        items = [items]
    if isinstance(items, (bytes, bytearray)) or not isinstance(items, (list, tuple)):
        raise InvalidOptionError(
            f"the input must be a string or a list of strings and token-id lists, got {type(items).__name__}")
    out: list[str | list[int]] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise InvalidOptionError(f"input {i} is an empty string")
            out.append(item)
        elif isinstance(item, (list, tuple, np.ndarray)):
            if len(item) == 0:
                raise InvalidOptionError(f"input {i} is an empty list of token ids")
            ids: list[int] = []
            for t in item:
                if isinstance(t, (bool, np.bool_, float)):
                    raise InvalidOptionError(f"input {i}: a token id must be an integer, got {type(t).__name__} {t!r}")
                try:
                    ids.append(operator.index(t))
                except TypeError:
                    raise InvalidOptionError(
                        f"input {i}: a token id must be an integer, got {type(t).__name__}") from None
            out.append(ids)
        else:
            hint = " (one token-id input is a list: [[1, 2, 3]])" if isinstance(item, int) else ""
            raise InvalidOptionError(f"input {i} must be a string or a list of token ids, got {type(item).__name__}{hint}")
    return out
