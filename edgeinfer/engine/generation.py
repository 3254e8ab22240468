"""The decode loop: our own, on llama.cpp's low-level API.

Each step is one `llama_decode` of the pending token plus whatever a drafter proposes, with logits
requested only for those rows. The target samples each row in order and keeps drafted tokens while
they match what it sampled, so the output is exactly what plain decoding gives (for a deterministic
drafter this holds for any sampler settings). The rejected suffix is dropped from the KV cache.
Plain decoding is the same loop with no drafter.

A draft model at temperature > 0 (no penalties) samples its drafts from its own distribution q
instead; the target then verifies each with the rejection rule of speculative sampling (keep x with
probability min(1, p(x)/q(x)), else draw from normalise(max(0, p − q)), a bonus token from p when all
are kept). p and q are the sampler's post-transform distributions (`sampler.sampling_distribution`:
top-k → top-p → min-p → temperature → softmax), and every token of such a request is drawn in numpy
with the request's one RNG, seeded from its seed. Each output token is then distributed as plain
sampling's, and more drafts are kept than by matching two independent samples. Prompt lookup (and
greedy) drafts stay sample-and-match: their q is one-hot, where the two rules coincide.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Literal, Protocol

import numpy as np

from ..cancel import CancelToken
from ..errors import Cancelled, EngineClosedError
from .events import DoneEvent, Event, FinishReason, GenerationStats, SpeculationProgress, TokenEvent
from .llama import DecodeAborted, LlamaRuntime
from .options import GenerateOptions, SpeculationOptions
from .sampler import Sampler, verify_sampled_draft
from .slot import RequestSlot
from .text import TextAssembler

__all__ = ["Generation", "Drafter", "SpeculationSource", "GenerationState"]

GenerationState = Literal["new", "preparing", "waiting", "running", "done"]


class Drafter(Protocol):
    """Proposes tokens the target is likely to produce next. Implementations live in
    edgeinfer.engine.speculation (prompt lookup, draft model, self-draft)."""

    method: str

    def start(self, prompt: Sequence[int]) -> None:
        """Called once the target has processed the prompt."""

    def propose(self, history: Sequence[int], max_len: int) -> list[int]:
        """Up to max_len tokens to follow `history` (prompt + committed output)."""

    def observe(self, history: Sequence[int], n_drafted: int, n_accepted: int, verify_s: float, draft_s: float) -> None:
        """Feedback after verification: `history` is the committed sequence now; verify_s the
        target's decode and sampling time, draft_s the time spent proposing."""

    def close(self) -> None: ...

    # Optional (looked up with getattr): a drafter that samples its drafts.
    # use_sampler(sampler) -> bool: called before start; True if its drafts will come with q.
    # draft_distributions() -> list[TokenDistribution] | None: q of each token of the last proposal.


class SpeculationSource(Protocol):
    """How a generation gets its drafter: the engine's side of speculation."""

    def is_ready(self, spec: SpeculationOptions) -> bool:
        """Whether `spec` needs no preparation (any draft model it names is open)."""

    def prepare(self, spec: SpeculationOptions, progress: Callable[[SpeculationProgress], None],
                cancel: CancelToken) -> None:
        """Find, make (quantize) and open the draft model `spec` names, reporting progress."""

    def drafter(self, spec: SpeculationOptions, stats: GenerationStats) -> Drafter | None:
        """The request's drafter (None: no speculation); sets stats.speculation when there is one."""


def _restore_logits(rt: LlamaRuntime, row: np.ndarray) -> bool:
    """Write `row` into the last decode's output row; False when that decode left none (aborted)."""
    try:
        rt.logits_row(-1)[:] = row
    except IndexError:
        return False
    return True


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _Request:
    """A generation's state, shared by its public handle and its decode loop. The loop never
    references the handle, so dropping the handle finalizes the loop (and frees the engine) at once."""

    def __init__(self, prompt: list[int], options: GenerateOptions, slot: RequestSlot,
                 speculation: SpeculationSource | None):
        self.prompt = prompt
        self.options = options
        self.slot = slot
        self.speculation = speculation
        self.cancel = threading.Event()
        self.stats = GenerationStats(prompt_tokens=len(prompt))
        self.done: DoneEvent | None = None
        self.state: GenerationState = "new"
        self.handle: weakref.ref[Generation] | None = None


