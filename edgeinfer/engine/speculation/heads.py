"""Drafting heads: drafters that read the target's own hidden states, in a llama.cpp context linked
to the target's (ctx_other), one sequence per slot as a draft model's context.

    MtpHead     the target's multi-token-prediction layer (Qwen3.5's `nextn` block) in an MTP
                context: entry p of its cache is (token p, h[p-1]), h the target's final hidden
                state (post-norm, what its output layer reads) at each position; it predicts token p+1.
    Eagle3Head  an EAGLE-3 drafter (one llama layer over three of the target's layer inputs): its
                encoder fuses those inputs into g; entry p of its cache is (token p+1, g[p]).

What llama.cpp's `common_speculative` does for `draft-mtp` / `draft-eagle3`, driven from here:
after every target decode the head copies the hidden rows of every sequence in it (`after_decode`:
a copy, no decode of its own — prompt chunks included); its cache entries are written lazily, in
the first decode of its next draft, together with the entry it drafts from, so a head the policy
switched off costs nothing but that copy. Per slot it keeps the target tokens whose rows it holds
(`known`), the rows, and how many entries its cache holds; any cut of the target's sequence
(a rejected draft, a new prompt sharing a prefix) cuts them too, and a sequence the head missed
part of (a decode made outside the scheduler) is noticed against the target's tokens and not
drafted for until the target re-reads it (`reusable`). Drafted entries are removed after each draft
(the target's verification rows bring the true ones). Drafts are only proposals: whatever a head
drafts, verification keeps output exactly the target's.
"""

from __future__ import annotations

import logging
import time
from typing import Any, ClassVar

import numpy as np

from ...errors import SpeculationError
from ...gguf_file import GGUFInfo
from ..llama.context import derived_params
from ..llama.runtime import DecodeRows, LlamaRuntime
from ..llama.heads_api import ExtBatch, ext
from ..core.sequence import common_prefix
from .draft_model import DraftJob, ModelDrafter, draft_token
from .policy import CostModel, LengthPolicy

__all__ = ["HeadContext", "MtpHead", "Eagle3Head", "HeadDrafter", "ROLLBACK_DEPTH", "mtp_cost_prior",
           "eagle3_cost_prior"]

log = logging.getLogger(__name__)

# Positions a hybrid target (Gated DeltaNet + attention) can drop after a verification: llama.cpp
# keeps this many recurrent-state snapshots per sequence (n_rs_seq), each as large as the state
# itself (Qwen3.5-0.8B: ~19 MiB a sequence), so it also caps a hybrid target's drafts. On this
# CPU 2-3 drafted tokens a step are best even at 97 % acceptance (the batch curve: DESIGN.md).
ROLLBACK_DEPTH = 4
_WARMUP = 2  # drafts of a new head context whose time is not a drafted token's cost
_JUDGE_AFTER = 3  # timed drafts before a request's measured cost may switch its head off


