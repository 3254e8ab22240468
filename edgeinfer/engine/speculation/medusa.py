"""Medusa heads (convert/medusa.py's files) drafting for a target, evaluated in numpy.

llama.cpp has no Medusa architecture, and a head is tiny beside its projection: residual blocks
x + SiLU(W x + b) and a vocabulary projection, on the target's last hidden state after its final
norm. llama.cpp hands that state over with the logits: with `llama_set_embeddings` on, a causal
model's context keeps, for each output row, the state its output layer read (`t_embd`,
"result_norm"); the rows the scheduler asks logits for are exactly the ones a draft starts from
(a prompt's last row, each verified row). It is switched on only around the scheduler's decodes
that have few rows without output (llama.cpp then outputs every row): a prompt chunk's are not
kept, so a request drafts from its second step on. So the heads need no context of their own, and cost
per drafted token one head's matrix products in numpy (measured: benchmarks/RESULTS.md).

Head i on the state at position t predicts the token at t + 2 + i. After a step the target holds
history[:-1] and sampled history[-1] from the row at len(history) - 2: the draft is head 0..k-1
on that row's state, a chain of up to `head_count` tokens, verified like every drafter's (exact
for any sampler: at T > 0 each head's token is drawn from its own q, and the rejection rule keeps
the target's distribution). Rows are kept per slot with the tokens they follow, as the other heads
keep theirs (heads.py): any cut of the target's sequence cuts them too.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from ...errors import IncompatibleDraftError, InvalidModelError, SpeculationError
from ...gguf_file import GGUFInfo, read_gguf
from ..core.sequence import common_prefix
from ..llama.runtime import DecodeRows, LlamaRuntime
from .draft_model import DraftJob, draft_token
from .heads import HeadContext, target_step_bytes

__all__ = ["MedusaWeights", "MedusaHeads", "open_medusa_heads", "medusa_cost_prior"]

_ARCH = "medusa"
# Rows without output a decode may hold for the heads to still keep its states (each costs the
# output layer once: llama.cpp outputs every row while it keeps hidden states).
_FORCED_ROWS = 8


def _silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp overflows to inf for very negative x: silu is then -0
        return x / (1.0 + np.exp(-x))


class MedusaWeights:
    """The heads of a Medusa GGUF in float32, checked against its own metadata."""

    def __init__(self, path: Path, info: GGUFInfo):
        label = path.name
        if info.architecture != _ARCH:
            raise IncompatibleDraftError(f"{label} is not a file of Medusa heads (a {info.architecture} model): "
                                         "medusa=FILE takes heads converted with `edgeinfer convert HEADS -o FILE`")
        meta = info.metadata

        def count(key: str, lo: int) -> int:
            v = meta.get(f"{_ARCH}.{key}")
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise InvalidModelError(f"{label}: {_ARCH}.{key} is {v!r}")
            return v

        self.n_heads, self.n_layers = count("head_count", 1), count("layer_count", 0)
        self.hidden, self.vocab = count("embedding_length", 1), count("vocab_size", 1)
        tensors = {t.name: t for t in info.tensors}
        h, v = self.hidden, self.vocab

        def load(name: str, shape: tuple[int, ...]) -> np.ndarray:
            t = tensors.get(name)
            if t is None:
                raise InvalidModelError(f"{label}: missing tensor {name}")
            if tuple(reversed(t.shape)) != shape or t.type_name not in ("F32", "F16", "BF16"):
                raise InvalidModelError(f"{label}: tensor {name} is {t.type_name}{list(t.shape)}; expected "
                                        f"F32/F16/BF16{list(reversed(shape))}")
            raw = np.fromfile(path, dtype=np.uint8, count=t.n_bytes, offset=t.offset)
            return np.ascontiguousarray(gguf.quants.dequantize(raw, t.type_id).reshape(shape), dtype=np.float32)

        self.blocks: list[list[tuple[np.ndarray, np.ndarray]]] = []
        self.outputs: list[np.ndarray] = []
        for i in range(self.n_heads):
            self.blocks.append([(load(f"medusa.{i}.res.{l}.weight", (h, h)), load(f"medusa.{i}.res.{l}.bias", (h,)))
                                for l in range(self.n_layers)])
            self.outputs.append(load(f"medusa.{i}.output.weight", (v, h)))

    def logits(self, i: int, states: np.ndarray) -> np.ndarray:
        """Head i's logits [B, vocab] (float32) on hidden states [B, hidden]."""
        x = states
        for w, b in self.blocks[i]:
            x = x + _silu(x @ w.T + b)
        return x @ self.outputs[i].T

    @property
    def nbytes(self) -> int:
        """What one head reads per drafted token (float32, as numpy evaluates it)."""
        return int(self.outputs[0].nbytes + sum(w.nbytes + b.nbytes for w, b in self.blocks[0]))


