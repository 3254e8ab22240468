"""Parallel sequences in one llama.cpp context: continuous batching for servers.

A `BatchEngine` owns one context with N slots (llama.cpp sequence ids 0..N-1, one unified KV
cache whose cells are shared, each slot limited to n_ctx / N positions so the cache can never
overflow). A single scheduler thread runs the decode loop; any number of threads submit requests
with `submit()` / `generate()` / `chat()` and read their events from the returned
`BatchGeneration`, an iterator like `Generation`. Each step is ONE `llama_decode` holding, for
every active request, either its next token (plus drafted tokens) or a chunk of its prompt:

- continuous batching: a request joins between two steps as soon as a slot is free;
- chunked prefill: while others decode, a long prompt enters `prefill_chunk` tokens per step, so
  the running requests keep producing tokens instead of waiting for a whole prefill;
- prompt-prefix reuse: a finished slot keeps its KV cache; a new request goes to the free slot
  whose cached tokens share the longest prefix with its prompt and decodes only the rest;
- batch-aware prompt lookup: drafted rows join the same decode. How many rows pay is decided for
  the whole batch from a *measured* cost curve t(R) of a decode with R rows: the rows are taken
  in order of expected gain while (tokens expected) / t(rows) improves. On a CPU a decode is
  memory-bound for small R (extra rows are nearly free) and compute-bound beyond a few rows (each
  row costs its share), so drafts shrink as more requests decode and stop where they do not pay
  — that comes out of the measured curve, not out of a rule.

Why a separate class rather than a concurrent `Engine`: `Engine` serves one user with the whole
context (n_seq_max = 1): its generation is a generator that owns the context while it runs, which
is what makes its extras simple — cancel inside a long prefill through llama.cpp's abort
callback, a draft model in its own context, restoring the prompt's logits row. Interleaving
requests changes each of these (a shared decode per step, positions per sequence, a scheduler
thread that owns the context, prefill in chunks instead of an abortable one, draft lengths sized
for the batch), and the context itself is shaped differently (N sequences, unified KV, n_ctx
split per slot). Keeping both paths in one class would make the single-user path pay for a
scheduler thread hop per token, and mix two sets of invariants; the two share the low-level
layer (llama.py), the sampler, the text assembler, the events and the speculation models.

Speculation here is prompt lookup only (per slot n-gram index, the same `NgramIndex` as
`Engine`'s); "auto" means lookup. A draft model would need a second batched context: requests
for it are refused with an `InvalidOptionError`.
"""

from __future__ import annotations

import collections
import heapq
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ContextLengthError, EdgeInferError, InvalidOptionError
from ..gguf_file import GGUFInfo
from ..store import ModelManifest, Store
from ..validate import admit
from .chat import CHATML_TEMPLATE, Message, render_chat
from .events import DoneEvent, Event, FinishReason, GenerationStats, SpeculationStats, TokenEvent
from .llama import LlamaRuntime
from .options import GenerateOptions, LoadOptions
from .sampler import Sampler
from .speculation.lookup import NgramIndex
from .speculation.policy import AcceptanceModel, CostModel
from .text import TextAssembler

__all__ = [
    "BatchEngine",
    "BatchOptions",
    "BatchGeneration",
    "BatchMetrics",
    "SlotMetrics",
    "ScoredTokenEvent",
    "plan_drafts",
]

log = logging.getLogger(__name__)

# Batch sizes timed when the engine starts: both sides of the usual kernel tile edges, then
# coarser up to a full prefill chunk; other sizes are interpolated, then learned step by step.
_CALIBRATION_ROWS = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 17, 24, 32, 33, 48, 64, 96, 128)
_RETIMED_ROWS = 16  # sizes up to this are timed twice (the fastest kept): short decodes are noisy
# Acceptance priors of lookup drafts: the same values Engine's policy uses (chosen by replaying
# recorded outputs, see benchmarks/replay_speculation.py): 0.7 fresh, 0.9 inside a copied run.
_PRIOR_FRESH, _PRIOR_RUN = 0.7, 0.9
_WEAK_MATCH_QUALITY = 0.8  # a 2-gram match is weaker evidence than a longer one


@dataclass(frozen=True)
class BatchOptions:
    """How a BatchEngine schedules: slots, prefill chunking, per-request buffering."""

    parallel: int = 4  # slots = sequences decoded together; the context is split between them
    prefill_chunk: int = 128  # prompt tokens per step while other requests are decoding
    max_backlog: int = 256  # unread events after which a request pauses (a slow reader)
    draft_max: int = 16  # most drafted rows per slot and step
    margin: float = 0.03  # drafting must beat not drafting by this fraction
    # Seconds of one decode by rows, e.g. `cost_curve()` of an earlier engine on this machine;
    # None: measured on the first speculative request.
    cost_curve: Mapping[int, float] | None = None

    def validate(self) -> BatchOptions:
        if not 1 <= self.parallel <= 64:
            raise InvalidOptionError(f"parallel must be in [1, 64], got {self.parallel}")
        if self.prefill_chunk < 1:
            raise InvalidOptionError(f"prefill_chunk must be at least 1, got {self.prefill_chunk}")
        if self.max_backlog < 1:
            raise InvalidOptionError(f"max_backlog must be at least 1, got {self.max_backlog}")
        if not 0 <= self.draft_max <= 64:
            raise InvalidOptionError(f"draft_max must be in [0, 64], got {self.draft_max}")
        if self.cost_curve is not None and (
                1 not in self.cost_curve or any(b < 1 or not t > 0 for b, t in self.cost_curve.items())):
            raise InvalidOptionError("cost_curve needs positive seconds by row count, including 1 row")
        return self