class HeadContext:
    """A head's context for every slot of an engine (sequence id = slot); see the module."""

    kind: ClassVar[str] = ""
    shift: ClassVar[int] = 0  # entry p holds the token at p + shift and the row at p + shift - 1

    def __init__(self, target: LlamaRuntime, n_slots: int, cost_prior: float, width: int):
        self.target = target
        self.method = self.kind
        self.n_slots = n_slots
        self.cost_prior = cost_prior  # a drafted token in target steps, until drafting measures it
        self.timed = 0  # drafts made (the first ones are not timed: see HeadDrafter.drafted)
        self.width = width
        self.api = ext()
        self.ctx: Any = None
        self.batch: ExtBatch | None = None
        self._threads = 0
        self._known: list[list[int]] = [[] for _ in range(n_slots)]
        self._rows = [np.zeros((0, width), np.float32) for _ in range(n_slots)]
        self._entries = [0] * n_slots
        self.n_vocab = target.facts.n_vocab
        # Seconds of one head decode by rows (the planner's shape of batched drafting), learned.
        self.costs = CostModel({1: 1e-3, 2: 1.1e-3, 4: 1.3e-3, 8: 1.8e-3, 16: 2.8e-3}, measured=False)

    # -- the context ---------------------------------------------------------------------------
    def _open(self, model: Any, mtp: bool) -> None:
        """A context on `model` linked to the target's (its memory, token embeddings), one sequence
        per slot, a plain attention cache (n_rs_seq 0: it drops any suffix)."""
        ll = self.api.ll
        rt = self.target
        cp = derived_params(rt.cparams, n_rs_seq=0, ctx_other=rt.ctx, n_threads=rt.threads, n_threads_batch=rt.threads,
                            **({"ctx_type": ll.LLAMA_CONTEXT_TYPE_MTP} if mtp else {}))
        self.ctx = ll.llama_init_from_model(model, cp)
        if not self.ctx:
            raise SpeculationError(f"{rt.path.name}: llama.cpp could not make the {self.kind} head's context")
        self._threads = rt.threads
        self.api.set_embeddings_nextn(self.ctx, True, True)  # each output row's hidden state: the next input
        self.memory = ll.llama_get_memory(self.ctx)
        self.n_batch = int(ll.llama_n_batch(self.ctx))
        self.batch = ExtBatch(self.ctx)

    def close(self) -> None:
        if self.batch is not None:
            self.batch.close()
            self.batch = None
        if self.ctx:
            self.api.ll.llama_free(self.ctx)
            self.ctx = None

    def _process(self, *, encode: bool = False) -> None:
        if self._threads != self.target.threads:  # follow the target's thread count (edgeinfer.cpu)
            self._threads = self.target.threads
            self.api.ll.llama_set_n_threads(self.ctx, self._threads, self._threads)
        assert self.batch is not None
        self.batch.process(encode=encode)

    # -- what a target decode hands over ----------------------------------------------------------
    def _target_rows(self, n: int) -> np.ndarray:
        """[n, width] rows of the target's last decode, one per batch row (a copy)."""
        raise NotImplementedError

    def after_decode(self, rows: DecodeRows) -> None:
        """The target decoded `rows`: keep their tokens and hidden rows by sequence and position.
        Never raises into the scheduler: a failure resets the head (it drafts nothing until the
        target's sequences are read again)."""
        try:
            aux = self._target_rows(len(rows))
            i, n = 0, len(rows)
            while i < n:
                s, j = rows.seqs[i], i
                while j + 1 < n and rows.seqs[j + 1] == s and rows.positions[j + 1] == rows.positions[j] + 1:
                    j += 1
                if 0 <= s < self.n_slots:
                    self._extend(s, rows.positions[i], rows.tokens[i : j + 1], aux[i : j + 1])
                i = j + 1
        except Exception:  # noqa: BLE001 - the head is an optimization: never the request's failure
            log.exception("%s head: reading the target's hidden states failed; head reset", self.kind)
            self.reset()

    def _extend(self, s: int, p0: int, tokens: list[int], aux: np.ndarray) -> None:
        known = self._known[s]
        if len(known) < p0:
            return  # positions it never saw (a decode outside the scheduler): behind until cut back
        if len(known) > p0:
            self._truncate(s, p0)
        self._store(s, p0, aux)
        known.extend(tokens)

    def _store(self, s: int, p0: int, rows: np.ndarray) -> None:
        """Keep `rows` as the rows of positions p0.. of slot s."""
        n = p0 + len(rows)
        buf = self._rows[s]
        if len(buf) < n:
            grown = np.zeros((max(n, 2 * len(buf), 64), self.width), np.float32)
            grown[: len(buf)] = buf
            self._rows[s] = buf = grown
        buf[p0:n] = rows

    def _ready(self, s: int) -> None:
        """Before drafting for slot s: every kept row in its final form (EAGLE-3: encoded)."""

    def _truncate(self, s: int, n_known: int) -> None:
        """Keep the first `n_known` tokens' rows and the cache entries they make."""
        del self._known[s][n_known:]
        valid = max(0, n_known - self.shift)
        if self._entries[s] > valid:
            self._seq_rm(s, valid)
            self._entries[s] = valid

    def _seq_rm(self, s: int, p0: int) -> None:
        if not self.api.ll.llama_memory_seq_rm(self.memory, s, p0, -1):
            raise SpeculationError(f"the {self.kind} head's cache refused to drop positions >= {p0} of sequence {s}")

    def reset(self) -> None:
        """Forget everything (the target's context was made again, or a failure)."""
        try:
            if self.ctx:
                self.api.ll.llama_memory_clear(self.memory, True)
        finally:
            self._known = [[] for _ in range(self.n_slots)]
            self._entries = [0] * self.n_slots

    def forget(self, slots: list[int]) -> None:
        """After a failure: nothing it holds is trusted (the slots share its context): a reset."""
        self.reset()

    def reusable(self, slot: int, cached: list[int]) -> int:
        """How much of the target's cached sequence the head can follow on (a new request reuses no
        more of it: the target reads the rest again and the head sees it)."""
        return common_prefix(self._known[slot], cached)

    def accept(self, slot: int, n_keep: int) -> None:
        """The target's sequence holds its first `n_keep` positions after a verification."""
        if len(self._known[slot]) > n_keep:
            self._truncate(slot, n_keep)

    # -- drafting ---------------------------------------------------------------------------------
    def draft(self, jobs: list[DraftJob]) -> None:
        """Fill each job's tokens (and q's): entries it is behind and the first draft step of every
        job in one decode, then one decode per drafted position. A job whose slot the head cannot
        follow drafts nothing; a failure drafts nothing (logged, head reset)."""
        t0 = time.perf_counter()
        forks = {id(j): j.sampler.fork(self.target) for j in jobs if j.sampler is not None and j.k > 0}
        started: list[tuple[int, int]] = []
        try:
            self._draft([j for j in jobs if j.k > 0], forks, started)
        except Exception:  # noqa: BLE001 - drafts are proposals: a failed draft is a plain step
            log.exception("%s head: drafting failed; head reset", self.kind)
            for j in jobs:
                j.tokens.clear()
                j.qs.clear()
            started.clear()
            self.reset()
        finally:
            for f in forks.values():
                f.close()
            for s, base in started:  # the drafted entries go: verification brings the true ones
                try:
                    self._seq_rm(s, base)
                except SpeculationError:
                    log.exception("%s head: could not drop its drafts", self.kind)
                    self.reset()
        per = (time.perf_counter() - t0) / max(len(jobs), 1)
        for j in jobs:
            j.seconds = per

    def _row(self, s: int, p: int) -> np.ndarray:
        return self._rows[s][p] if p >= 0 else np.zeros(self.width, np.float32)

    def _draft(self, jobs: list[DraftJob], forks: dict[int, Any], started: list[tuple[int, int]]) -> None:
        assert self.batch is not None
        batch, ll = self.batch, self.api.ll
        seeds: list[tuple[DraftJob, int, int]] = []  # job, slot, seed position
        n_pending = 0
        backlog: dict[int, int] = {}
        ready = []
        for j in jobs:
            s, n_t = j.slot, len(j.history) - 1  # the target holds history[:-1]; history[-1] is next
            known = self._known[s]
            if known[:n_t] != list(j.history[:n_t]):
                self._truncate(s, common_prefix(known, j.history[:n_t]))
                continue  # behind: nothing to draft from for this slot
            if len(known) > n_t:
                self._truncate(s, n_t)
            self._ready(s)
            ready.append(j)
        for j in ready:
            s, n_t = j.slot, len(j.history) - 1
            known = self._known[s]
            base = n_t - self.shift
            backlog[id(j)] = base - self._entries[s]
            for p in range(self._entries[s], base):  # entries it is behind, written now (no output)
                if n_pending + len(jobs) >= self.n_batch:
                    self._process()
                    n_pending = 0
                batch.add(known[p + self.shift], p, s, self._row(s, p + self.shift - 1), False)
                n_pending += 1
            self._entries[s] = base
            seeds.append((j, s, base))
            started.append((s, base))
        if not seeds:
            return
        # More entries than a verification brings (the head was idle, or a new prompt): their own
        # decode, timed apart, so a drafted token's measured cost stays a drafted token's.
        if any(backlog[id(j)] > j.k + 2 for j, _, _ in seeds):
            t = time.perf_counter()
            self._process()
            share = (time.perf_counter() - t) / len(seeds)
            for j, _, _ in seeds:
                j.catch_up_s = share
        outs: dict[int, int] = {}
        for j, s, base in seeds:
            outs[id(j)] = batch.add(j.history[-1], base, s, self._row(s, len(j.history) - 2), True)
        active = [(j, s, base) for j, s, base in seeds]
        step = 0
        while active:
            t = time.perf_counter()
            self._process()
            self.costs.observe(max(len(active), 1), time.perf_counter() - t, plain=False, prefill=True)
            nxt = []
            for j, s, base in active:
                idx = outs[id(j)]
                ptr = ll.llama_get_logits_ith(self.ctx, idx)
                h = self.api.get_embeddings_nextn_ith(self.ctx, idx)
                if not ptr or not h:
                    raise SpeculationError(f"the {self.kind} head's decode gave no output for row {idx}")
                logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
                tok = draft_token(logits, j, forks.get(id(j)))
                if tok is None:
                    continue
                j.tokens.append(tok)
                if len(j.tokens) < j.k:
                    row = np.ctypeslib.as_array(h, shape=(self.width,))
                    outs[id(j)] = batch.add(tok, base + step + 1, s, row, True)
                    nxt.append((j, s, base))
            active = nxt
            step += 1


