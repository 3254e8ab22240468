"""The scheduler core: N slots of one llama.cpp context, stepped by whoever owns it.

It owns no thread. Each `step()` admits waiting requests into free slots (the slot whose cache
shares the longest prefix with the prompt), gives prompts their prefill chunks, plans the drafts of
every decoding request from the measured cost curve, runs ONE `llama_decode` holding all of it,
then verifies and commits. Both engine faces step it: `Engine` inline with one slot (a generation
steps it from its own `next()`), `BatchEngine` from a scheduler thread with N slots. In the spirit
of llama.cpp's server (`server_slot`, one shared batch, one draft context whose sequence id is the
slot) and vLLM's scheduler (no separate prefill and decode phases: each request tracks what of it
is computed, and one budget of rows per step covers prompt chunks, decode tokens and drafts).

Prefill is scheduled by the cost curve, not a fixed count: a step takes prompt rows up to the
curve's knee, the smallest chunk whose cost per row is within 5 % of the best the measured curve
shows up to n_batch (the whole ubatch while the curve is only a prior, as llama-server fills its
ubatch). With a KV stream per slot a step's prompt rows are one ubatch: prompts read together take
equal rows on neighbouring sequence ids, and a prompt whose rows left would be fewer than a chunk
reads them with it (a few rows beside a chunk cost a pass over the weights of their own: 2.65 vs
2.2 s for 48 rows of the 1.5B on the slow machine).

Running streams sit the steps that read prompts out for up to `decode_wait` seconds (BatchOptions:
10), taking the next one once the steps they sat out and the next chunk's predicted cost would pass
it. Why wait: with a KV stream per slot the decoding rows are a ubatch of their own beside the chunk
(a weight pass, not a free ride as on a GPU: 4 rows cost ≈ 9 % of a chunk's step), and streams
that start decoding one chunk apart end one chunk apart, in small, dear batches; streams that wait
for the prompts that came with them decode together, as llama-server's do. Why a bound: a long
prompt arriving must not stall every running stream for minutes (llama-server's wait for a whole
n_batch of prompt rows: 2,048, ≈ 25 s for the 1.5B on a 2-core machine reading 156 prompt tokens a
second, over a minute on one reading 22). The prompts submitted before a stream's first token came
with it: it waits for those as llama-server's streams do, up to what 2,048 prompt rows cost by the
curve (on the slow machine 10 s is ~210 rows, and eight clients' tails were read one prompt a step).
While streams sit a step out they need no room in it, so prompts join the chunk up to n_batch rows.
With one KV cache for every slot the rows share the chunk's ubatch, and decoding requests take
every step.

Faults stay where they happen: an exception while verifying one request ends that request with an
error (its reader gets it); a failed decode ends the requests that had rows in it; a drafter that
fails (a draft model's or a head's decode, a policy) switches off the speculation of the requests
it drafts for, which go on plain (drafting.py: the drafting part of a step).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ...errors import EdgeInferError
from .events import SpeculationStats
from ..llama.runtime import DecodeAborted, DecodeRows, LlamaRuntime, ubatch_rows
from .options import SpeculationOptions
from .request import RequestState
from .sampler import Sampler
from .sequence import KVSequence, common_prefix
from ..speculation.draft_model import DraftContext
from ..speculation.request_speculation import Proposal, RequestSpeculation
from ..speculation.heads import HeadContext
from ..speculation.policy import CostModel
from ..speculation.suffix import SuffixMemory
from . import drafting

__all__ = ["Scheduler", "Slot", "StepCounters"]

log = logging.getLogger(__name__)

# llama-server reads up to n_batch prompt rows (2,048 by default) in a step its running streams wait for
PEER_BATCH_ROWS = 2048

# Methods whose requests draft from, and add to, the model's memory of earlier answers.
_REMEMBERING = ("suffix", "auto")

DraftSource = Callable[[SpeculationOptions], "DraftContext | HeadContext | None"]
HeadSource = Callable[[], "list[HeadContext]"]


@dataclass
class Slot:
    """One sequence of the context and the request it serves."""

    index: int
    seq: KVSequence
    request: RequestState | None = None
    last_used: float = 0.0
    decode_tok_s: float = 0.0  # the last request's decode speed here


@dataclass
class StepCounters:
    """Totals since the core started (for metrics)."""

    steps: int = 0
    rows: int = 0
    drafted: int = 0
    accepted: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated: int = 0


class Scheduler:
    """See the module docstring. Not thread-safe: one owner steps it; `submit` and `cancel`
    flags may come from elsewhere only through the owner (the faces take care of that)."""

    def __init__(self, runtime: LlamaRuntime, n_slots: int, costs: CostModel, *,
                 drafts: DraftSource | None = None, abortable: bool = False, margin: float = 0.03,
                 draft_max_rows: int = 64, max_backlog: int | None = None, prefill_chunk: int | None = None,
                 heads: HeadSource | None = None, decode_wait: float = 0.0, memory: SuffixMemory | None = None):
        self.runtime = runtime
        self.slots = [Slot(i, KVSequence(runtime, i)) for i in range(n_slots)]
        self.slot_ctx = runtime.n_ctx // n_slots
        # A KV stream per slot (llama-server's layout with -np N): a row attends over its own
        # sequence only, but a batch is cut into ubatches of equal rows per sequence over
        # consecutive ids (llama.ubatch_rows); admission keeps the busy slots packed from 0 and
        # the planner counts every extra ubatch a draft would cause.
        self.split = n_slots > 1 and not runtime.kv_unified
        self.costs = costs
        self.drafts = drafts
        self.heads = heads  # drafting heads: each sees every row the target decodes (speculation/heads.py)
        self.abortable = abortable  # a cancel may interrupt a decode (one request at a time only)
        self.margin = margin
        self.draft_max_rows = draft_max_rows
        self.max_backlog = max_backlog  # unread events after which a request pauses (its reader is behind)
        self.prefill_chunk = prefill_chunk  # a cap on prompt rows per step while others decode
        self.decode_wait = decode_wait  # while prompts are read, the longest a decoding request waits (s)
        self._waited = 0.0  # seconds of prompt-only steps since the decoding requests last took one
        self.waiting: list[RequestState] = []
        self.active: list[RequestState] = []  # in admission order: prompts are fed first come, first served
        self.counters = StepCounters()
        self.finished: dict[str, int] = {}
        # Earlier answers of this model, per scope, for the suffix drafter (speculation/suffix.py;
        # the faces give one kept on disk when LoadOptions.suffix_memory says so).
        self.memory = memory if memory is not None else SuffixMemory()

    # -- requests --------------------------------------------------------------------------------
    def submit(self, req: RequestState) -> None:
        self.waiting.append(req)

    def depth(self) -> int:
        """The context a step's rows attend over: every cell the slots' caches hold in one unified
        KV cache (a row's attention spans them all, masked); with a stream per slot, a row's own
        sequence (the mean over the running requests)."""
        if not self.split:
            return sum(len(s.seq) for s in self.slots)
        lengths = [len(r.seq) for r in self.active if r.seq is not None]
        return sum(lengths) // len(lengths) if lengths else 0

    def step_cost(self, shape: list[tuple[int, int]]) -> float:
        """Seconds of one decode of these (sequence id, rows), in sequence order, by the curve:
        each ubatch llama.cpp will cut it into costs a step of its own."""
        return sum(self.costs.time(n) for n in ubatch_rows(shape, self.runtime.n_batch, not self.split))

    def idle_sequence(self) -> KVSequence | None:
        """An empty sequence of a free slot, while nothing runs: what the idle calibration may decode
        on. A slot's cache (a prefix for the next request, a restored conversation) is never given
        up for it: with every slot holding one, the curve is learned from the steps taken instead."""
        if self.active or self.waiting:
            return None
        return next((s.seq for s in self.slots if len(s.seq) == 0), None)

    def _pause_slow_readers(self) -> None:
        if self.max_backlog is not None:
            for r in self.active:
                r.paused = r.backlog is not None and r.backlog() >= self.max_backlog

    def has_work(self) -> bool:
        if any(r.cancel.is_set() for r in self.waiting):
            return True
        if self.waiting and any(s.request is None for s in self.slots):
            return True
        self._pause_slow_readers()
        return any(r.cancel.is_set() or r.prefilling or not r.paused for r in self.active)

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> bool:
        """Admit, plan, decode once, verify, commit. False when there was nothing to do."""
        self._admit()
        for r in [r for r in self.active if r.cancel.is_set() or r.finish is not None]:
            self._finish(r, "cancelled" if r.finish is None else r.finish)
        self._close_gap()
        self._pause_slow_readers()
        decoding = [r for r in self.active if not r.prefilling and not r.paused]
        prefilling = [r for r in self.active if r.prefilling]
        if not decoding and not prefilling:
            return False
        rt = self.runtime
        depth = self.depth()
        self.costs.at(depth)
        chunks = self._prefill_chunks(prefilling, len(decoding))
        held = False  # the decoding requests sit this step out (see the module: prefill)
        if decoding and chunks and self.split and self.decode_wait > 0:
            chunks, held = self._held_chunks(prefilling, decoding, chunks)
        if held:
            decoding = []
        else:
            self._waited = 0.0
        proposals = drafting.plan(self, decoding, chunks)

        # Rows in sequence order: with a stream per slot, consecutive ids share a ubatch.
        rows = DecodeRows()
        firsts = [0] * len(decoding)
        drafts: list[list[int]] = [[] for _ in decoding]
        prompt_rows = [0] * len(chunks)
        order = sorted([(r.seq.seq_id, 0, i) for i, r in enumerate(decoding)]  # type: ignore[union-attr]
                       + [(r.seq.seq_id, 1, j) for j, (r, _) in enumerate(chunks)])  # type: ignore[union-attr]
        shape: list[tuple[int, int]] = []
        for seq_id, is_prompt, i in order:
            start = len(rows)
            if is_prompt:
                r, n = chunks[i]
                r.seq.rows(r.prompt[r.fed : r.fed + n], n - 1 if r.fed + n == len(r.prompt) else None,  # type: ignore[union-attr]
                           into=rows)
                prompt_rows[i] = len(rows) - 1
            else:
                r, p = decoding[i], proposals[i]
                drafts[i] = p.tokens[: p.k] if p is not None else []
                firsts[i] = start
                r.seq.rows([r.history[-1], *drafts[i]], 0, into=rows)  # type: ignore[union-attr]
            shape.append((seq_id, len(rows) - start))

        drafting.heads_before_decode(self, rows)
        t0 = time.perf_counter()
        try:
            if self.abortable and chunks:
                with rt.abortable():
                    rt.decode_batch(rows)
            else:
                rt.decode_batch(rows)
        except DecodeAborted:
            for r in decoding + [r for r, _ in chunks]:
                if r.cancel.is_set():
                    self._finish(r, "cancelled")
            return True
        except Exception as e:  # noqa: BLE001 - the requests in this decode fail, not the engine
            log.exception("decode failed")
            for r in decoding + [r for r, _ in chunks]:
                self._fail(r, e)
            return True
        drafting.heads_after_decode(self, rows)  # the hidden states of every row, prompt chunks included
        self.counters.steps += 1
        self.counters.rows += len(rows)

        for (r, n), last in zip(chunks, prompt_rows):
            self._isolated(r, self._prompt_chunk, r, n, last)
        kept = [0] * len(decoding)
        for i, (r, first, d, p) in enumerate(zip(decoding, firsts, drafts, proposals)):
            kept[i] = self._isolated(r, self._verify, r, first, d, p) or 0
        step_s = time.perf_counter() - t0
        if held:
            self._waited += step_s
        # Drafters start once every row of this decode has been read (a draft model's first use
        # times a decode of the target: it would overwrite the logits of the others' rows).
        for r, _ in chunks:
            if r.speculation is not None and not r.prefilling and r in self.active:
                self._isolated(r, r.speculation.start, r.seq, r.seq.seq_id)  # type: ignore[union-attr]
        n_drafted = sum(len(d) for d in drafts)
        one_ubatch = len(ubatch_rows(shape, rt.n_batch, not self.split)) == 1
        if not chunks and one_ubatch:  # (a prompt chunk's step says little of the decode sizes drafting
            # plans with, and the prefill budget keeps the calibration's curve: a noisy step must not
            # move it; a step cut into several ubatches is not the cost of its row count)
            self.costs.observe(len(rows), step_s, depth=depth, plain=n_drafted == 0)
        for r, d, p, n_ok in zip(decoding, drafts, proposals, kept):
            if r.speculation is not None and r in self.active:
                plain_s = step_s
                if d:  # what the step would have cost without this draft
                    mine = r.seq.seq_id  # type: ignore[union-attr]
                    plain_s = self.step_cost([(q, n - len(d) if q == mine else n) for q, n in shape])
                drafting.observe(r, p if d else None, len(d), n_ok, step_s, plain_s)
        for r in [r for r in self.active if r.finish is not None]:
            self._finish(r, r.finish)
        for r in self.active:
            r.flush()
        return True

    # -- prefill ---------------------------------------------------------------------------------
    def _prefill_chunks(self, prefilling: list[RequestState], n_decoding: int,
                        held: bool = False) -> list[tuple[RequestState, int]]:
        """Prompt rows this step, first come first served: up to the cost curve's knee, capped by
        `prefill_chunk` while others decode (see the module). With one KV cache prompts fill the
        budget in turn. With a KV stream per slot the step stays ONE ubatch (`ubatch_rows`: equal
        rows per sequence over consecutive ids): another prompt joins only with as many rows on a
        neighbouring sequence id, up to the knee while others decode and up to n_batch while none
        does or they are `held`; and a prompt whose rows left after the chunk would be fewer than
        the chunk takes them now (a short tail is a dear step of its own)."""
        rt = self.runtime
        room = rt.n_batch - n_decoding
        budget = min(room, self.costs.prefill_knee(rt.n_batch))
        capped = bool(n_decoding and self.prefill_chunk)
        if capped:
            budget = min(budget, self.prefill_chunk)  # type: ignore[type-var]
        if not prefilling or budget <= 0:
            return []
        if not self.split:
            chunks = []
            for r in prefilling:
                if budget <= 0:
                    break
                n = min(budget, len(r.prompt) - r.fed)
                chunks.append((r, n))
                budget -= n
            return chunks
        head = prefilling[0]
        left = len(head.prompt) - head.fed
        n = min(budget, left)
        if left - n < n and left <= (budget if capped else room):
            n = left
        cap = budget if n_decoding and not held else room
        by_seq = {r.seq.seq_id: r for r in prefilling}  # type: ignore[union-attr]
        run = [head]
        for step in (1, -1):  # neighbours above the head's sequence id, then below
            seq = head.seq.seq_id + step  # type: ignore[union-attr]
            while (len(run) + 1) * n <= cap and seq in by_seq and len(by_seq[seq].prompt) - by_seq[seq].fed >= n:
                run.append(by_seq[seq])
                seq += step
        return [(r, n) for r in run]

    def _held_chunks(self, prefilling: list[RequestState], decoding: list[RequestState],
                     chunks: list[tuple[RequestState, int]]) -> tuple[list[tuple[RequestState, int]], bool]:
        """The prompt rows of a step the decoding requests sit out, and whether they do (a KV
        stream per slot). Sitting out, they need no room in the step: prompts join the chunk up to
        n_batch rows (fewer if the wait allows fewer; never beyond `prefill_chunk`). The wait is
        `decode_wait` for prompts that arrived while the streams decoded; prompts submitted before
        every decoding request's first token came with them, and they wait for those as
        llama-server's streams do, for up to `PEER_BATCH_ROWS` prompt rows."""
        wide = chunks if self.prefill_chunk else self._prefill_chunks(prefilling, len(decoding), held=True)
        started = min(r.t_first for r in decoding)
        peer_wait = self.costs.time(self.runtime.n_batch) * PEER_BATCH_ROWS / self.runtime.n_batch
        for k in range(len(wide), len(chunks) - 1, -1):  # the knee's run is a prefix of the wide one
            run = wide[:k]
            came_with = all(r.t_submit <= started for r, _ in run)
            bound = max(self.decode_wait, peer_wait) if came_with else self.decode_wait
            if self._waited + self.step_cost(sorted((r.seq.seq_id, n) for r, n in run)) <= bound:  # type: ignore[union-attr]
                return run, True
        return chunks, False

    def _prompt_chunk(self, r: RequestState, n: int, last_row: int) -> None:
        assert r.seq is not None
        r.seq.committed(r.prompt[r.fed : r.fed + n])
        first_chunk = r.fed == r.stats.cached_tokens
        r.fed += n
        if r.prefilling or not first_chunk:  # a prompt that takes more than one step
            r.prefill_progress()
        if not r.prefilling:
            r.prompt_done(self.runtime, last_row)

    # -- decoding --------------------------------------------------------------------------------
    def _verify(self, r: RequestState, first: int, drafts: list[int], p: Proposal | None) -> int:
        qs = p.job.qs[: len(drafts)] if p is not None and p.job is not None and r.sampled_drafts and drafts else None
        n_ok = r.verify(self.runtime, first, drafts, qs)
        self.counters.drafted += len(drafts)
        self.counters.accepted += n_ok
        if r.finish is None and r.seq is not None and len(r.seq) >= self.slot_ctx:
            r.finish = "length"  # no position left for the next token
        return n_ok

    def _isolated(self, r: RequestState, fn: Callable[..., int | None], *args: object) -> int | None:
        """Run one request's part of a step; an exception ends that request only."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - isolated on purpose
            log.exception("request failed")
            self._fail(r, e)
            return None

    # -- admission -------------------------------------------------------------------------------
    def _admit(self) -> None:
        for r in [r for r in self.waiting if r.cancel.is_set()]:
            self.waiting.remove(r)
            r.end("cancelled")
            self._count("cancelled")
            r.flush()
            r.release()
        free = [s for s in self.slots if s.request is None]
        while self.waiting and free:
            r = self.waiting.pop(0)
            slot = max(free, key=lambda s: (common_prefix(s.seq.cached, r.prompt), -s.last_used))
            try:
                if self.split:
                    slot = self._packed(slot, free, r.prompt)
                free.remove(slot)
                self._start(r, slot)
            except Exception as e:  # noqa: BLE001 - this request fails, not the ones queued behind it
                log.exception("could not start a request")
                self._fail(r, e)

    def _packed(self, chosen: Slot, free: list[Slot], prompt: list[int]) -> Slot:
        """With a stream per slot: the lowest free slot, holding what `chosen` (the best prefix, else
        the least recently used) holds, so that busy slots stay packed from 0 (a gap costs every
        step a ubatch) and the cache given up is the one the choice would have given up."""
        lowest = min(free, key=lambda s: s.index)
        if chosen is lowest:
            return lowest
        if common_prefix(chosen.seq.cached, prompt) > common_prefix(lowest.seq.cached, prompt):
            spares = [s for s in free if s is not chosen and s is not lowest]
            if lowest.seq.cached and spares:  # keep the lowest's cache in the least recently used spare
                self._given_up(spares).seq.copy_from(lowest.seq)
            lowest.seq.copy_from(chosen.seq)
        elif lowest.seq.cached:
            chosen.seq.copy_from(lowest.seq)  # `chosen` is the one given up
        return lowest

    @staticmethod
    def _given_up(spares: list[Slot]) -> Slot:
        """The free slot whose cache is worth least: an empty one, else the least recently used."""
        return min(spares, key=lambda s: (len(s.seq) > 0, s.last_used))

    def _close_gap(self) -> None:
        """With a stream per slot and nothing waiting: the request in the highest busy slot moves
        down into a free slot below it, so that the busy slots stay one run of ids. llama.cpp cuts a
        batch at every gap in the ids, and each cut costs every later step a ubatch (the 1.5B here:
        5 rows over slots 1, 3 and 5-7 take 0.33 s a step, 8 packed rows 0.23 s). The free slot's
        cache is kept in another free slot (the least recently used one's is given up, as
        admission does); with no such slot, or a drafter holding the request's sequence id (a
        draft model, a head), nothing moves."""
        if not self.split or self.waiting:
            return
        free = [s for s in self.slots if s.request is None]
        busy = [s for s in self.slots if s.request is not None]
        if not free or not busy:
            return
        hole = min(free, key=lambda s: s.index)
        top = max(busy, key=lambda s: s.index)
        r = top.request
        assert r is not None
        spares = [s for s in free if s is not hole]
        if (hole.index > top.index or (r.speculation is not None and r.speculation.model is not None)
                or (hole.seq.cached and not spares)):
            return
        if hole.seq.cached:
            spare = self._given_up(spares)
            spare.seq.copy_from(hole.seq)
            spare.last_used = hole.last_used
        hole.seq.copy_from(top.seq)
        hole.request, top.request = r, None
        top.last_used = time.monotonic()
        r.seq = hole.seq

    def _start(self, r: RequestState, slot: Slot) -> None:
        rt = self.runtime
        slot.request = r
        r.seq = slot.seq
        r.t_admit = time.perf_counter()
        r.stats.queue_s = r.t_admit - r.t_submit
        self.active.append(r)
        if r.sampler is None:  # (a request with a grammar brings the one compiled when it was checked)
            r.sampler = Sampler.for_request(rt, r.options)
        spec = r.options.speculation
        if spec.method != "off" and (not rt.facts.recurrent or rt.n_rs_seq > 0):
            stats = SpeculationStats()
            draft = self.drafts(spec) if self.drafts is not None else None
            remembers = spec.method in _REMEMBERING
            r.speculation = RequestSpeculation(spec, self.costs, stats, draft, r.sampler,
                                               self.memory.corpus(spec.memory_scope) if remembers else None)
            stats.method = r.speculation.method
            r.stats.speculation = stats
            r.sampled_drafts = r.speculation.sampled
        elif spec.method != "off":  # a recurrent/hybrid context without rollback snapshots: plain, and said
            r.stats.speculation = SpeculationStats(method=spec.method, note="speculation off: this model's recurrent "
                                                   "memory cannot drop a rejected draft (no rollback snapshots)")
        prompt, seq = r.prompt, slot.seq
        n_keep = common_prefix(seq.cached, prompt)
        if r.speculation is not None:  # a head follows on only from what it saw
            n_keep = min(n_keep, r.speculation.reusable(seq))
        saved = seq.saved_logits
        restorable = saved is not None and saved[0] == prompt
        if n_keep == len(prompt) and restorable and seq.truncate(len(prompt)) == len(prompt):
            # The same prompt again (a regenerate, a seed sweep): nothing is decoded; its remembered
            # last logits row goes where the sampler reads, the last decode's output row.
            seq.saved_logits = saved
            if self._restore_last_row(saved[1]):  # type: ignore[index]
                r.fed = r.stats.cached_tokens = len(prompt)
                self._count_prompt(r)
                r.prompt_done(rt, -1)
                if r.speculation is not None:
                    r.speculation.start(seq, seq.seq_id)
                return
        if n_keep == len(prompt):
            n_keep -= 1  # the last prompt token is decoded again for its logits...
            if restorable:
                r.restore = saved[1]  # type: ignore[index]  # ...and the saved row put back (same request, same answer)
        n_keep = seq.truncate(n_keep)
        if restorable and r.restore is not None:
            seq.saved_logits = saved  # the truncation forgot it
        r.fed = n_keep
        r.stats.cached_tokens = n_keep
        self._count_prompt(r)

    def _count_prompt(self, r: RequestState) -> None:
        self.counters.prompt_tokens += len(r.prompt)
        self.counters.cached_tokens += r.fed

    def _restore_last_row(self, row) -> bool:  # noqa: ANN001 - a numpy row
        """Write `row` into the last decode's output row; False when that decode left none."""
        try:
            self.runtime.logits_row(-1)[:] = row
        except IndexError:
            return False
        return True

    # -- the end ---------------------------------------------------------------------------------
    def _finish(self, r: RequestState, reason: str | None) -> None:
        if r.finished and r not in self.active:
            return
        r.end(reason)  # type: ignore[arg-type]
        self._count(r.done.finish_reason if r.done is not None else "cancelled")
        spec = r.options.speculation
        if spec.method in _REMEMBERING and r.speculation is not None:  # (a failed request's tokens are not kept)
            self.memory.remember(spec.memory_scope, r.prompt, r.generated)
            self.memory.save()  # to disk, when kept there: at most every keeper.interval seconds
        self.counters.generated += len(r.generated)
        self._free(r)
        r.flush()

    def _fail(self, r: RequestState, error: BaseException) -> None:
        """End a request with an error; what its sequence holds is no longer trusted."""
        if r.seq is not None:
            try:
                r.seq.clear()
            except Exception:  # noqa: BLE001
                log.exception("could not clear sequence %d", r.seq.seq_id)
        if r in self.waiting:
            self.waiting.remove(r)
        self._free(r)
        self._count("error")
        r.out.clear()
        if not isinstance(error, EdgeInferError):
            error = EdgeInferError(f"generation failed: {type(error).__name__}: {error}")
        r.fail(error)

    def _free(self, r: RequestState) -> None:
        if r in self.active:
            self.active.remove(r)
        for s in self.slots:
            if s.request is r:
                s.request = None
                s.last_used = time.monotonic()
                s.decode_tok_s = r.stats.decode_tok_s
        r.release()

    def _count(self, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1