class Generation(Iterator[Event]):
    """An iterator of TokenEvent… then one DoneEvent. Cancel from any thread with `cancel()`.

    A generation whose speculation needs a draft model not yet open first prepares it (a
    self-draft copy may be quantized) and yields SpeculationProgress events meanwhile; call
    `Engine.prepare_speculation` beforehand to do that on your own terms.

    The engine runs one generation at a time: iterating takes the engine on the first `next()`
    and releases it when the generation ends, is closed, or is dropped (leaving a `for` loop over
    `engine.chat(...)` early drops it). A generation that is kept but not run to the end holds
    the engine: other threads wait for it, and a new request from its own thread raises
    EngineBusyError (unless it was cancelled: then it is closed first).
    """

    def __init__(self, slot: RequestSlot, prompt: list[int], options: GenerateOptions,
                 speculation: SpeculationSource | None = None):
        self._req = _Request(prompt, options, slot, speculation)
        self._req.handle = weakref.ref(self)
        self._it = _run(self._req)

    # -- public ----------------------------------------------------------------------------------
    @property
    def options(self) -> GenerateOptions:
        return self._req.options

    @property
    def stats(self) -> GenerationStats:
        return self._req.stats

    @property
    def done(self) -> DoneEvent | None:
        """The DoneEvent, once the generation has ended (also when it was closed early)."""
        return self._req.done

    @property
    def state(self) -> GenerationState:
        """new → (preparing →) waiting → running → done."""
        return self._req.state

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> Event:
        if self._req.done is None and self._req.slot.closed:
            self._it.close()
            raise EngineClosedError("the engine was closed before this generation finished")
        return next(self._it)

    def cancel(self) -> None:
        """Stop as soon as possible (also inside a long prefill); a DoneEvent still follows."""
        self._req.cancel.set()
        self._req.slot.abort(self._req)

    @property
    def cancelled(self) -> bool:
        return self._req.cancel.is_set()

    def result(self) -> DoneEvent:
        """Run to the end and return the DoneEvent."""
        for _ in self:
            pass
        done = self._req.done
        if done is None:
            raise EngineClosedError("the engine was closed before this generation finished")
        return done

    def close(self) -> None:
        """Stop here and free the engine; `done` then holds what was generated, as cancelled."""
        self._it.close()
        req = self._req
        req.state = "done"
        if req.done is None:  # closed before it ran
            req.done = DoneEvent("", [], "cancelled", req.stats)

    def __del__(self) -> None:
        try:
            self._it.close()
        except Exception:  # noqa: BLE001 - running in another thread: it ends on its own
            pass


# -- the loop -----------------------------------------------------------------------------------------


def _run(req: _Request) -> Iterator[Event]:
    spec = req.options.speculation
    if req.speculation is not None and not req.speculation.is_ready(spec):
        req.state = "preparing"
        prepared = yield from _prepare(req)
        if not prepared:
            req.state = "done"
            req.done = DoneEvent("", [], "cancelled", req.stats)
            yield req.done
            return
    req.state = "waiting"
    if not req.slot.acquire(req, req.handle, cancelled=req.cancel.is_set):
        req.state = "done"
        req.done = DoneEvent("", [], "cancelled", req.stats)
        yield req.done
        return
    sampler = drafter = None
    try:
        req.state = "running"
        rt = req.slot.runtime
        if req.cancel.is_set():
            req.slot.abort(req)
        sampler = Sampler(rt, req.options.sampling)
        if req.speculation is not None:
            drafter = req.speculation.drafter(spec, req.stats)
        text, generated = TextAssembler(req.options.stop), []
        try:
            yield from _loop(req, rt, sampler, drafter, text, generated)
        except GeneratorExit:  # closed early: keep what was generated, as cancelled
            if req.done is None:
                req.stats.generated_tokens = len(generated)
                req.done = DoneEvent(text.text, list(generated), "cancelled", req.stats)
            raise
    finally:
        req.state = "done"
        try:
            if drafter is not None:
                drafter.close()
            if sampler is not None:
                sampler.close()
        finally:
            req.slot.release(req)


def _prepare(req: _Request) -> Generator[SpeculationProgress, None, bool]:
    """Prepare the request's speculation in a worker thread and yield its progress events.
    False when the request was cancelled meanwhile."""
    assert req.speculation is not None
    events: queue.SimpleQueue[SpeculationProgress | None] = queue.SimpleQueue()
    stop = threading.Event()
    failure: list[BaseException] = []
    source, spec = req.speculation, req.options.speculation

    def work() -> None:
        try:
            source.prepare(spec, events.put, lambda: stop.is_set() or req.cancel.is_set())
        except BaseException as e:  # noqa: BLE001 - handed to the generation's thread
            failure.append(e)
        finally:
            events.put(None)

    threading.Thread(target=work, name="edgeinfer-prepare-speculation", daemon=True).start()
    try:
        while True:
            try:
                event = events.get(timeout=0.1)  # a timeout keeps Ctrl-C deliverable
            except queue.Empty:
                continue
            if event is None:
                break
            yield event
    finally:
        stop.set()  # a generation closed meanwhile stops the preparation at its next tensor
    if failure:
        if isinstance(failure[0], Cancelled) and req.cancel.is_set():
            return False
        raise failure[0]
    return not req.cancel.is_set()