class MtpHead(HeadContext):
    """The target's MTP layer in an MTP context (Qwen3.5: one `nextn` block after the trunk)."""

    kind = "mtp"
    shift = 0

    def __init__(self, target: LlamaRuntime, n_slots: int, cost_prior: float):
        if target.n_nextn < 1:
            raise SpeculationError(f"{target.path.name}: the MTP layer was not loaded with the model")
        n_embd = int(ext().ll.llama_model_n_embd_out(target.model))
        super().__init__(target, n_slots, cost_prior, n_embd)
        # Every row of the target's decodes hands over its final hidden state (unmasked: by batch row).
        self.api.set_embeddings_nextn(target.ctx, True, False)
        self._open(target.model, mtp=True)

    def _target_rows(self, n: int) -> np.ndarray:
        ptr = self.api.get_embeddings_nextn(self.target.ctx)
        if not ptr:
            raise SpeculationError("the target's decode kept no hidden states")
        return np.ctypeslib.as_array(ptr, shape=(n, self.width)).copy()


class Eagle3Head(HeadContext):
    """An EAGLE-3 drafter model (its own weights, the target's token embeddings through ctx_other)."""

    kind = "eagle3"
    shift = 1

    def __init__(self, target: LlamaRuntime, n_slots: int, cost_prior: float, model: Any, layers: list[int]):
        n_embd = int(ext().ll.llama_model_n_embd(model))
        super().__init__(target, n_slots, cost_prior, n_embd)
        self.model = model  # owned: freed by close()
        self.layers = layers
        n_layer = target.facts.n_layer
        for lid in layers:
            if lid < n_layer:
                self.api.set_embeddings_layer_inp(target.ctx, lid, True)
            else:  # == n_layer (checked by the caller): the final hidden state
                self.api.set_embeddings_nextn(target.ctx, True, False)
        self._waiting: list[list[np.ndarray]] = [[] for _ in range(n_slots)]  # layer inputs not yet encoded
        self._encoded = [0] * n_slots  # positions whose g is in _rows
        self._open(model, mtp=False)
        self._enc = ExtBatch(self.ctx)

    def _target_rows(self, n: int) -> np.ndarray:
        """The target layers' inputs, [n, 3 x n_embd] (encoded into g later: see _store)."""
        t = self.target
        parts = []
        for lid in self.layers:
            ptr = (self.api.get_embeddings_layer_inp(t.ctx, lid) if lid < t.facts.n_layer
                   else self.api.get_embeddings_nextn(t.ctx))
            if not ptr:
                raise SpeculationError(f"the target kept no input of layer {lid}")
            parts.append(np.ctypeslib.as_array(ptr, shape=(n, t.facts.n_embd)))
        return np.ascontiguousarray(np.concatenate(parts, axis=1), dtype=np.float32)

    # The encoder runs on what accumulated, not after every target decode (a call per step would
    # cost a small target a sixth of its speed): before a draft, or once this many rows wait.
    _ENCODE_EVERY = 64

    def _store(self, s: int, p0: int, rows: np.ndarray) -> None:
        self._waiting[s].append(rows)
        if sum(len(r) for r in self._waiting[s]) >= self._ENCODE_EVERY:
            self._ready(s)

    def _ready(self, s: int) -> None:
        if self._waiting[s]:
            feats = np.concatenate(self._waiting[s])
            self._waiting[s] = []
            super()._store(s, self._encoded[s], self._encode(feats))
            self._encoded[s] += len(feats)

    def _truncate(self, s: int, n_known: int) -> None:
        super()._truncate(s, n_known)
        if self._encoded[s] >= n_known:
            self._encoded[s] = n_known
            self._waiting[s] = []
        elif self._waiting[s]:
            keep = np.concatenate(self._waiting[s])[: n_known - self._encoded[s]]
            self._waiting[s] = [keep] if len(keep) else []

    def reset(self) -> None:
        super().reset()
        self._waiting = [[] for _ in range(self.n_slots)]
        self._encoded = [0] * self.n_slots

    def _encode(self, feats: np.ndarray) -> np.ndarray:
        """g = the drafter's encoder (fc) on fused target features, a row per position."""
        t = self.target
        n = len(feats)
        out = np.empty((n, self.width), np.float32)
        ll = self.api.ll
        for c in range(0, n, self.n_batch):
            chunk = feats[c : c + self.n_batch]
            pos = max(0, int(ll.llama_memory_seq_pos_max(self.memory, 0)) + 1)  # unused by the encoder
            for i, row in enumerate(chunk):
                self._enc.add(None, pos + i, 0, row, True)
            if self._threads != t.threads:
                self._threads = t.threads
                ll.llama_set_n_threads(self.ctx, self._threads, self._threads)
            self._enc.process(encode=True)
            g = self.api.get_embeddings_nextn(self.ctx)
            if not g:
                raise SpeculationError("the EAGLE-3 encoder gave no output")
            out[c : c + len(chunk)] = np.ctypeslib.as_array(g, shape=(len(chunk), self.width))
        return out

    def close(self) -> None:
        if getattr(self, "_enc", None) is not None:
            self._enc.close()
            self._enc = None
        super().close()
        if self.model:
            self.api.ll.llama_model_free(self.model)
            self.model = None


