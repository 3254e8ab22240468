"""A thin, checked layer over llama-cpp-python's low-level ctypes bindings.

Owns one llama.cpp model + context + batch. Everything above it (the decode loop, speculation,
evaluation) works in token ids, positions and zero-copy numpy views of single logits rows.
"""

from __future__ import annotations

import contextlib
import ctypes
import operator
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...cpu import ThreadGovernor
from ...errors import ContextLengthError, EngineClosedError, InvalidModelError, InvalidOptionError
from ...llama_backend import backend, log_capture
from ..core.options import LoadOptions
from .context import FLASH_ATTN_TYPE, DecodeRows, LlamaContext, context_params, derived_params, require_fields, \
    set_fields

# backend and log_capture live in edgeinfer.llama_backend, the context and its rows in context.py;
# re-exported for existing callers.
__all__ = ["LlamaRuntime", "DecodeRows", "DecodeAborted", "log_capture", "backend", "set_fields", "require_fields", "FLASH_ATTN_TYPE"]


class DecodeAborted(Exception):
    """llama_decode returned early because the abort callback asked it to (a cancel)."""


def ubatch_rows(shape: Sequence[tuple[int, int]], n_ubatch: int, unified: bool) -> list[int]:
    """The ubatches llama.cpp splits one batch into: their row counts. `shape`: (sequence id, rows)
    in batch order. A unified cache cuts the rows in n_ubatch pieces. A stream per sequence
    (llama_batch_allocr::split_equal, sequential) takes a run of consecutive sequence ids from the
    first with rows left, and from each of them the same number of rows: as many as the run's
    fewest, within n_ubatch."""
    if unified:
        total = sum(n for _, n in shape)
        return [min(n_ubatch, total - s) for s in range(0, total, n_ubatch)]
    left = [[seq, n] for seq, n in shape if n > 0]
    out: list[int] = []
    while left:
        run = [left[0]]
        for e in left[1:]:
            if e[0] == run[-1][0] + 1:
                run.append(e)
        each = min(min(e[1] for e in run), max(1, n_ubatch // len(run)))
        out.append(each * len(run))
        for e in run:
            e[1] -= each
        left = [e for e in left if e[1] > 0]
    return out


def _load_error(fragments: list[str]) -> str:
    """llama.cpp's own reason from its log of a failed load, e.g. 'error loading model: ...'."""
    lines = [line.strip() for line in "".join(fragments).splitlines() if line.strip()]
    for line in reversed(lines):
        if "error" in line.lower() and "failed to load model" not in line:
            return line.split(": ", 1)[-1] if line.startswith("llama_") else line
    return "unsupported architecture or damaged file"


@dataclass(frozen=True)
class ModelFacts:
    n_vocab: int
    n_ctx_train: int
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_params: int
    size_bytes: int
    recurrent: bool


class LlamaRuntime:
    """One model, one context, one reusable batch; no per-sequence state (engine/core/sequence.py).

    With n_seq_max > 1 the context holds that many sequences, by default in one unified KV cache:
    any mix of sequences and of rows per sequence decodes as one ubatch, but every row attends over
    the cells of all sequences (masked). `kv_unified=False` gives each sequence its own stream, as
    llama-server does with `-np N`: a row attends over its own sequence only (8 requests of ~330
    tokens: 230 vs 259 ms a decode step on the 1.5B, `llama-batched-bench -npl 8 [-kvu]`), but
    llama.cpp then splits a batch into ubatches of equal rows per sequence over consecutive ids
    (see `ubatch_rows`): 8 requests' tokens plus one 8-token draft cost 427 ms there against 242 ms
    unified."""

    def __init__(self, path: Path, options: LoadOptions, n_seq_max: int = 1, *, load_mtp: bool = False,
                 rollback: int = 0, kv_unified: bool = True):
        ll = backend()
        self._ll = ll
        self.path = path
        self.options = options
        self.n_seq_max = n_seq_max
        self.kv_unified = kv_unified
        self.model: Any = None
        self._context: LlamaContext | None = None
        self.epoch = 0  # bumped when the context is made again (enable_rollback): every cache is empty then
        # Unpinned threads follow the cores that other processes leave free (edgeinfer.cpu).
        self._governor = ThreadGovernor(self._set_threads) if options.pinned_threads is None else None
        if self._governor is not None:
            self._governor.start()  # the load's duration is the first sample window
        mparams = set_fields(ll.llama_model_default_params(), load_mode=ll.LLAMA_LOAD_MODE_MMAP,
                             **options.placement_fields(ll, path))  # GPUs, RPC workers: edgeinfer.devices
        if load_mtp:  # the MTP layer's weights too (an MTP context on a model loaded without them aborts)
            set_fields(mparams, load_mtp=True)
        said: list[str] = []
        with log_capture(lambda _level, text: said.append(text)):
            self.model = ll.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise InvalidModelError(f"{path.name}: llama.cpp could not load this model ({_load_error(said)})")
        try:
            self.vocab = ll.llama_model_get_vocab(self.model)
            self.facts = ModelFacts(
                n_vocab=ll.llama_vocab_n_tokens(self.vocab),
                n_ctx_train=ll.llama_model_n_ctx_train(self.model),
                n_layer=ll.llama_model_n_layer(self.model),
                n_embd=ll.llama_model_n_embd(self.model),
                n_head=ll.llama_model_n_head(self.model),
                n_head_kv=ll.llama_model_n_head_kv(self.model),
                n_params=ll.llama_model_n_params(self.model),
                size_bytes=ll.llama_model_size(self.model),
                recurrent=bool(ll.llama_model_is_recurrent(self.model) or ll.llama_model_is_hybrid(self.model)),
            )
            self.n_nextn = int(ll.llama_model_n_layer_nextn(self.model)) if load_mtp else 0  # MTP layers loaded
            # one sequence is one stream either way; recurrent/hybrid memory keeps the unified layout
            self.kv_unified = kv_unified or n_seq_max == 1 or self.facts.recurrent
            n_ctx = options.n_ctx or min(self.facts.n_ctx_train, 4096)
            if n_ctx > self.facts.n_ctx_train:
                raise ContextLengthError(
                    f"context {n_ctx} is larger than the {self.facts.n_ctx_train} tokens this model was trained for"
                )
            self.n_batch = min(options.n_batch, n_ctx)
            self.threads = self._governor.settle() if self._governor is not None else options.threads
            cparams = context_params(options, n_ctx=n_ctx, n_batch=self.n_batch, threads=self.threads,
                                     n_seq_max=n_seq_max, kv_unified=self.kv_unified,
                                     **({"n_rs_seq": rollback} if rollback and self.facts.recurrent else {}))
            # Cancellation reaches into a long llama_decode (a big prefill) through this flag; the
            # callback is installed only around prefills (see `abortable`), since ggml calls it once
            # per graph node and a Python call per node would tax every decode step.
            self.abort_flag = threading.Event()
            self._interrupted = False
            self._abort_cb = ll.ggml_abort_callback(self._should_abort)
            self._no_abort_cb = ll.ggml_abort_callback()
            kv_k, kv_v = options.kv_types
            self._context = LlamaContext(self.model, cparams, f"{path.name}: llama.cpp could not create a context "
                                                              f"(n_ctx={n_ctx}, kv={kv_k}/{kv_v})")
            self.n_ctx = ll.llama_n_ctx(self.ctx)
            self.n_rs_seq = int(ll.llama_n_rs_seq(self.ctx)) if self.facts.recurrent else 0
            self._piece_buf = ctypes.create_string_buffer(256)
        except BaseException:
            self.close()
            raise

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self.model is None

    @property
    def ctx(self) -> Any:
        """The llama.cpp context (a pointer; None once closed)."""
        return self._context.ctx if self._context is not None else None

    @property
    def memory(self) -> Any:
        return self._context.memory if self._context is not None else None

    @property
    def cparams(self) -> Any:
        """The context's parameters (a drafting head's context is made from them)."""
        return self._context.cparams if self._context is not None else None

    def _set_threads(self, n: int) -> None:
        """Threads for one-token steps and for batches (prefill, verification) alike."""
        self._ll.llama_set_n_threads(self.ctx, n, n)
        self.threads = n

    def _check_open(self) -> None:
        if self.model is None:
            raise EngineClosedError(f"{self.path.name}: this model was closed")

    def check_token(self, token: object) -> int:
        """A token id as an int, refused unless it is in the vocabulary (llama.cpp would abort)."""
        try:
            t = operator.index(token)  # type: ignore[arg-type]
        except TypeError:
            raise InvalidOptionError(f"a token id must be an integer, got {type(token).__name__}") from None
        if not 0 <= t < self.facts.n_vocab:
            raise InvalidOptionError(f"token id {t} is outside the vocabulary (0..{self.facts.n_vocab - 1})")
        return t

    def close(self) -> None:
        if getattr(self, "_context", None) is not None:
            self._context.close()  # type: ignore[union-attr]
            self._context = None
        if getattr(self, "model", None):
            self._ll.llama_model_free(self.model)
            self.model = None

    def enable_rollback(self, n: int) -> bool:
        """A recurrent/hybrid model's context that can drop up to `n` positions just decoded (llama.cpp
        keeps that many recurrent-state snapshots per sequence, n_rs_seq): the context is made again
        when it has fewer, which empties every sequence (`epoch` says so); the caller holds the
        context. False when the architecture keeps no snapshots (llama.cpp clamps n_rs_seq to 0).
        An attention-only model drops any suffix already: True."""
        self._check_open()
        if not self.facts.recurrent or self.n_rs_seq >= n:
            return not self.facts.recurrent or self.n_rs_seq > 0
        cparams = derived_params(self.cparams, n_rs_seq=n, n_threads=self.threads, n_threads_batch=self.threads)
        context = LlamaContext(self.model, cparams,
                               f"{self.path.name}: llama.cpp could not make a context with {n} rollback snapshots")
        self._context.close()  # type: ignore[union-attr]
        self._context = context
        self.n_rs_seq = int(self._ll.llama_n_rs_seq(context.ctx))
        self.epoch += 1
        return self.n_rs_seq > 0

    # -- cancellation ----------------------------------------------------------------------------
    def _should_abort(self, _data: object) -> bool:
        try:
            return self.abort_flag.is_set()
        except KeyboardInterrupt:
            # An exception cannot cross a ctypes callback (it would be printed and dropped), so a
            # Ctrl-C that lands here aborts the decode and is re-raised when llama_decode returns.
            self._interrupted = True
            self.abort_flag.set()
            return True

    @contextlib.contextmanager
    def abortable(self) -> Iterator[None]:
        """Let `abort_flag` interrupt llama_decode calls made inside the block."""
        self._ll.llama_set_abort_callback(self.ctx, self._abort_cb, None)
        try:
            yield
        finally:
            self._ll.llama_set_abort_callback(self.ctx, self._no_abort_cb, None)

    # -- vocabulary ------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        self._check_open()
        data = text.encode("utf-8")
        n_max = len(data) + 8
        buf = (self._ll.llama_token * n_max)()
        n = self._ll.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            buf = (self._ll.llama_token * -n)()
            n = self._ll.llama_tokenize(self.vocab, data, len(data), buf, -n, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of a token (unchecked: for ids the model itself produced; see check_token)."""
        self._check_open()
        n = self._ll.llama_token_to_piece(self.vocab, token, self._piece_buf, len(self._piece_buf), 0, special)
        if n < 0:
            big = ctypes.create_string_buffer(-n)
            n = self._ll.llama_token_to_piece(self.vocab, token, big, -n, 0, special)
            return big.raw[:n]
        return self._piece_buf.raw[:n]

    def token_text(self, token: int) -> str:
        """The vocabulary entry of a token (as stored in the GGUF)."""
        self._check_open()
        token = self.check_token(token)
        raw = self._ll.llama_vocab_get_text(self.vocab, token)
        return raw.decode("utf-8", errors="replace") if raw else ""

    def is_eog(self, token: int) -> bool:
        self._check_open()
        return bool(self._ll.llama_vocab_is_eog(self.vocab, token))

    @property
    def add_bos(self) -> bool:
        self._check_open()
        return bool(self._ll.llama_vocab_get_add_bos(self.vocab))

    @property
    def bos(self) -> int:
        self._check_open()
        return int(self._ll.llama_vocab_bos(self.vocab))

    @property
    def eos(self) -> int:
        self._check_open()
        return int(self._ll.llama_vocab_eos(self.vocab))

    @property
    def vocab_type(self) -> int:
        self._check_open()
        return int(self._ll.llama_vocab_type(self.vocab))

    # -- KV cache ------------------------------------------------------------------------------
    def seq_rm(self, seq: int, p0: int) -> bool:
        """Drop positions >= p0 of sequence `seq` from the KV cache. False when the model's memory
        cannot drop a suffix (recurrent/hybrid: only a whole sequence can go, p0 = 0)."""
        self._check_open()
        return bool(self._ll.llama_memory_seq_rm(self.memory, seq, p0, -1))

    def seq_cp(self, src: int, dst: int) -> None:
        """Make sequence `dst` a copy of the whole of `src` (between streams llama.cpp copies the
        buffer, and only whole: p0 = p1 = -1, or it aborts)."""
        self._check_open()
        self._ll.llama_memory_seq_rm(self.memory, dst, -1, -1)
        self._ll.llama_memory_seq_cp(self.memory, src, dst, -1, -1)

    def clear(self) -> None:
        """Empty the whole KV cache (every sequence)."""
        self._check_open()
        self._ll.llama_memory_clear(self.memory, True)

    # -- decoding --------------------------------------------------------------------------------
    def decode_batch(self, rows: DecodeRows) -> None:
        """One llama_decode of `rows` (len <= n_batch), which may belong to different sequences.

        The caller tracks what each sequence holds. llama_decode's code says what happened,
        never the abort flag alone (it may be set for a decode that failed on its own): 2, an
        abort (the abort callback, inside `abortable()`): every position the batch wrote is
        removed again and DecodeAborted (or the KeyboardInterrupt that caused it) is raised; 1 (no
        room) is a ContextLengthError; -1, a batch it refused (nothing written), and below -1, a
        failure (whatever it wrote is removed), are InvalidModelError."""
        self._check_open()
        n = len(rows)
        if self._governor is not None:
            self._governor.check()
        assert self._context is not None
        rc = self._context.decode(rows)
        if rc == 0:
            return
        if rc == 2 or rc < -1:
            # An aborted or failed decode may have written part of the batch: forget what we cannot trust.
            for seq, p0 in rows.starts().items():
                self._ll.llama_memory_seq_rm(self.memory, seq, p0, -1)
        if rc == 2:
            if self._interrupted:
                self._interrupted = False
                raise KeyboardInterrupt
            raise DecodeAborted()
        if rc == 1:
            raise ContextLengthError(f"no room in the KV cache for {n} more tokens (context {self.n_ctx})")
        if rc == -1:
            raise InvalidModelError(f"llama_decode refused the batch of {n} rows as invalid (code -1)")
        raise InvalidModelError(f"llama_decode failed with code {rc}")

    def logits_row(self, i: int) -> np.ndarray:
        """Zero-copy float32 view of the logits of batch row i of the last decode (-1: last output),
        valid until the next decode."""
        ptr = self._ll.llama_get_logits_ith(self.ctx, i)
        if not ptr:
            raise IndexError(f"no logits for row {i}")
        return np.ctypeslib.as_array(ptr, shape=(self.facts.n_vocab,))