def _loop(req: _Request, rt: LlamaRuntime, sampler: Sampler, drafter: Drafter | None,
          text: TextAssembler, generated: list[int]) -> Iterator[Event]:
    opts = req.options
    stats = req.stats
    prompt = req.prompt
    finish: FinishReason | None = None
    t0 = time.perf_counter()
    t_first = t0

    # Each TokenEvent is held back by one step so that text released only at the end (a
    # held-back stop-string prefix that never completed, a final partial character) can be
    # attached to the last token instead of arriving without one.
    held: TokenEvent | None = None

    try:
        # Reuse the cached prefix of the previous request (multi-turn chat re-sends the history).
        n_keep = _common_prefix(rt.cached, prompt)
        whole_prompt_cached = n_keep == len(prompt)
        saved = rt.prompt_logits
        if not whole_prompt_cached or saved is None or saved[0] != len(prompt):
            saved = None  # nothing remembered for this prompt
        # The same prompt again (a regenerate, a seed sweep): its last logits row was remembered, so
        # nothing is decoded; the row goes where the sampler reads, the last decode's output row.
        restored = saved is not None and _restore_logits(rt, saved[1])
        if whole_prompt_cached and not restored:
            n_keep -= 1  # re-decode the last prompt token to get its logits
        rt.truncate(n_keep)
        stats.cached_tokens = n_keep
        rest = prompt[n_keep:]
        with rt.abortable():
            for s in range(0, len(rest), rt.n_batch):
                if req.cancel.is_set():
                    raise DecodeAborted()
                rt.decode(rest[s : s + rt.n_batch])
        # A one-token re-decode rounds differently from the batched prefill on quantized models
        # (enough to flip a near-tie), so the same request twice would answer differently:
        # the prompt's last logits row is remembered and restored instead.
        if saved is not None and not restored:
            rt.logits_row(-1)[:] = saved[1]
            rt.prompt_logits = saved  # the truncate above dropped it
        elif saved is None:
            rt.prompt_logits = (len(prompt), rt.logits_row(-1).copy())
        stats.prefill_s = time.perf_counter() - t0
        stats.prompt_tokens = len(prompt)
        sampler.prime(prompt)
        history = list(prompt)
        use_sampler = getattr(drafter, "use_sampler", None)
        sampled_drafts = bool(use_sampler(sampler)) if use_sampler is not None else False
        # With a sampling drafter every token is drawn in numpy from the distribution the rejection
        # rule uses (one definition of p, one RNG); otherwise llama.cpp's chain samples.
        sample = sampler.draw if sampled_drafts else sampler.sample
        pending = [(sample(-1), False)]
        if drafter is not None:
            drafter.start(prompt)  # may decode (cost calibration): only after the sample above
        t_first = time.perf_counter()
        stats.ttft_s = t_first - t0

        while True:
            # Commit the tokens of the last step, one event each.
            for tok, drafted in pending:
                if rt.is_eog(tok):
                    finish = "eos"
                    break
                history.append(tok)
                generated.append(tok)
                stats.generated_tokens = len(generated)
                piece, stopped = text.push(rt.piece(tok))
                if held is not None:
                    yield held
                held = TokenEvent(tok, piece, drafted)
                if stopped:
                    finish = "stop"
                    break
                if len(generated) >= opts.max_tokens:
                    finish = "length"
                    break
            if finish:
                break
            if req.cancel.is_set():
                finish = "cancelled"
                break
            room = rt.n_ctx - len(rt.cached) - 1  # positions left after the pending token
            if room < 0:
                finish = "length"
                break
            last = history[-1]
            drafts: list[int] = []
            t_propose = time.perf_counter()
            if drafter is not None:
                budget = min(opts.max_tokens - len(generated) - 1, room)
                if budget > 0:
                    drafts = drafter.propose(history, budget)[:budget]
            t_step = time.perf_counter()
            if drafts:
                rt.decode([last, *drafts], logits_from=0)
                qs = drafter.draft_distributions() if sampled_drafts else None  # type: ignore[attr-defined]
                pending = []
                n_ok = 0
                for i in range(len(drafts) + 1):
                    if qs is not None and i < len(drafts):
                        kept, tok = verify_sampled_draft(sampler.distribution(i), qs[i], drafts[i], sampler.rng)
                    else:  # sample-and-match (the bonus token: a plain sample from p)
                        tok = sample(i)
                        kept = i < len(drafts) and tok == drafts[i]
                    if kept:
                        pending.append((tok, True))
                        n_ok += 1
                        continue
                    pending.append((tok, False))
                    break
                # KV holds history + drafts; keep history + the accepted ones.
                rt.truncate(len(history) + n_ok)
                if stats.speculation is not None:
                    stats.speculation.record(len(drafts), n_ok)
                drafter.observe(history + [t for t, _ in pending[:-1]], len(drafts), n_ok,
                                time.perf_counter() - t_step, t_step - t_propose)
            else:
                rt.decode([last])
                pending = [(sample(-1), False)]
                if drafter is not None:
                    drafter.observe(history, 0, 0, time.perf_counter() - t_step, t_step - t_propose)
                    if stats.speculation is not None:
                        stats.speculation.plain_steps += 1
    except DecodeAborted:
        finish = "cancelled"
    tail = text.flush()
    if held is not None:
        yield TokenEvent(held.token, held.text + tail, held.drafted)
    stats.generated_tokens = len(generated)
    stats.decode_s = time.perf_counter() - t_first if generated else 0.0
    req.done = DoneEvent(text.text, list(generated), finish or "length", stats)
    yield req.done