@dataclass(frozen=True)
class ScoredTokenEvent(TokenEvent):
    """A TokenEvent with the model's log-probability of the token (before sampling settings) and
    the `top` most likely alternatives as (token, logprob), when the request asked for them."""

    logprob: float = 0.0
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SlotMetrics:
    index: int
    busy: bool
    cached_tokens: int
    decode_tok_s: float  # the current (or last) request's decode speed on this slot


@dataclass(frozen=True)
class BatchMetrics:
    """Counters since the engine started, and the current state (for /metrics)."""

    requests_submitted: int
    requests_finished: dict[str, int]  # by finish reason, plus "error"
    prompt_tokens: int
    cached_prompt_tokens: int
    generated_tokens: int
    queue_depth: int
    active: int
    steps: int
    rows: int  # total decoded rows (prompt chunks + tokens + drafts)
    drafted: int
    accepted: int
    slots: tuple[SlotMetrics, ...]


# -- a request, as its submitter sees it ------------------------------------------------------------


class _Channel:
    """What the scheduler and the reader of one request share: the queued events, the cancel flag.

    The scheduler holds only this, never the BatchGeneration, so a reader that drops its
    generation (garbage) cancels it at once."""

    def __init__(self, prompt: list[int], options: GenerateOptions, logprobs: int | None,
                 notify: Callable[[], None] | None, wake: Callable[[], None], max_backlog: int):
        self.prompt = prompt
        self.options = options
        self.logprobs = logprobs
        self.notify = notify
        self.wake = wake  # tells the scheduler that a paused request may go on
        self.max_backlog = max_backlog
        self.cond = threading.Condition()
        self.events: collections.deque[Event] = collections.deque()
        self.error: BaseException | None = None
        self.finished = False  # the DoneEvent (or an error) has been queued
        self.cancel = threading.Event()
        self.submitted = time.perf_counter()
        self.stats = GenerationStats(prompt_tokens=len(prompt))

    @property
    def cancelled(self) -> bool:
        return self.cancel.is_set()

    def backlog(self) -> int:
        return len(self.events)

    def push(self, events: list[Event], error: BaseException | None = None) -> None:
        with self.cond:
            self.events.extend(events)
            if error is not None:
                self.error = error
            if error is not None or (events and isinstance(events[-1], DoneEvent)):
                self.finished = True
            self.cond.notify_all()
        if self.notify is not None:
            try:
                self.notify()
            except Exception:  # a closed event loop must not stop the scheduler
                log.debug("notify callback failed", exc_info=True)


class BatchGeneration(Iterator[Event]):
    """An iterator of TokenEvent… then one DoneEvent, fed by the engine's scheduler thread.

    `cancel()` works from any thread and frees the slot at the next step; dropping the object
    (or `close()`) cancels too. Async consumers pass `notify` to `submit` (called from the
    scheduler thread whenever events arrive) and drain with `poll()` instead of blocking.
    """

    def __init__(self, channel: _Channel):
        self._ch = channel
        self.done: DoneEvent | None = None

    @property
    def options(self) -> GenerateOptions:
        return self._ch.options

    @property
    def stats(self) -> GenerationStats:
        return self._ch.stats

    @property
    def prompt_tokens(self) -> list[int]:
        return self._ch.prompt

    def __iter__(self) -> BatchGeneration:
        return self

    def __next__(self) -> Event:
        ch = self._ch
        with ch.cond:
            while not ch.events and ch.error is None and self.done is None:
                ch.cond.wait()
            before = len(ch.events)
            event = self._take()
        self._maybe_wake(before)
        return event

    def poll(self) -> list[Event]:
        """The events available now, without waiting (raises the engine's error, if any)."""
        ch = self._ch
        out: list[Event] = []
        with ch.cond:
            before = len(ch.events)
            while ch.events:
                out.append(self._take())
            if not out and ch.error is not None:
                self._take()
        self._maybe_wake(before)
        return out

    @property
    def finished(self) -> bool:
        """True once every event has been read."""
        return self.done is not None

    def _take(self) -> Event:  # holds the channel's lock
        ch = self._ch
        if ch.events:
            event = ch.events.popleft()
            if isinstance(event, DoneEvent):
                self.done = event
            return event
        if ch.error is not None:
            error, ch.error = ch.error, None
            raise error
        raise StopIteration

    def _maybe_wake(self, backlog_before: int) -> None:
        if backlog_before >= self._ch.max_backlog:
            self._ch.wake()  # the request was paused for this reader: it can go on

    def cancel(self) -> None:
        """Stop as soon as possible; a DoneEvent with finish_reason "cancelled" still follows."""
        self._ch.cancel.set()
        self._ch.wake()

    @property
    def cancelled(self) -> bool:
        return self._ch.cancelled

    def result(self) -> DoneEvent:
        """Run to the end and return the DoneEvent."""
        for _ in self:
            pass
        assert self.done is not None
        return self.done

    def close(self) -> None:
        if not self._ch.finished:
            self.cancel()

    def __del__(self) -> None:  # an abandoned request frees its slot
        try:
            self.close()
        except Exception:  # pragma: no cover
            pass


