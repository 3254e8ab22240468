"""The decode loop: our own, on llama.cpp's low-level API.

Each step is one `llama_decode` of the pending token plus whatever a drafter proposes, with logits
requested only for those rows. The target samples each row in order and keeps drafted tokens while
they match what it sampled, so the output is exactly what plain decoding gives (for a deterministic
drafter this holds for any sampler settings). The rejected suffix is dropped from the KV cache.
Plain decoding is the same loop with no drafter.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

from .events import DoneEvent, Event, FinishReason, GenerationStats, TokenEvent
from .llama import DecodeAborted
from .options import GenerateOptions
from .sampler import Sampler
from .text import TextAssembler

if TYPE_CHECKING:
    from . import Engine

__all__ = ["Generation", "Drafter"]


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


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Generation(Iterator[Event]):
    """An iterator of TokenEvent… then one DoneEvent. Cancel from any thread with `cancel()`.

    The engine runs one generation at a time: iterating takes the engine's lock on the first
    `next()` and releases it when the generation ends (or is closed / garbage-collected).
    """

    def __init__(self, engine: Engine, prompt: list[int], options: GenerateOptions):
        self._engine = engine
        self._prompt = prompt
        self.options = options
        self._cancel = threading.Event()
        self.stats = GenerationStats(prompt_tokens=len(prompt))
        self.done: DoneEvent | None = None
        self._it = self._run()

    # -- public ----------------------------------------------------------------------------------
    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> Event:
        return next(self._it)

    def cancel(self) -> None:
        """Stop as soon as possible (also inside a long prefill); a DoneEvent still follows."""
        self._cancel.set()
        self._engine._abort_if_active(self)

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def result(self) -> DoneEvent:
        """Run to the end and return the DoneEvent."""
        for _ in self:
            pass
        assert self.done is not None
        return self.done

    def close(self) -> None:
        self._it.close()

    def __del__(self) -> None:  # pragma: no cover - releases the lock of an abandoned generation
        try:
            self._it.close()
        except Exception:
            pass

    # -- the loop --------------------------------------------------------------------------------
    def _run(self) -> Iterator[Event]:
        engine = self._engine
        while not engine._lock.acquire(timeout=0.05):
            if self._cancel.is_set():
                self.done = DoneEvent("", [], "cancelled", self.stats)
                yield self.done
                return
        sampler = drafter = None
        try:
            engine._active = self
            rt = engine._runtime
            rt.abort_flag.clear()
            if self._cancel.is_set():
                rt.abort_flag.set()
            sampler = Sampler(rt, self.options.sampling)
            drafter = engine._make_drafter(self.options.speculation, self.stats)
            yield from self._loop(rt, sampler, drafter)
        finally:
            if drafter is not None:
                drafter.close()
            if sampler is not None:
                sampler.close()
            engine._active = None
            engine._runtime.abort_flag.clear()
            engine._lock.release()

    def _loop(self, rt, sampler: Sampler, drafter: Drafter | None) -> Iterator[Event]:
        opts = self.options
        stats = self.stats
        prompt = self._prompt
        text = TextAssembler(opts.stop)
        generated: list[int] = []
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
            if whole_prompt_cached:
                n_keep -= 1  # re-decode the last prompt token to get its logits
            rt.truncate(n_keep)
            stats.cached_tokens = n_keep
            rest = prompt[n_keep:]
            with rt.abortable():
                for s in range(0, len(rest), rt.n_batch):
                    if self._cancel.is_set():
                        raise DecodeAborted()
                    rt.decode(rest[s : s + rt.n_batch])
            # A one-token re-decode rounds differently from the batched prefill on quantized models
            # (enough to flip a near-tie), so the same request twice would answer differently.
            # The prompt's last logits row is remembered and restored instead.
            if whole_prompt_cached and saved is not None and saved[0] == len(prompt):
                rt.logits_row(-1)[:] = saved[1]
                rt.prompt_logits = saved  # the truncate above dropped it
            else:
                rt.prompt_logits = (len(prompt), rt.logits_row(-1).copy())
            stats.prefill_s = time.perf_counter() - t0
            stats.prompt_tokens = len(prompt)
            sampler.prime(prompt)
            history = list(prompt)
            pending = [(sampler.sample(-1), False)]
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
                if self._cancel.is_set():
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
                    pending = []
                    n_ok = 0
                    for i in range(len(drafts) + 1):
                        tok = sampler.sample(i)
                        if i < len(drafts) and tok == drafts[i]:
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
                    pending = [(sampler.sample(-1), False)]
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
        self.done = DoneEvent(text.text, list(generated), finish or "length", stats)
        yield self.done