def medusa_cost_prior(weights: MedusaWeights, target: GGUFInfo) -> float:
    """A drafted token in target steps from the bytes each reads (a memory-bound CPU): one head's
    float32 weights over the target's blocks and output layer, until drafting measures it."""
    step = target_step_bytes(target)
    return weights.nbytes / step if step else 0.3


class MedusaHeads(HeadContext):
    """Medusa heads for every slot of an engine: the target's post-norm state of each output row,
    by slot and position, and the heads evaluated on it (see the module)."""

    kind = "medusa"
    shift = 0

    def __init__(self, target: LlamaRuntime, n_slots: int, cost_prior: float, weights: MedusaWeights):
        super().__init__(target, n_slots, cost_prior, weights.hidden)
        self.weights = weights
        self.max_draft = weights.n_heads
        self._keeping = False  # whether the target's context keeps this decode's hidden states

    def before_decode(self, rows: DecodeRows) -> None:
        """Have the target keep each output row's hidden state for this decode, unless it holds more
        than a few rows without output (a prompt chunk): with embeddings on, llama.cpp outputs every
        row (logits included), which would cost a prompt the output layer once per token. Such a
        decode's rows are not kept; drafting starts a step later."""
        self._keeping = sum(1 for wanted in rows.logits if not wanted) <= _FORCED_ROWS
        self.api.ll.llama_set_embeddings(self.target.ctx, self._keeping)  # (off again if a decode failed)

    def _target_rows(self, rows: DecodeRows) -> np.ndarray:
        """The post-norm state of each output row; NaN for rows without one (never drafted from)."""
        out = np.full((len(rows), self.width), np.nan, np.float32)
        if not self._keeping:
            return out
        ll, ctx = self.api.ll, self.target.ctx
        self._keeping = False
        try:
            for i, wanted in enumerate(rows.logits):
                if wanted:
                    ptr = ll.llama_get_embeddings_ith(ctx, i)
                    if not ptr:
                        raise SpeculationError(f"the target kept no hidden state for row {i}")
                    out[i] = np.ctypeslib.as_array(ptr, shape=(self.width,))
        finally:  # off between decodes: a decode made outside the scheduler outputs what it asks for
            ll.llama_set_embeddings(ctx, False)
        return out

    def _draft(self, jobs: list[DraftJob], forks: dict[int, Any], started: list[tuple[int, int]]) -> None:
        ready: list[DraftJob] = []
        states = []
        for j in jobs:
            s, n_t = j.slot, len(j.history) - 1  # the target holds history[:-1]; row n_t - 1 sampled history[-1]
            known = self._known[s]
            if n_t < 1 or known[:n_t] != list(j.history[:n_t]):
                self._truncate(s, common_prefix(known, j.history[:n_t]))
                continue  # behind: nothing to draft from for this slot
            if len(known) > n_t:
                self._truncate(s, n_t)
            h = self._rows[s][n_t - 1]
            if not np.isfinite(h).all():
                continue  # that row's state was not kept (its decode asked no logits of it)
            ready.append(j)
            states.append(h)
        if not ready:
            return
        hs = np.stack(states)
        active = list(range(len(ready)))
        for i in range(self.weights.n_heads):
            if not active:
                break
            t = time.perf_counter()
            logits = self.weights.logits(i, hs[active])
            self.costs.observe(len(active), time.perf_counter() - t, plain=False, prefill=True)
            still = []
            for row, a in zip(logits, active):
                j = ready[a]
                tok = draft_token(row, j, forks.get(id(j)))
                if tok is None:
                    continue
                j.tokens.append(tok)
                if len(j.tokens) < j.k:
                    still.append(a)
            active = still

def open_medusa_heads(name: str, target_info: GGUFInfo, rt: LlamaRuntime, path: Path, n_slots: int) -> MedusaHeads:
    """The Medusa heads at `path` over this target, after checking they were made for its width and
    vocabulary (one line each)."""
    if rt.facts.recurrent:
        raise SpeculationError(f"{name}: Medusa heads draft for attention models (its recurrent layers keep no "
                               "per-row hidden state llama.cpp hands over)")
    weights = MedusaWeights(path, read_gguf(path))  # bounds-checked before any offset is followed
    n_embd, n_vocab = rt.facts.n_embd, rt.facts.n_vocab
    if weights.hidden != n_embd:
        raise IncompatibleDraftError(f"{path.name} was made for a target {weights.hidden} wide; {name} is {n_embd} wide")
    if weights.vocab != n_vocab:
        raise IncompatibleDraftError(f"{path.name} predicts over {weights.vocab} tokens; {name} has {n_vocab}")
    return MedusaHeads(rt, n_slots, medusa_cost_prior(weights, target_info), weights)
