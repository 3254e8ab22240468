"""One request inside the scheduler core: its prompt, sampler, text and events, and the one place
where drafted tokens are verified and tokens are committed.

Verification holds both rules. Sample-and-match: the target samples each row in order and drafted
tokens are kept while they equal what it sampled — exact for any sampler settings when the drafts
are deterministic (prompt lookup, a greedy draft model). The rejection rule of speculative
sampling: when a draft model *sampled* its drafts from q (T > 0, no penalties), each drafted x is
kept with probability min(1, p(x)/q(x)), else the token is drawn from normalise(max(0, p − q)), so
every token is distributed exactly as plain sampling's; such a request draws all its tokens in
numpy with its one RNG (`Sampler.draw`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from .events import DoneEvent, Event, FinishReason, GenerationStats, PrefillProgress, ScoredTokenEvent, TokenEvent
from .options import GenerateOptions
from .sampler import Sampler, TokenDistribution, verify_sampled_draft
from .text import TextAssembler

if TYPE_CHECKING:
    from ..llama.runtime import LlamaRuntime
    from .sequence import KVSequence
    from ..speculation.request_speculation import RequestSpeculation

__all__ = ["RequestState", "EventSink"]

# The reader's side: called with each step's events, or with the error that ended the request.
EventSink = Callable[[list[Event], "BaseException | None"], None]


class RequestState:
    """Everything the core tracks for one request, from queued to done. The face that submitted it
    reads its events through `sink` (called by the core, on the core's thread, with each step's
    events) and cancels it with `cancel`."""

    def __init__(self, prompt: list[int], options: GenerateOptions, sink: EventSink, *,
                 logprobs: int | None = None, cancel: threading.Event | None = None, sampler: Sampler | None = None):
        self.prompt = prompt
        self.options = options
        self.sink = sink
        self.logprobs = logprobs
        self.cancel = cancel or threading.Event()
        self.stats = GenerationStats(prompt_tokens=len(prompt))
        self.t_submit = time.perf_counter()
        # Its sampler, made when the request was checked where it has a grammar (compiled once,
        # outside the scheduler thread), else when a slot takes it; the slot's sequence.
        self.sampler: Sampler | None = sampler
        self.seq: KVSequence | None = None
        self.speculation: RequestSpeculation | None = None
        self.fed = 0  # prompt tokens in the sequence's cache
        self.restore: np.ndarray | None = None  # logits row to put back after re-decoding a cached prompt
        self.t_admit = 0.0
        self.t_first = 0.0
        self.text = TextAssembler(options.stop)
        self.history: list[int] = list(prompt)
        self.generated: list[int] = []
        self.held: TokenEvent | None = None  # an event waits while its text is incomplete (see commit)
        self.out: list[Event] = []
        self.finish: FinishReason | None = None
        self.done: DoneEvent | None = None
        self.error: BaseException | None = None
        self.paused = False  # its reader is behind: no decoding until it catches up
        self.backlog: Callable[[], int] | None = None  # events its reader has not taken yet
        self.sampled_drafts = False  # a draft model samples its drafts: every token drawn in numpy

    # -- state -----------------------------------------------------------------------------------
    @property
    def admitted(self) -> bool:
        return self.seq is not None

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt)

    @property
    def finished(self) -> bool:
        return self.done is not None or self.error is not None

    def decode_tok_s(self) -> float:
        n = len(self.generated) - 1
        dt = time.perf_counter() - self.t_first
        return n / dt if self.t_first and n > 0 and dt > 0 else 0.0

    def flush(self) -> None:
        """Hand this step's events to the reader."""
        if self.out:
            out, self.out = self.out, []
            self.sink(out, None)

    # -- the prompt ------------------------------------------------------------------------------
    def prefill_progress(self) -> None:
        self.out.append(PrefillProgress(self.fed, len(self.prompt)))

    def prompt_done(self, rt: LlamaRuntime, row: int) -> None:
        """The prompt is in the cache and `row` holds its last logits: sample the first token."""
        assert self.seq is not None and self.sampler is not None
        if self.restore is not None:
            rt.logits_row(row)[:] = self.restore
        self.seq.saved_logits = (list(self.prompt), rt.logits_row(row).copy())
        now = time.perf_counter()
        self.stats.prefill_s = now - self.t_admit
        self.sampler.prime(self.prompt)
        sample = self.sampler.draw if self.sampled_drafts else self.sampler.sample
        self.commit(rt, [(sample(row), False, row)])
        self.t_first = time.perf_counter()
        self.stats.ttft_s = self.t_first - self.t_submit

    # -- a decoding step -------------------------------------------------------------------------
    def verify(self, rt: LlamaRuntime, first_row: int, drafts: list[int],
               qs: list[TokenDistribution] | None) -> int:
        """Sample the rows of this step (the last token's, then one per drafted token), keep drafts
        by the rule that fits (see the module), drop the rejected suffix from the cache and commit.
        Returns how many drafts were kept."""
        assert self.seq is not None and self.sampler is not None
        sampler = self.sampler
        sample = sampler.draw if self.sampled_drafts else sampler.sample
        self.seq.committed([self.history[-1], *drafts])
        pending: list[tuple[int, bool, int]] = []
        n_ok = 0
        for i in range(len(drafts) + 1):
            row = first_row + i
            if qs is not None and i < len(drafts):
                kept, tok = verify_sampled_draft(sampler.distribution(row), qs[i], drafts[i], sampler.rng)
                sampler.accept(tok)  # grammar and penalty window advance by the committed token
            else:  # sample-and-match (the bonus token: a plain sample from p)
                tok = sample(row)
                kept = i < len(drafts) and tok == drafts[i]
            pending.append((tok, kept, row))
            if not kept:
                break
            n_ok += 1
        if n_ok < len(drafts):
            self.seq.drop_suffix(len(self.history) + n_ok)
        self.commit(rt, pending)
        return n_ok

    def commit(self, rt: LlamaRuntime, pending: list[tuple[int, bool, int]]) -> None:
        """Turn sampled tokens into events; decide whether the request is finished."""
        opts = self.options
        for tok, drafted, row in pending:
            if rt.is_eog(tok):
                self.finish = "eos"
                break
            self.history.append(tok)
            self.generated.append(tok)
            text, stopped = self.text.push(rt.piece(tok))
            if self.held is not None:
                self.out.append(self.held)
                self.held = None
            event = self._event(rt, tok, text, drafted, row)
            if self.text.pending:  # text still held back ends up in this event (see end)
                self.held = event
            else:
                self.out.append(event)
            if stopped:
                self.finish = "stop"
                break
            if len(self.generated) >= opts.max_tokens:
                self.finish = "length"
                break
        self.stats.generated_tokens = len(self.generated)

    def _event(self, rt: LlamaRuntime, tok: int, text: str, drafted: bool, row: int) -> TokenEvent:
        top_n = self.logprobs
        if top_n is None:
            return TokenEvent(tok, text, drafted)
        logits = rt.logits_row(row)
        m = float(logits.max())
        lse = m + float(np.log(np.exp(logits - m, dtype=np.float32).sum()))
        top: tuple[tuple[int, float], ...] = ()
        if top_n:
            idx = np.argpartition(-logits, top_n)[:top_n]
            idx = idx[np.argsort(-logits[idx], kind="stable")]
            top = tuple((int(i), float(logits[i]) - lse) for i in idx)
        return ScoredTokenEvent(tok, text, drafted, float(logits[tok]) - lse, top)

    # -- the end ---------------------------------------------------------------------------------
    def end(self, reason: FinishReason | None = None) -> DoneEvent:
        """Finish: the held event (with any text released only now), then the DoneEvent."""
        if self.done is not None:
            return self.done
        finish = reason or self.finish or "cancelled"
        tail = self.text.flush()
        if self.held is not None:
            self.out.append(replace(self.held, text=self.held.text + tail))
            self.held = None
        self.stats.generated_tokens = len(self.generated)
        self.stats.decode_s = time.perf_counter() - self.t_first if self.generated and self.t_first else 0.0
        self.done = DoneEvent(self.text.text, list(self.generated), finish, self.stats)
        self.out.append(self.done)
        return self.done

    def fail(self, error: BaseException) -> None:
        """End with an error instead of a DoneEvent (events not yet handed over are dropped)."""
        self.error = error
        self.out.clear()
        self.sink([], error)

    def release(self) -> None:
        """Free what the request holds besides its slot (sampler, drafter state)."""
        if self.speculation is not None:
            self.speculation.close()
        if self.sampler is not None:
            self.sampler.close()
