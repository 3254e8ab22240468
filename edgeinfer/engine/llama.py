"""A thin, checked layer over llama-cpp-python's low-level ctypes bindings.

Owns one llama.cpp model + context + batch. Everything above it (the decode loop, speculation,
evaluation) works in token ids, positions and zero-copy numpy views of single logits rows.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ContextLengthError, InvalidModelError, SpeculationError
from .options import LoadOptions

__all__ = ["LlamaRuntime", "DecodeAborted", "log_capture", "backend"]

# ggml type ids of the KV-cache types we offer.
_GGML_KV_TYPES = {"f16": 1, "q4_0": 2, "q8_0": 8}
_FLASH_ATTN = {None: -1, False: 0, True: 1}  # llama_flash_attn_type: auto / disabled / enabled


class DecodeAborted(Exception):
    """llama_decode returned early because the abort callback asked it to (a cancel)."""


# -- process-wide llama.cpp state -------------------------------------------------------------------

_backend_lock = threading.Lock()
_backend_ready = False
_log_sinks: list[Callable[[int, str], None]] = []
_log_callback_ref = None  # keep the ctypes callback alive


def backend():
    """Import llama_cpp and initialise the backend once; route llama.cpp's log to our sinks."""
    global _backend_ready, _log_callback_ref
    import llama_cpp

    with _backend_lock:
        if not _backend_ready:
            llama_cpp.llama_backend_init()

            @llama_cpp.llama_log_callback
            def _on_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
                if _log_sinks:
                    message = text.decode("utf-8", errors="replace")
                    for sink in list(_log_sinks):
                        sink(level, message)

            _log_callback_ref = _on_log
            llama_cpp.llama_log_set(_on_log, ctypes.c_void_p(0))  # silent unless someone listens
            _backend_ready = True
    return llama_cpp


