"""Every llama.cpp context edgeinfer makes, made one way.

`context_params` turns the sizes a caller needs into llama.cpp's context parameters, the rest from
its LoadOptions as llama-server sets them from its flags: the KV-cache types, flash attention (on
wherever a quantized V cache needs it), the thread count for one-token steps and batches alike.
`LlamaContext` is a context on a loaded model, with llama.cpp's own reason when it cannot be made,
and a batch of its size that `DecodeRows` fill. The runtime's context (and its remaking with
rollback snapshots), the scratch contexts that time flash attention and the embedding context are
all made here; a drafting head's context is the runtime's parameters with its own changes
(`derived_params`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...errors import InvalidModelError
from ...kv_types import KV_CACHE_TYPES, flash_attn_for
from ...llama_backend import backend, log_capture
from ..core.options import LoadOptions

__all__ = ["DecodeRows", "LlamaContext", "context_params", "derived_params", "set_fields", "require_fields",
           "FLASH_ATTN_TYPE"]

FLASH_ATTN_TYPE = {None: -1, False: 0, True: 1}  # llama_flash_attn_type: auto / disabled / enabled


# -- ctypes structs ----------------------------------------------------------------------------------


def _declared_fields(struct_type: type) -> set[str]:
    names: set[str] = set()
    for klass in struct_type.__mro__:
        names.update(f[0] for f in getattr(klass, "_fields_", ()))
    return names


def require_fields(struct_type: type, *names: str) -> None:
    """Fail loudly when a ctypes struct lacks fields we use (a binding of another llama.cpp)."""
    missing = sorted(set(names) - _declared_fields(struct_type))
    if missing:
        raise AttributeError(
            f"{struct_type.__name__} declares no field {', '.join(map(repr, missing))}: "
            "this llama-cpp-python is not the version edgeinfer was built against"
        )


def set_fields(struct: Any, **values: Any) -> Any:
    """Assign struct fields by name, refusing names the struct does not declare: plain ctypes
    accepts any attribute and silently ignores it (0.3.36 replaced `use_mmap` by `load_mode`)."""
    require_fields(type(struct), *values)
    for name, value in values.items():
        setattr(struct, name, value)
    return struct


# -- the rows of a decode ----------------------------------------------------------------------------


class DecodeRows:
    """The rows of one llama_decode: token, position, sequence, whether logits are wanted."""

    __slots__ = ("tokens", "positions", "seqs", "logits")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.positions: list[int] = []
        self.seqs: list[int] = []
        self.logits: list[bool] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        """Append a row; returns its index (the row to read logits from)."""
        self.tokens.append(token)
        self.positions.append(pos)
        self.seqs.append(seq)
        self.logits.append(logits)
        return len(self.tokens) - 1

    def extend(self, tokens: Sequence[int], start: int, seq: int, logits_from: int | None) -> None:
        """Rows for `tokens` at positions start.. of `seq`; logits from index `logits_from` of them
        on (None: none)."""
        for i, t in enumerate(tokens):
            self.add(t, start + i, seq, logits_from is not None and i >= logits_from)

    def starts(self) -> dict[int, int]:
        """The first position each sequence of the batch writes."""
        out: dict[int, int] = {}
        for seq, pos in zip(self.seqs, self.positions):
            if pos < out.get(seq, pos + 1):
                out[seq] = pos
        return out


# -- contexts ----------------------------------------------------------------------------------------


def context_params(options: LoadOptions, *, n_ctx: int, n_batch: int, threads: int, n_seq_max: int = 1,
                   kv_unified: bool = True, **fields: Any) -> Any:
    """llama.cpp's parameters for a context of `n_ctx` cells taking `n_batch` rows a decode (one
    ubatch), for `n_seq_max` sequences; KV types and flash attention from `options`; `fields`:
    any other field of llama_context_params (checked by name)."""
    ll = backend()
    kv_k, kv_v = options.kv_types
    return set_fields(
        ll.llama_context_default_params(),
        n_ctx=n_ctx,
        n_batch=n_batch,
        n_ubatch=n_batch,
        n_seq_max=n_seq_max,
        kv_unified=kv_unified,
        n_threads=threads,
        n_threads_batch=threads,
        type_k=KV_CACHE_TYPES[kv_k].ggml_type,
        type_v=KV_CACHE_TYPES[kv_v].ggml_type,
        flash_attn_type=FLASH_ATTN_TYPE[flash_attn_for(kv_k, kv_v, options.flash_attn)],  # on for a quantized V cache
        no_perf=True,
        **fields,
    )


def derived_params(cparams: Any, **fields: Any) -> Any:
    """A copy of another context's parameters with `fields` changed."""
    return set_fields(type(cparams).from_buffer_copy(cparams), **fields)


def _reason(said: list[str]) -> str:
    """llama.cpp's own words from its log of a failure (its last line naming an error)."""
    lines = [line.strip() for line in "".join(said).splitlines() if line.strip()]
    return next((line for line in reversed(lines) if "error" in line.lower() or "failed" in line.lower()), "")


class LlamaContext:
    """A llama.cpp context on a loaded model, and a batch of `n_batch` rows for its decodes.
    `failure`: the error's message when llama.cpp cannot make it (its own reason is added)."""

    def __init__(self, model: Any, cparams: Any, failure: str):
        ll = self._ll = backend()
        self.cparams = cparams
        self.n_batch = int(cparams.n_batch)
        self.batch: Any = None
        said: list[str] = []
        with log_capture(lambda _level, text: said.append(text)):
            self.ctx = ll.llama_init_from_model(model, cparams)
        if not self.ctx:
            why = _reason(said)
            raise InvalidModelError(f"{failure}: {why}" if why else failure)
        self.memory = ll.llama_get_memory(self.ctx)
        require_fields(ll.llama_batch, "n_tokens", "token", "pos", "n_seq_id", "seq_id", "logits")
        self.batch = ll.llama_batch_init(self.n_batch, 0, 1)

    def decode(self, rows: DecodeRows) -> int:
        """One llama_decode of `rows` (1..n_batch of them); returns llama.cpp's code (0: done)."""
        n = len(rows)
        if n == 0 or n > self.n_batch:
            raise ValueError(f"decode takes 1..{self.n_batch} tokens, got {n}")
        b = self.batch
        for i in range(n):
            b.token[i] = rows.tokens[i]
            b.pos[i] = rows.positions[i]
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = rows.seqs[i]
            b.logits[i] = rows.logits[i]
        b.n_tokens = n
        return int(self._ll.llama_decode(self.ctx, b))

    def close(self) -> None:
        if self.batch is not None:
            self._ll.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx:
            self._ll.llama_free(self.ctx)
            self.ctx = None