class HeadDrafter(ModelDrafter):
    """One request's head: its length policy, whether it can pay at all, and a drafted token's cost
    in target steps — first the prior from the weights a drafted token reads, then measured."""

    def __init__(self, context: HeadContext, policy: LengthPolicy, p_min: float):
        super().__init__(context, policy, p_min, context.method)  # type: ignore[arg-type]
        self.head = context
        self._timed = 0

    def start(self, target: Any, slot: int) -> None:
        if self.head.cost_prior > 0 and not self.measured:
            self.step_s = self.head.cost_prior * self.policy.costs.time(1)
        self._too_slow()

    def _too_slow(self) -> bool:
        # Judged on the prior, then only once a few drafts were timed: one slow step is not the head.
        return super()._too_slow() if not self.measured or self._timed >= _JUDGE_AFTER else not self.enabled

    def drafted(self, job: DraftJob) -> None:
        if not job.tokens:
            return
        per = (job.seconds - job.catch_up_s) / len(job.tokens)
        self.head.timed += 1
        if self.head.timed <= _WARMUP:
            return  # a new context's first decodes also allocate its graphs: not a drafted token's cost
        if self.step_s > 0:  # one slow step (preempted) moves the estimate at most 1.5x
            per = min(per, 1.5 * self.step_s)
        self.step_s = 0.8 * self.step_s + 0.2 * per if self.measured else per
        self.measured = True
        self._timed += 1
        self._too_slow()  # (each request starts from the prior again: a busy moment is not kept)