@contextlib.contextmanager
def log_capture(sink: Callable[[int, str], None]) -> Iterator[None]:
    """Receive llama.cpp's log lines (level, text) while the block runs (e.g. quantizer progress)."""
    backend()
    _log_sinks.append(sink)
    try:
        yield
    finally:
        _log_sinks.remove(sink)


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
    """One model, one context (sequence 0), one reusable batch."""

    def __init__(self, path: Path, options: LoadOptions):
        ll = backend()
        self._ll = ll
        self.path = path
        self.options = options
        mparams = ll.llama_model_default_params()
        mparams.n_gpu_layers = 0
        mparams.use_mmap = True
        self.model = ll.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise InvalidModelError(f"{path.name}: llama.cpp could not load this model (unsupported architecture or damaged file)")
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
            n_ctx = options.n_ctx or min(self.facts.n_ctx_train, 4096)
            if n_ctx > self.facts.n_ctx_train:
                raise ContextLengthError(
                    f"context {n_ctx} is larger than the {self.facts.n_ctx_train} tokens this model was trained for"
                )
            self.n_batch = min(options.n_batch, n_ctx)
            cparams = ll.llama_context_default_params()
            cparams.n_ctx = n_ctx
            cparams.n_batch = self.n_batch
            cparams.n_ubatch = self.n_batch
            cparams.n_seq_max = 1
            cparams.n_threads = options.threads
            cparams.n_threads_batch = options.threads
            kv = _GGML_KV_TYPES[options.kv_type]
            cparams.type_k = kv
            cparams.type_v = kv
            flash = options.flash_attn
            if options.kv_type != "f16":
                flash = True  # a quantized V cache needs flash attention in llama.cpp
            cparams.flash_attn_type = _FLASH_ATTN[flash]
            cparams.no_perf = True
            # Cancellation reaches into a long llama_decode (a big prefill) through this flag; the
            # callback is installed only around prefills (see `abortable`), since ggml calls it once
            # per graph node and a Python call per node would tax every decode step.
            self.abort_flag = threading.Event()
            self._interrupted = False
            self._abort_cb = ll.ggml_abort_callback(self._should_abort)
            self._no_abort_cb = ll.ggml_abort_callback()
            self.ctx = ll.llama_init_from_model(self.model, cparams)
            if not self.ctx:
                raise InvalidModelError(f"{path.name}: llama.cpp could not create a context (n_ctx={n_ctx}, kv={options.kv_type})")
            self.n_ctx = ll.llama_n_ctx(self.ctx)
            self.memory = ll.llama_get_memory(self.ctx)
            self.batch = ll.llama_batch_init(self.n_batch, 0, 1)
            self._piece_buf = ctypes.create_string_buffer(256)
        except BaseException:
            self.close()
            raise
        # Tokens whose keys/values are in the cache, in order (positions 0..len-1).
        self.cached: list[int] = []
        # (prompt length, logits row after the prompt) of the last request; valid while the
        # cache still holds that prompt.
        self.prompt_logits: tuple[int, np.ndarray] | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        ll = self._ll
        if getattr(self, "batch", None) is not None:
            ll.llama_batch_free(self.batch)
            self.batch = None
        if getattr(self, "ctx", None):
            ll.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            ll.llama_model_free(self.model)
            self.model = None

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
        data = text.encode("utf-8")
        n_max = len(data) + 8
        buf = (self._ll.llama_token * n_max)()
        n = self._ll.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            buf = (self._ll.llama_token * -n)()
            n = self._ll.llama_tokenize(self.vocab, data, len(data), buf, -n, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int, special: bool = False) -> bytes:
        n = self._ll.llama_token_to_piece(self.vocab, token, self._piece_buf, len(self._piece_buf), 0, special)
        if n < 0:
            big = ctypes.create_string_buffer(-n)
            n = self._ll.llama_token_to_piece(self.vocab, token, big, -n, 0, special)
            return big.raw[:n]
        return self._piece_buf.raw[:n]

    def token_text(self, token: int) -> str:
        """The vocabulary entry of a token (as stored in the GGUF)."""
        raw = self._ll.llama_vocab_get_text(self.vocab, token)
        return raw.decode("utf-8", errors="replace") if raw else ""

    def is_eog(self, token: int) -> bool:
        return bool(self._ll.llama_vocab_is_eog(self.vocab, token))

    @property
    def add_bos(self) -> bool:
        return bool(self._ll.llama_vocab_get_add_bos(self.vocab))

    @property
    def bos(self) -> int:
        return int(self._ll.llama_vocab_bos(self.vocab))

    @property
    def eos(self) -> int:
        return int(self._ll.llama_vocab_eos(self.vocab))

    @property
    def vocab_type(self) -> int:
        return int(self._ll.llama_vocab_type(self.vocab))

    # -- KV cache --------------------------------------------------------------------------------
    def truncate(self, n_keep: int) -> None:
        """Drop every cached position >= n_keep (a rejected draft suffix, a changed prompt)."""
        if n_keep >= len(self.cached):
            return
        if self.prompt_logits is not None and n_keep < self.prompt_logits[0]:
            self.prompt_logits = None
        if n_keep <= 0:
            self._ll.llama_memory_clear(self.memory, True)
        elif not self._ll.llama_memory_seq_rm(self.memory, 0, n_keep, -1):
            raise SpeculationError(f"{self.path.name}: this model's memory cannot drop a suffix (recurrent/hybrid)")
        del self.cached[n_keep:]

    def clear(self) -> None:
        self._ll.llama_memory_clear(self.memory, True)
        self.cached.clear()
        self.prompt_logits = None

    # -- decoding --------------------------------------------------------------------------------
    def decode(self, tokens: Sequence[int], logits_from: int | None = None) -> int:
        """Append tokens to the cache in one llama_decode (len <= n_batch).

        Logits are requested for batch rows logits_from.. (None: only the last row); read the
        row of batch index i with `logits_row(i)` (-1: the last one). Returns the first row with logits.
        """
        n = len(tokens)
        if n == 0 or n > self.n_batch:
            raise ValueError(f"decode takes 1..{self.n_batch} tokens, got {n}")
        start = len(self.cached)
        if start + n > self.n_ctx:
            raise ContextLengthError(f"the context is full ({self.n_ctx} tokens)")
        first_out = n - 1 if logits_from is None else logits_from
        b = self.batch
        for i, t in enumerate(tokens):
            b.token[i] = t
            b.pos[i] = start + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = i >= first_out
        b.n_tokens = n
        rc = self._ll.llama_decode(self.ctx, b)
        if rc != 0:
            if rc == 2 or self.abort_flag.is_set():
                # An aborted decode may have written part of the batch: forget what we cannot trust.
                self._ll.llama_memory_seq_rm(self.memory, 0, start, -1)
                if self._interrupted:
                    self._interrupted = False
                    raise KeyboardInterrupt
                raise DecodeAborted()
            if rc == 1:
                raise ContextLengthError(f"no room in the KV cache for {n} more tokens (context {self.n_ctx})")
            raise InvalidModelError(f"llama_decode failed with code {rc}")
        self.cached.extend(tokens)
        return first_out

    def decode_all(self, tokens: Sequence[int]) -> None:
        """Decode any number of tokens in n_batch chunks; logits for the last row only."""
        for s in range(0, len(tokens), self.n_batch):
            self.decode(tokens[s : s + self.n_batch])

    def logits_row(self, i: int) -> np.ndarray:
        """Zero-copy float32 view of the logits of batch row i of the last decode (-1: last output),
        valid until the next decode."""
        ptr = self._ll.llama_get_logits_ith(self.ctx, i)
        if not ptr:
            raise IndexError(f"no logits for row {i}")
        return np.ctypeslib.as_array(ptr, shape=(self.facts.n_vocab,))