# -- the scheduler's state of a request and a slot ---------------------------------------------------


@dataclass
class _Slot:
    index: int
    cached: list[int] = field(default_factory=list)  # tokens whose KV is in this sequence
    prompt_logits: tuple[list[int], np.ndarray] | None = None  # last prompt and its last logits row
    last_used: float = 0.0
    decode_tok_s: float = 0.0


class _Lookup:
    """Per-request prompt-lookup state: the n-gram index and acceptance estimates."""

    def __init__(self, stats: SpeculationStats):
        self.index = NgramIndex()
        self.fresh = AcceptanceModel(prior=_PRIOR_FRESH)
        self.run = AcceptanceModel(prior=_PRIOR_RUN)
        self.in_run = False
        self.stats = stats
        # Estimates that say "never draft" would never be corrected: after `explore_after`
        # steps with a match but no draft, the slot is judged once with the priors instead
        # (it still drafts only if the batch's cost curve says the priors would pay).
        self.idle = 0
        self.explore_after = 8
        self.exploring = False

    def gains(self, history: Sequence[int], limit: int) -> tuple[list[int], list[float]]:
        """The draft at the end of `history` and the expected tokens each of its rows adds."""
        self.index.sync(history)
        draft, n = self.index.lookup(limit)
        if not draft:
            return [], []
        self.exploring = self.idle >= self.explore_after
        model = (AcceptanceModel(prior=_PRIOR_RUN if self.in_run else _PRIOR_FRESH) if self.exploring
                 else self.run if self.in_run else self.fresh)
        quality = 1.0 if n >= 3 or self.in_run else _WEAK_MATCH_QUALITY
        gains, p = [], quality
        for i in range(len(draft)):
            p *= model.prob(i)
            gains.append(p)
        return draft, gains

    def observe(self, n_drafted: int, n_accepted: int, had_match: bool) -> None:
        if n_drafted == 0:
            if had_match:
                self.idle += 1
            return
        (self.run if self.in_run else self.fresh).update(n_drafted, n_accepted)
        if self.exploring:
            self.explore_after = 8 if n_accepted else min(self.explore_after * 2, 1024)
        self.idle = 0
        self.in_run = n_accepted == n_drafted
        self.stats.record(n_drafted, n_accepted)


class _Request:
    """Everything the scheduler tracks for one request while it holds a slot."""

    def __init__(self, ch: _Channel, slot: _Slot, sampler: Sampler, n_keep: int, restore: np.ndarray | None):
        self.ch = ch
        self.slot = slot
        self.sampler = sampler
        self.prompt = ch.prompt
        self.fed = n_keep  # prompt tokens in the slot's cache
        self.restore = restore  # logits row to restore after re-decoding a fully cached prompt
        self.text = TextAssembler(ch.options.stop)
        self.history: list[int] = list(ch.prompt)
        self.generated: list[int] = []
        self.held: TokenEvent | None = None  # each event waits one token (see Generation)
        self.out: list[Event] = []
        self.finish: FinishReason | None = None
        self.t_start = time.perf_counter()
        self.t_first = 0.0
        self.lookup: _Lookup | None = None
        self.had_match = False
        if ch.options.speculation.method != "off":
            ch.stats.speculation = SpeculationStats(method="lookup")
            self.lookup = _Lookup(ch.stats.speculation)

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt)

    def decode_tok_s(self) -> float:
        n = len(self.generated) - 1
        dt = time.perf_counter() - self.t_first
        return n / dt if self.t_first and n > 0 and dt > 0 else 0.0


# -- the engine ---------------------------------------------------------------------------------------