# -- priors: what a drafted token reads, as a share of what a target step reads ---------------------
def _bytes(info: GGUFInfo, pred: Any) -> int:
    return sum(t.n_bytes for t in info.tensors if pred(t.name))


def _output_bytes(info: GGUFInfo) -> int:
    out = _bytes(info, lambda n: n == "output.weight")
    return out or _bytes(info, lambda n: n == "token_embd.weight")  # tied: the embeddings are the output


def mtp_cost_prior(info: GGUFInfo, trunk_layers: int) -> float:
    """A drafted token of an MTP head in target steps, from the bytes each reads on a memory-bound
    CPU: the nextn block(s) and the output layer, over the trunk's blocks and the output layer.
    (Qwen3.5's output layer is most of what a small model's head reads: vocabulary 248k.)"""
    def block(n: str) -> int:
        return int(n.split(".")[1]) if n.startswith("blk.") else -1

    out = _output_bytes(info)
    head = _bytes(info, lambda n: block(n) >= trunk_layers) + out
    trunk = _bytes(info, lambda n: 0 <= block(n) < trunk_layers) + out
    return head / trunk if trunk else 0.3


def eagle3_cost_prior(drafter: GGUFInfo, target: GGUFInfo) -> float:
    """A drafted token of an EAGLE-3 drafter in target steps (bytes read, as mtp_cost_prior)."""
    trunk = _bytes(target, lambda n: n.startswith("blk.")) + _output_bytes(target)
    own = _bytes(drafter, lambda n: n != "token_embd.weight" and n != "d2t")
    return own / trunk if trunk else 0.3

