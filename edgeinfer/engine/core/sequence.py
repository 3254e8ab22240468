"""One sequence of a llama.cpp context: what its KV cache holds, and the logits its last prompt left.

The runtime (llama.py) owns the context and knows nothing of sequences; the scheduler core gives
each slot one `KVSequence` (sequence id = slot index), a draft model's context has one per slot
too, and evaluation uses sequence 0 of an engine's context through the same class.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ...errors import SpeculationError
from ..llama.runtime import DecodeRows, LlamaRuntime

if TYPE_CHECKING:
    from ..state.session import RestoreResult, SessionIdentity, SessionInfo

__all__ = ["KVSequence", "common_prefix"]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class KVSequence:
    """Sequence `seq_id` of `runtime`: the tokens whose keys/values it holds (positions 0..len-1)
    and, while it still holds that prompt, the logits row the last prompt ended with."""

    def __init__(self, runtime: LlamaRuntime, seq_id: int):
        self.runtime = runtime
        self.seq_id = seq_id
        self.cached: list[int] = []
        # (prompt tokens, logits row after them) of the last request on this sequence: a request
        # with the same prompt gets the same first-token logits without decoding anything (a
        # one-row re-decode rounds differently from the batched prefill on quantized models).
        self.saved_logits: tuple[list[int], np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.cached)

    @property
    def can_drop_suffix(self) -> bool:
        return not self.runtime.facts.recurrent

    def truncate(self, n_keep: int) -> int:
        """Drop every cached position >= n_keep; returns how many positions are kept. A model whose
        memory cannot drop a suffix (recurrent/hybrid) keeps nothing: the sequence is emptied."""
        n_keep = max(0, n_keep)
        if n_keep >= len(self.cached):
            return len(self.cached)
        if self.saved_logits is not None and n_keep < len(self.saved_logits[0]):
            self.saved_logits = None
        if n_keep > 0 and not self.can_drop_suffix:
            n_keep = 0
        if not self.runtime.seq_rm(self.seq_id, n_keep):
            if n_keep == 0:
                raise SpeculationError(f"{self.runtime.path.name}: could not clear sequence {self.seq_id}")
            self.runtime.seq_rm(self.seq_id, 0)
            n_keep = 0
        del self.cached[n_keep:]
        return n_keep

    def drop_suffix(self, n_keep: int) -> None:
        """Drop a rejected draft suffix. A recurrent/hybrid model's memory rolls back only right
        after the decode that wrote the suffix, at most n_rs_seq positions (its snapshots): refused
        beyond that, and where llama.cpp refuses. Never the whole of that decode: its snapshots are
        of the states after its rows, not the one before it (llama.cpp does not refuse that: the
        state would be wrong), so a verification keeps at least the row it decoded first."""
        n_drop = len(self.cached) - n_keep
        if n_drop <= 0 or self.can_drop_suffix:
            self.truncate(n_keep)
            return
        name = self.runtime.path.name
        if n_drop > self.runtime.n_rs_seq:
            raise SpeculationError(f"{name}: this model's recurrent memory rolls back {self.runtime.n_rs_seq} "
                                   f"positions, not {n_drop}")
        if not self.runtime.seq_rm(self.seq_id, n_keep):
            raise SpeculationError(f"{name}: llama.cpp refused to roll sequence {self.seq_id} back to {n_keep}")
        if self.saved_logits is not None and n_keep < len(self.saved_logits[0]):
            self.saved_logits = None
        del self.cached[n_keep:]

    def copy_from(self, other: KVSequence) -> None:
        """Hold what `other` holds (its cache copied: a request may take the lowest free slot and
        still reuse the prefix another slot kept)."""
        self.runtime.seq_cp(other.seq_id, self.seq_id)
        self.cached = list(other.cached)
        self.saved_logits = other.saved_logits

    def clear(self) -> None:
        self.truncate(0)
        self.saved_logits = None

    def forget(self) -> None:
        """The context was made again (LlamaRuntime.enable_rollback): it holds nothing of this sequence."""
        self.cached.clear()
        self.saved_logits = None

    def rows(self, tokens: Sequence[int], logits_from: int | None = None, into: DecodeRows | None = None) -> DecodeRows:
        """Rows appending `tokens` to this sequence (logits from index `logits_from` on)."""
        rows = into if into is not None else DecodeRows()
        rows.extend(tokens, len(self.cached), self.seq_id, logits_from)
        return rows

    def decode(self, tokens: Sequence[int], logits_from: int | None = None) -> int:
        """Append tokens in one llama_decode of this sequence alone. Logits are requested for rows
        logits_from.. (None: only the last); returns the first row that has them."""
        first = len(tokens) - 1 if logits_from is None else logits_from
        self.runtime.decode_batch(self.rows(tokens, first))
        self.cached.extend(tokens)
        return first

    def decode_all(self, tokens: Sequence[int]) -> None:
        """Append any number of tokens in n_batch chunks; logits for the last row only."""
        n = self.runtime.n_batch
        for s in range(0, len(tokens), n):
            self.decode(tokens[s : s + n])

    def committed(self, tokens: Sequence[int]) -> None:
        """Record tokens that a shared batch (built with `rows`) has just written."""
        self.cached.extend(tokens)

    # -- saved state (engine/state/session.py) -----------------------------------------------------------
    def save(self, path: str | os.PathLike[str], identity: SessionIdentity,
             keep: Sequence[int] | None = None) -> SessionInfo:
        """Write this sequence's KV state and tokens to `path` (a temporary name, renamed when
        complete), tied to `identity` (model hash, KV types); `keep`: cut the sequence to the prefix
        it shares with these tokens first. The caller holds the context."""
        from ..state.session import save_sequence

        if keep is not None:  # nothing a continuation of `keep` could not reuse
            self.truncate(common_prefix(self.cached, keep))
        return save_sequence(self, path, identity)

    def load(self, path: str | os.PathLike[str], identity: SessionIdentity,
             conversation: Sequence[int] | None = None) -> RestoreResult:
        """Replace this sequence with the state saved at `path` when every check passes (else a
        log line and a false result, the sequence unchanged); `cached` is set only on success.
        `conversation`: tokens the saved ones must be a prefix of. The caller holds the context."""
        from ..state.session import restore_sequence

        return restore_sequence(self, path, identity, conversation)