class BatchEngine:
    """A model serving N requests at once from one llama.cpp context (see the module docstring).

    Thread safety: every public method may be called from any thread. One scheduler thread owns
    the llama.cpp context; submitters only tokenize and queue.
    """

    def __init__(
        self,
        path: Path,
        info: GGUFInfo,
        options: LoadOptions,
        batch: BatchOptions | None = None,
        *,
        manifest: ModelManifest | None = None,
        store: Store | None = None,
    ):
        self.path = Path(path)
        self.info = info
        self.manifest = manifest
        self.options = options
        self.batch_options = (batch or BatchOptions()).validate()
        self.store = store or Store()
        n = self.batch_options.parallel
        self._runtime = LlamaRuntime(self.path, options, n_seq_max=n)
        rt = self._runtime
        self.slot_ctx = rt.n_ctx // n
        if self.slot_ctx < 16:
            rt.close()
            raise ContextLengthError(f"a context of {rt.n_ctx} tokens split between {n} slots leaves {self.slot_ctx} per slot")
        self._slots = [_Slot(i) for i in range(n)]
        self._vocab_lock = threading.Lock()  # llama_token_to_piece shares one buffer
        self._cond = threading.Condition()
        self._queue: collections.deque[_Channel] = collections.deque()
        self._active: list[_Request] = []
        self._closing = False
        self._closed = False
        self._counters: collections.Counter[str] = collections.Counter()
        self._finished: collections.Counter[str] = collections.Counter()
        self._costs: _StepCosts | None = None
        self._thread = threading.Thread(target=self._run, name=f"edgeinfer-batch-{self.name}", daemon=True)
        self._thread.start()

    @classmethod
    def load(
        cls,
        model: str | Path | None = None,
        options: LoadOptions | None = None,
        batch: BatchOptions | None = None,
        *,
        store: Store | None = None,
        **load_options: Any,
    ) -> BatchEngine:
        """Load a model (store name, `.gguf` path, or None for the default) for parallel serving.

        `n_ctx` is the whole context, split evenly between the `batch.parallel` slots (as
        llama-server's -c and -np); keyword arguments are LoadOptions fields."""
        known = {f.name for f in fields(LoadOptions)}
        unknown = set(load_options) - known
        if unknown:
            raise InvalidOptionError(f"unknown load option(s): {', '.join(sorted(unknown))}")
        options = replace(options or LoadOptions(), **load_options).validate()
        store = store or Store()
        path, manifest = store.resolve(model)
        return cls(path, admit(path, store, manifest), options, batch, manifest=manifest, store=store)

    # -- facts -----------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.manifest.ref if self.manifest else self.path.name

    @property
    def parallel(self) -> int:
        return self.batch_options.parallel

    @property
    def n_ctx(self) -> int:
        """Positions one request can use (prompt + output): the context split per slot."""
        return self.slot_ctx

    @property
    def n_ctx_per_request(self) -> int:
        """Positions one request may use (prompt + output): the context split between the slots."""
        return self.slot_ctx

    @property
    def threads(self) -> int:
        """llama.cpp's threads now (see Engine.threads)."""
        return self._runtime.threads

    @property
    def n_vocab(self) -> int:
        return self._runtime.facts.n_vocab

    @property
    def chat_template(self) -> str:
        tpl = self.info.metadata.get("tokenizer.chat_template")
        return tpl if isinstance(tpl, str) and tpl.strip() else CHATML_TEMPLATE

    # -- text ------------------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        self._check_open()
        return self._runtime.tokenize(text, add_special, parse_special)

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token prints as (special tokens as their text)."""
        with self._vocab_lock:
            return self._runtime.piece(token, True)

    def detokenize(self, tokens: Sequence[int]) -> str:
        with self._vocab_lock:
            raw = b"".join(self._runtime.piece(t, False) for t in tokens)
        return raw.decode("utf-8", errors="replace")

    def chat_tokens(self, messages: Sequence[Message]) -> list[int]:
        """The prompt of a conversation, rendered with the model's own chat template."""
        self._check_open()
        rt = self._runtime
        bos = rt.token_text(rt.bos) if rt.bos >= 0 else ""
        eos = rt.token_text(rt.eos) if rt.eos >= 0 else ""
        rendered = render_chat(self.chat_template, messages, bos, eos, name=self.name)
        add_bos = rt.add_bos and not (bos and rendered.startswith(bos))
        return ([rt.bos] if add_bos else []) + rt.tokenize(rendered, False, True)

    # -- requests --------------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], options: GenerateOptions | None = None, **kw: Any) -> BatchGeneration:
        """Raw completion of a prompt (text, or token ids used as they are)."""
        tokens = self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        return self.submit(tokens, options, **kw)

    def chat(self, messages: Sequence[Message], options: GenerateOptions | None = None, **kw: Any) -> BatchGeneration:
        """Continue a conversation as the assistant, with the model's own template."""
        return self.submit(self.chat_tokens(messages), options, **kw)

    def check_request(self, tokens: Sequence[int], options: GenerateOptions | None = None) -> GenerateOptions:
        """Validate a request without queueing it; returns the validated options."""
        options = (options or GenerateOptions()).validate()
        if options.speculation.method not in ("off", "lookup", "auto"):
            raise InvalidOptionError(
                f"speculation method {options.speculation.method!r} is not supported with parallel sequences "
                "(use off, lookup or auto)"
            )
        if not tokens:
            raise InvalidOptionError("the prompt is empty")
        if len(tokens) >= self.slot_ctx:
            raise ContextLengthError(
                f"the prompt is {len(tokens)} tokens but a request can use {self.slot_ctx} "
                f"(context {self._runtime.n_ctx} split between {self.parallel} slots)"
            )
        bad = [t for t in tokens if not 0 <= t < self.n_vocab]
        if bad:
            raise InvalidOptionError(f"token id {bad[0]} is outside the vocabulary (0..{self.n_vocab - 1})")
        return options

    def submit(
        self,
        tokens: Sequence[int],
        options: GenerateOptions | None = None,
        *,
        logprobs: int | None = None,
        notify: Callable[[], None] | None = None,
    ) -> BatchGeneration:
        """Queue a request (prompt token ids); it starts when a slot is free.

        logprobs: None, or how many alternatives (0..20) to report with each token's logprob
        (its events are then ScoredTokenEvent). notify: called from the scheduler thread each
        time events arrive; it must not block."""
        self._check_open()
        tokens = [int(t) for t in tokens]
        options = self.check_request(tokens, options)
        if logprobs is not None and not 0 <= logprobs <= 20:
            raise InvalidOptionError(f"logprobs must be in [0, 20], got {logprobs}")
        ch = _Channel(tokens, options, logprobs, notify, self._wake, self.batch_options.max_backlog)
        with self._cond:
            if self._closing:
                raise InvalidOptionError("this engine is shutting down")
            self._queue.append(ch)
            self._counters["submitted"] += 1
            self._cond.notify_all()
        return BatchGeneration(ch)

    def cancel_all(self) -> None:
        """Cancel every queued and running request (each still ends with a DoneEvent)."""
        with self._cond:
            channels = list(self._queue) + [r.ch for r in self._active]
            for ch in channels:
                ch.cancel.set()
            self._cond.notify_all()

    def metrics(self) -> BatchMetrics:
        with self._cond:
            active = {r.slot.index: r for r in self._active}
            slots = tuple(
                SlotMetrics(s.index, s.index in active, len(s.cached),
                            active[s.index].decode_tok_s() if s.index in active else s.decode_tok_s)
                for s in self._slots
            )
            c = self._counters
            return BatchMetrics(
                requests_submitted=c["submitted"],
                requests_finished=dict(self._finished),
                prompt_tokens=c["prompt_tokens"],
                cached_prompt_tokens=c["cached_tokens"],
                generated_tokens=c["generated"],
                queue_depth=len(self._queue),
                active=len(self._active),
                steps=c["steps"],
                rows=c["rows"],
                drafted=c["drafted"],
                accepted=c["accepted"],
                slots=slots,
            )

    def cost_curve(self) -> dict[int, float]:
        """Seconds of one decode by number of rows, as the draft policy uses it (empty before
        the first speculative request)."""
        costs = self._costs
        if costs is None:
            return {}
        return {int(k): v for k, v in costs.curve.to_dict().items() if k.isdigit()}

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """True once `close()` has begun: no new requests are taken."""
        return self._closing or self._closed

    def _check_open(self) -> None:
        if self._closed or self._closing:
            raise InvalidOptionError("this engine is closed")

    def close(self, grace: float = 0.0) -> None:
        """Stop accepting requests; let running ones finish for up to `grace` seconds, cancel
        the rest (they end with finish_reason "cancelled"), then free the model."""
        if self._closed:
            return
        deadline = time.monotonic() + grace
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            while (self._queue or self._active) and time.monotonic() < deadline:
                self._cond.wait(timeout=max(0.0, deadline - time.monotonic()))
        self.cancel_all()
        self._thread.join()
        self._closed = True
        self._runtime.close()

    def __enter__(self) -> BatchEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"BatchEngine({self.name!r}, parallel={self.parallel}, n_ctx={self.slot_ctx} per slot)"

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # -- the scheduler thread --------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._has_work():
                    if self._closing and not self._queue and not self._active:
                        return
                    self._cond.wait()
            try:
                self._step()
            except Exception as e:  # a failed decode fails the requests it carried, not the engine
                log.exception("batch step failed")
                self._fail_all(e)

    def _has_work(self) -> bool:  # holds self._cond
        if self._queue and (len(self._active) < len(self._slots) or any(ch.cancelled for ch in self._queue)):
            return True
        limit = self.batch_options.max_backlog
        return any(r.ch.cancelled or r.prefilling or r.ch.backlog() < limit for r in self._active)

    def _fail_all(self, error: Exception) -> None:
        with self._cond:
            failed, self._active = self._active, []
            self._cond.notify_all()
        if not isinstance(error, EdgeInferError):
            error = EdgeInferError(f"decoding failed: {error}")
        for r in failed:
            r.sampler.close()
            r.slot.cached.clear()  # what the failed decode left in the cache is unknown
            r.slot.prompt_logits = None
            try:
                self._runtime.seq_rm(r.slot.index, 0)
            except Exception:  # pragma: no cover
                log.exception("could not clear slot %d", r.slot.index)
            self._finished["error"] += 1
            r.ch.push([], error)

    def _admit(self) -> None:
        """Move queued requests into free slots (the free slot sharing the longest prefix)."""
        dropped, failed = [], []
        with self._cond:
            for ch in [ch for ch in self._queue if ch.cancelled]:
                self._queue.remove(ch)
                self._finished["cancelled"] += 1
                dropped.append(ch)
            busy = {r.slot.index for r in self._active}
            free = [s for s in self._slots if s.index not in busy]
            while self._queue and free:
                ch = self._queue.popleft()
                slot = max(free, key=lambda s: (_common_prefix(s.cached, ch.prompt), -s.last_used))
                try:
                    self._active.append(self._start(ch, slot))
                    free.remove(slot)
                except Exception as e:  # this request fails, not the ones queued behind it
                    log.exception("could not start a request")
                    slot.cached.clear()
                    self._runtime.seq_rm(slot.index, 0)
                    self._finished["error"] += 1
                    failed.append((ch, e if isinstance(e, EdgeInferError) else EdgeInferError(f"could not start: {e}")))
        # Outside the engine's lock: a reader may hold its channel's.
        for ch in dropped:
            ch.push([DoneEvent("", [], "cancelled", ch.stats)])
        for ch, error in failed:
            ch.push([], error)

    def _start(self, ch: _Channel, slot: _Slot) -> _Request:
        prompt = ch.prompt
        n_keep = _common_prefix(slot.cached, prompt)
        restore = None
        if n_keep == len(prompt):
            # The last prompt token is decoded again for its logits; a one-row decode rounds
            # differently from the batched prefill, so the saved row is restored over it (the
            # same request twice gives the same answer).
            n_keep -= 1
            saved = slot.prompt_logits
            if saved is not None and saved[0] == prompt:
                restore = saved[1]
        if n_keep < len(slot.cached):
            self._runtime.seq_rm(slot.index, n_keep)
            del slot.cached[n_keep:]
        ch.stats.cached_tokens = n_keep
        self._counters["prompt_tokens"] += len(prompt)
        self._counters["cached_tokens"] += n_keep
        return _Request(ch, slot, Sampler(self._runtime, ch.options.sampling), n_keep, restore)

    def _step(self) -> None:
        """One llama_decode: each decoding request's token (+ drafts), then prompt chunks."""
        self._admit()
        rt = self._runtime
        bo = self.batch_options
        for r in [r for r in self._active if r.ch.cancelled]:
            r.finish = "cancelled"
            self._finish(r)
        decoding = [r for r in self._active if not r.prefilling and r.ch.backlog() < bo.max_backlog]
        # Prompts: the whole batch when nothing decodes, else a chunk per step.
        budget = rt.n_batch - len(decoding)
        if decoding:
            budget = min(budget, bo.prefill_chunk)
        chunks: list[tuple[_Request, int]] = []
        for r in self._active:
            if r.prefilling and budget > 0:
                n = min(budget, len(r.prompt) - r.fed)
                chunks.append((r, n))
                budget -= n
        n_prefill = sum(n for _, n in chunks)
        if not decoding and not n_prefill:
            return
        drafts = self._drafts(decoding, n_prefill)

        rows = _Rows()
        firsts = []
        for r, draft in zip(decoding, drafts):
            firsts.append(len(rows))
            pos = len(r.slot.cached)
            for j, t in enumerate([r.history[-1], *draft]):
                rows.add(t, pos + j, r.slot.index, True)
        prompt_ends = []
        for r, n in chunks:
            for i in range(r.fed, r.fed + n):
                rows.add(r.prompt[i], i, r.slot.index, i == len(r.prompt) - 1)
            prompt_ends.append(len(rows) - 1)
        cells = sum(len(s.cached) for s in self._slots) + len(rows)
        t0 = time.perf_counter()
        rt.decode_rows(rows.tokens, rows.positions, rows.seqs, rows.logits)
        if self._costs is not None:
            self._costs.observe(len(rows), cells, time.perf_counter() - t0)
        self._counters["steps"] += 1
        self._counters["rows"] += len(rows)

        for (r, n), last_row in zip(chunks, prompt_ends):
            r.slot.cached.extend(r.prompt[r.fed : r.fed + n])
            r.fed += n
            if not r.prefilling:
                self._prompt_done(r, last_row)
        for r, first, draft in zip(decoding, firsts, drafts):
            self._verify(r, first, draft)
        for r in [r for r in self._active if r.finish is not None]:
            self._finish(r)
        for r in self._active:
            if r.out:
                out, r.out = r.out, []
                r.ch.push(out)

    def _prompt_done(self, r: _Request, row: int) -> None:
        rt = self._runtime
        if r.restore is not None:
            rt.logits_row(row)[:] = r.restore
        r.slot.prompt_logits = (list(r.prompt), rt.logits_row(row).copy())
        r.ch.stats.prefill_s = time.perf_counter() - r.t_start
        r.sampler.prime(r.prompt)
        self._commit(r, [(r.sampler.sample(row), False, row)])
        r.t_first = time.perf_counter()
        r.ch.stats.ttft_s = r.t_first - r.ch.submitted

    def _verify(self, r: _Request, first: int, drafts: list[int]) -> None:
        """Sample the request's rows; keep drafts while they match; drop the rejected suffix."""
        r.slot.cached.append(r.history[-1])
        r.slot.cached.extend(drafts)
        pending: list[tuple[int, bool, int]] = []
        n_ok = 0
        for i in range(len(drafts) + 1):
            tok = r.sampler.sample(first + i)
            if i < len(drafts) and tok == drafts[i]:
                pending.append((tok, True, first + i))
                n_ok += 1
                continue
            pending.append((tok, False, first + i))
            break
        if n_ok < len(drafts):
            keep = len(r.history) + n_ok
            self._runtime.seq_rm(r.slot.index, keep)
            del r.slot.cached[keep:]
        if r.lookup is not None:
            r.lookup.observe(len(drafts), n_ok, r.had_match)
            self._counters["drafted"] += len(drafts)
            self._counters["accepted"] += n_ok
            if not drafts:
                r.lookup.stats.plain_steps += 1
        self._commit(r, pending)

    def _commit(self, r: _Request, pending: list[tuple[int, bool, int]]) -> None:
        """Turn sampled tokens into events; decide whether the request is finished."""
        rt = self._runtime
        opts = r.ch.options
        for tok, drafted, row in pending:
            if rt.is_eog(tok):
                r.finish = "eos"
                break
            r.history.append(tok)
            r.generated.append(tok)
            self._counters["generated"] += 1
            with self._vocab_lock:
                piece = rt.piece(tok)
            text, stopped = r.text.push(piece)
            if r.held is not None:
                r.out.append(r.held)
            r.held = self._event(r, tok, text, drafted, row)
            if stopped:
                r.finish = "stop"
                break
            if len(r.generated) >= opts.max_tokens:
                r.finish = "length"
                break
        if r.finish is None and len(r.slot.cached) >= self.slot_ctx:
            r.finish = "length"  # no position left for the next token

    def _event(self, r: _Request, tok: int, text: str, drafted: bool, row: int) -> TokenEvent:
        top_n = r.ch.logprobs
        if top_n is None:
            return TokenEvent(tok, text, drafted)
        logits = self._runtime.logits_row(row)
        m = float(logits.max())
        lse = m + float(np.log(np.exp(logits - m, dtype=np.float32).sum()))
        top: tuple[tuple[int, float], ...] = ()
        if top_n:
            idx = np.argpartition(-logits, top_n)[:top_n]
            idx = idx[np.argsort(-logits[idx], kind="stable")]
            top = tuple((int(i), float(logits[i]) - lse) for i in idx)
        return ScoredTokenEvent(tok, text, drafted, float(logits[tok]) - lse, top)

    def _finish(self, r: _Request) -> None:
        stats = r.ch.stats
        tail = r.text.flush()
        if r.held is not None:
            r.out.append(replace(r.held, text=r.held.text + tail))
        stats.generated_tokens = len(r.generated)
        stats.decode_s = time.perf_counter() - r.t_first if r.generated and r.t_first else 0.0
        finish = r.finish or "cancelled"
        r.out.append(DoneEvent(r.text.text, list(r.generated), finish, stats))
        r.sampler.close()
        r.slot.last_used = time.monotonic()
        r.slot.decode_tok_s = stats.decode_tok_s
        with self._cond:
            self._active.remove(r)
            self._finished[finish] += 1
            self._cond.notify_all()
        out, r.out = r.out, []
        r.ch.push(out)

    # -- batch-aware speculation -----------------------------------------------------------------
    def _drafts(self, decoding: list[_Request], n_prefill: int) -> list[list[int]]:
        """The drafted rows of each decoding request: as many as pay for the whole batch, by
        `plan_drafts` on this engine's measured cost curve."""
        bo = self.batch_options
        out: list[list[int]] = [[] for _ in decoding]
        if bo.draft_max == 0 or not any(r.lookup is not None for r in decoding):
            return out
        costs = self._cost_model()
        candidates: list[list[int]] = [[] for _ in decoding]
        gains_of: list[list[float]] = [[] for _ in decoding]
        for i, r in enumerate(decoding):
            r.had_match = False
            if r.lookup is None:
                continue
            opts = r.ch.options
            room = min(self.slot_ctx - len(r.slot.cached) - 1, opts.max_tokens - len(r.generated) - 1,
                       bo.draft_max, opts.speculation.draft_max)
            if room <= 0:
                continue
            draft, gains = r.lookup.gains(r.history, room)
            r.had_match = bool(draft)
            candidates[i], gains_of[i] = draft, gains
        if not any(gains_of):
            return out
        cells = sum(len(s.cached) for s in self._slots)
        counts = plan_drafts(gains_of, len(decoding) + n_prefill, lambda rows: costs.time(rows, cells + rows),
                             self._runtime.n_batch, bo.margin)
        return [candidates[i][:k] for i, k in enumerate(counts)]

    def _cost_model(self) -> _StepCosts:
        """What the draft policy decides with: the curve by rows measured once (at a short
        context), held fixed and made non-decreasing, plus a fit of the steps actually taken
        (see _StepCosts). Decisions compare t(R0 + m) with t(R0) for the same step, so the model
        must be consistent with itself more than exact: learning single sizes from live steps
        (as Engine's policy does) made a size seen in heavy prefill steps dearer than its unseen
        neighbours, so drafting into such a step looked free; a noisy calibration bump must not
        say that more rows cost less."""
        if self._costs is None:
            given = self.batch_options.cost_curve
            self._costs = _StepCosts(CostModel(_non_decreasing(dict(given) if given is not None else self._calibrate())))
        return self._costs

    def _calibrate(self, reps: int = 2) -> dict[int, float]:
        """Time decodes of R rows spread over the slots as a real step spreads them (fastest of
        `reps` up to _RETIMED_ROWS: other load only ever slows a decode down; the larger ones
        once, they last long enough to be read well and are most of the time), placed after each
        slot's cached tokens and removed again."""
        rt = self._runtime
        n = len(self._slots)
        best: dict[int, float] = {}
        for rep in range(reps):
            for b in _CALIBRATION_ROWS:
                if rep and b > _RETIMED_ROWS:
                    break
                per = -(-b // n)  # rows per slot
                if b > rt.n_batch or any(len(s.cached) + per > self.slot_ctx for s in self._slots):
                    break
                rows = _Rows()
                for i in range(b):
                    s = self._slots[i % n]
                    rows.add(s.cached[-1] if s.cached else max(rt.bos, 0), len(s.cached) + i // n, s.index, True)
                t0 = time.perf_counter()
                rt.decode_rows(rows.tokens, rows.positions, rows.seqs, rows.logits)
                best[b] = min(best.get(b, float("inf")), time.perf_counter() - t0)
                for s in self._slots:
                    rt.seq_rm(s.index, len(s.cached))
        log.info("batch cost curve (ms): %s", {b: round(t * 1e3, 2) for b, t in sorted(best.items())})
        return best


class _StepCosts:
    """t(R, D) = s · curve(R) + β · R · D: the measured curve by rows, scaled to the machine's
    current speed, plus what attention over D cached cells adds per row (one unified KV cache:
    every row attends over the cells of all slots, so eight long conversations make each row
    dearer than the curve measured at a short context says). s and β are fitted to the steps
    actually taken by exponentially weighted least squares."""

    def __init__(self, curve: CostModel, decay: float = 0.98):
        self.curve = curve
        self.decay = decay
        self.s, self.beta = 1.0, 0.0
        self._sums = np.zeros(5)  # Σa², Σab, Σb², Σay, Σby with a = curve(R), b = R·D, y = seconds

    def time(self, rows: int, cells: int) -> float:
        return self.s * self.curve.time(rows) + self.beta * rows * cells

    def observe(self, rows: int, cells: int, seconds: float) -> None:
        a, b = self.curve.time(rows), float(rows * cells)
        self._sums = self._sums * self.decay + np.array([a * a, a * b, b * b, a * seconds, b * seconds])
        saa, sab, sbb, say, sby = self._sums
        det = saa * sbb - sab * sab
        s = beta = -1.0
        if det > 1e-12 * saa * sbb:
            s, beta = (say * sbb - sby * sab) / det, (saa * sby - sab * say) / det
        if s <= 0 or beta < 0:  # not identifiable yet (or no attention effect): scale only
            s, beta = say / saa, 0.0
        self.s, self.beta = max(s, 1e-3), beta


def _non_decreasing(seconds: dict[int, float]) -> dict[int, float]:
    out, highest = {}, 0.0
    for b in sorted(seconds):
        highest = max(highest, seconds[b])
        out[b] = highest
    return out


def plan_drafts(gains: Sequence[Sequence[float]], base_rows: int, cost: Callable[[int], float], max_rows: int,
                margin: float = 0.03) -> list[int]:
    """How many drafted rows each request adds to a step that already has `base_rows` rows.

    gains[i][j] is what row j of request i's draft is worth: the expected tokens it adds (the
    product of acceptance estimates up to j, so it falls along a draft). Rows are taken in order
    of worth; with m of them the step yields (base_rows + their worth) tokens' worth of progress
    for cost(base_rows + m) seconds — one unit per row already planned, a token or a prompt
    token. The m with the best rate wins if it beats m = 0 by `margin`. With a memory-bound
    curve (extra rows nearly free) that drafts; once cost grows in proportion to rows, a row
    worth less than one token never pays, so drafts shrink as the batch grows.
    """
    heap = [(-g, i, j) for i, row in enumerate(gains) for j, g in enumerate(row)]
    heapq.heapify(heap)
    value = float(base_rows)
    best_m, best_rate = 0, value / cost(base_rows) * (1 + margin)
    taken: list[int] = []
    while heap and base_rows + len(taken) < max_rows:
        worth, i, _ = heapq.heappop(heap)
        value -= worth
        taken.append(i)
        rate = value / cost(base_rows + len(taken))
        if rate > best_rate:
            best_m, best_rate = len(taken), rate
    per_request = collections.Counter(taken[:best_m])
    return [per_request.get(i, 0) for i in range(len(gains))]


class _Rows:
    """The rows of one llama_decode: token, position, sequence, whether logits are wanted."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.positions: list[int] = []
        self.seqs: list[int] = []
        self.logits: list[bool] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, pos: int, seq: int, logits: bool) -> None:
        self.tokens.append(token)
        self.positions.append(pos)
        self.seqs.append(seq)
        self.logits.append(logits)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
