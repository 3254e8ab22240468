"""Timing setups on the workload: one model load per load key, every speculation of it on that engine.

A setup's time for one request is what a new request would take on a loaded model: the prompt read
from an empty cache, then the answer. The prompt's part (time to the first token) depends only on
the load key: speculation starts after it. So each request is read once per load key from an empty
cache (`Engine.reset`), and each speculation then decodes the answer after that prompt, which the
cache still holds (the engine re-reads only the prompt's last token, one step, as the fresh request
did to sample its first token): its time is that prompt time plus its own decode time. A method
whose drafter keeps a cache of its own (a draft model, a head) is measured from empty caches
instead, drafter included, as a new request would be (`SpeculationMethod.fresh`).

Each measured run of a setup (a setup on the workload at one level) drafts from a memory scope of
its own (SpeculationOptions.memory_scope), never used before: `suffix` and `auto` remember answers,
and a run that drafted from another run's answers to the same prompts would be flattered.

A workload's speed is the generated tokens over the whole time of its requests (prompt and answer):
a long prompt read slowly costs a setup what it costs its user. Answers are greedy, so every
setup of one quant writes the same tokens (speculation is lossless).

Levels are successive halving's budgets: 0 reads only the short requests and 16 tokens of their
answers, 1 every request and 48 tokens, 2 the whole workload.
"""

from __future__ import annotations

import itertools
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from ..engine.core.options import SpeculationOptions
from ..errors import ContextLengthError, EdgeInferError
from .space import METHODS, Setup
from .workload import WorkItem, Workload

if TYPE_CHECKING:
    from ..engine import Engine
    from ..engine.core.options import GenerateOptions
    from ..store import Store

__all__ = ["Level", "LEVELS", "Measurement", "Measurer", "ItemTime", "SHORT_PROMPT_CHARS"]

log = logging.getLogger(__name__)

SHORT_PROMPT_CHARS = 2000  # a request whose messages are shorter than this counts as short (level 0)
_CHARS_PER_TOKEN = 4  # English and code in a BPE vocabulary, for estimates only
_ESTIMATE_MARGIN = 1.25  # a group's estimate is from medians: leave room for the slower half


@dataclass(frozen=True)
class Level:
    index: int
    all_items: bool  # False: the short requests only
    max_tokens: int | None  # a cap on each answer (None: the workload's own)

    def items(self, workload: Workload) -> list[WorkItem]:
        if self.all_items:
            return list(workload.items)
        short = [i for i in workload.items if _chars(i) <= SHORT_PROMPT_CHARS]
        return short or list(workload.items[:1])

    def tokens(self, item: WorkItem) -> int:
        return item.max_tokens if self.max_tokens is None else min(item.max_tokens, self.max_tokens)


LEVELS: tuple[Level, ...] = (Level(0, False, 16), Level(1, True, 48), Level(2, True, None))


@dataclass(frozen=True)
class ItemTime:
    """One request of the workload: time to its first token, time after it, tokens written."""

    ttft_s: float
    decode_s: float
    generated: int
    drafted: int = 0
    accepted: int = 0


@dataclass(frozen=True)
class Measurement:
    """A setup on (part of) the workload at one level."""

    level: int
    tok_s: float  # generated tokens / (every request's time to first token + decode time)
    decode_tok_s: float  # tokens after the first / decode time
    ttft_s: float  # median over the requests
    seconds: float  # the requests' whole time
    generated: int
    acceptance: float | None  # drafted tokens accepted (None: nothing drafted)
    at: float  # when (epoch seconds)
    loadavg: float  # the machine's 1-minute load average then

    @classmethod
    def of(cls, level: int, times: Sequence[ItemTime]) -> Measurement:
        seconds = sum(t.ttft_s + t.decode_s for t in times)
        generated = sum(t.generated for t in times)
        decode_s = sum(t.decode_s for t in times)
        after_first = sum(max(0, t.generated - 1) for t in times)
        drafted = sum(t.drafted for t in times)
        return cls(level=level, tok_s=generated / seconds if seconds > 0 else 0.0,
                   decode_tok_s=after_first / decode_s if decode_s > 0 else 0.0,
                   ttft_s=statistics.median(t.ttft_s for t in times), seconds=seconds, generated=generated,
                   acceptance=sum(t.accepted for t in times) / drafted if drafted else None,
                   at=time.time(), loadavg=os.getloadavg()[0])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> Measurement:
        if not isinstance(data, dict):
            raise ValueError("a measurement must be an object")
        try:
            m = cls(**data)
        except TypeError as e:
            raise ValueError(str(e)) from None
        for name in ("tok_s", "decode_tok_s", "ttft_s", "seconds", "at", "loadavg"):
            v = getattr(m, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1e12:
                raise ValueError(f"bad {name} {v!r}")
        if m.level not in range(len(LEVELS)):
            raise ValueError(f"bad level {m.level!r}")
        return m


def _chars(item: WorkItem) -> int:
    return sum(len(m["content"]) for m in item.messages)


class _Stopped(Exception):
    """The budget ended a request."""


class Measurer:
    """Loads each load key once and times its setups (see the module). `stop()` is polled between
    requests: True ends the group early, with what was measured whole."""

    def __init__(self, store: Store, workload: Workload, *, n_ctx: int | None = None,
                 stop: Callable[[], bool] = lambda: False, on_note: Callable[[str], None] = lambda _m: None):
        self.store = store
        self.workload = workload
        self.n_ctx = n_ctx
        self.stop = stop
        self.note = on_note
        self.prompt_s: dict[tuple[Any, ...], dict[str, float]] = {}  # load key -> request name -> ttft
        # What the estimates of later groups are made from: (model bytes, seconds) of each load,
        # (model bytes, prompt characters, seconds) of each prompt, (model bytes, seconds a token).
        self.loads: list[tuple[int, float]] = []
        self.prompts: list[tuple[int, int, float]] = []
        self.tokens: list[tuple[int, float]] = []
        # Memory scopes of the measured runs: a prefix of this measurer's own (were an engine's memory
        # ever kept on disk, another tune's runs would not find theirs) and a run's number.
        self._scope_prefix = f"tune-{os.urandom(6).hex()}"
        self._runs = itertools.count()

    def estimate(self, setups: Sequence[Setup], level: Level) -> float:
        """Seconds measuring `setups` (one load key) at `level` should take, from what loads, prompts
        and tokens took so far (scaled by the model file's size); 0 before anything was measured."""
        if not self.loads:
            return 0.0
        size = self._size(setups[0].model)

        def scaled(obs: list[tuple[int, float]]) -> float:
            return statistics.median(t * size / max(b, 1) for b, t in obs[-12:]) if obs else 0.0

        per_char = statistics.median(t * size / max(b, 1) / max(c, 1) for b, c, t in self.prompts[-12:]) \
            if self.prompts else 0.0
        per_token = scaled(self.tokens)
        known = self.prompt_s.get(setups[0].load_key, {})
        total = scaled(self.loads)
        for item in level.items(self.workload):
            prompt = known.get(item.name, per_char * _chars(item))
            fresh = sum(1 for s in setups if s.speculate == "off" or METHODS[s.speculation().method].fresh)
            total += prompt * max(1, fresh) + len(setups) * level.tokens(item) * per_token
        return total * _ESTIMATE_MARGIN

    def prefill_seconds(self, ref: str, tokens: int) -> float:
        """Seconds `ref` should take to read `tokens` tokens, from the prompts timed so far (0 before any)."""
        if not self.prompts:
            return 0.0
        size = self._size(ref)
        per_char = statistics.median(t * size / max(b, 1) / max(c, 1) for b, c, t in self.prompts[-12:])
        return per_char * _CHARS_PER_TOKEN * tokens

    def projected(self, setup: Setup, m: Measurement) -> float:
        """The whole workload's tok/s that a measurement at a lower level predicts: the prompts' times
        (those this load key read; the others at its time per character) and every answer's tokens
        at the measured decode speed. A short level's own tok/s is mostly prompt time, the workload's
        mostly decoding: on the 1.5B the 16-token screen put Q4_K_S under Q4_K_M and Q5_K_M, and on
        the whole workload it was the fastest rung (RESULTS.md, tune against an exhaustive search)."""
        if m.level >= LEVELS[-1].index or m.decode_tok_s <= 0:
            return m.tok_s
        items = self.workload.items
        known = self.prompt_s.get(setup.load_key, {})
        timed = [(known[i.name], _chars(i)) for i in items if i.name in known]
        if not timed:
            return m.tok_s
        per_char = sum(t for t, _ in timed) / max(1, sum(c for _, c in timed))
        prompts = sum(known.get(i.name, per_char * _chars(i)) for i in items)
        tokens = sum(i.max_tokens for i in items)
        return tokens / (prompts + sum(max(0, i.max_tokens - 1) for i in items) / m.decode_tok_s)

    def _size(self, ref: str) -> int:
        m = self.store.find(ref)
        return m.size if m is not None else 1

    def measure(self, setups: Sequence[Setup], level: Level,
                on_result: Callable[[Setup, Measurement | None, str], None], remeasure: bool = False) -> None:
        """Measure `setups` (one load key) at `level`; each result (None and why, when a setup cannot
        run) goes to `on_result` as soon as it is known. The prompts' times of an earlier group of
        this load key are used again unless `remeasure`."""
        from ..engine import load

        key = setups[0].load_key
        assert all(s.load_key == key for s in setups), "one load key per group"
        t0 = time.perf_counter()
        try:
            engine = load(setups[0].model, setups[0].load_options(self.n_ctx), store=self.store)
        except EdgeInferError as e:
            for s in setups:
                on_result(s, None, f"cannot load: {e}")
            return
        self.loads.append((self._size(setups[0].model), time.perf_counter() - t0))
        with engine:
            runnable = []
            for s in setups:
                try:
                    engine.prepare_speculation(s.speculation())
                    runnable.append(s)
                except EdgeInferError as e:
                    on_result(s, None, f"speculation {s.speculate}: {e}")
            if runnable:
                self._measure_on(engine, runnable, level, on_result, remeasure)

    def _measure_on(self, engine: Engine, setups: list[Setup], level: Level,
                    on_result: Callable[[Setup, Measurement | None, str], None], remeasure: bool) -> None:
        model = engine.manifest.ref if engine.manifest else engine.path
        fresh = [s for s in setups if s.speculate == "off" or METHODS[s.speculation().method].fresh]
        after_prompt = [s for s in setups if s not in fresh]
        times: dict[str, list[ItemTime]] = {s.key: [] for s in setups}
        scopes = {s.key: f"{self._scope_prefix}-{next(self._runs)}" for s in setups}  # one fresh scope a run
        prompt_s = self.prompt_s.setdefault(setups[0].load_key, {})
        try:
            self._items(engine, setups, level, model, fresh, after_prompt, times, prompt_s, remeasure, scopes)
        except _Stopped:
            pass
        for s in setups:
            done = times[s.key]
            if len(done) == len(level.items(self.workload)):
                on_result(s, Measurement.of(level.index, done), "")
            elif done:
                on_result(s, None, "stopped before the end of the workload")

    def _items(self, engine: Engine, setups: list[Setup], level: Level, model: Any, fresh: list[Setup],
               after_prompt: list[Setup], times: dict[str, list[ItemTime]], prompt_s: dict[str, float],
               remeasure: bool, scopes: dict[str, str]) -> None:
        def spec(s: Setup) -> SpeculationOptions:
            return replace(s.speculation(), memory_scope=scopes[s.key])

        for item in level.items(self.workload):
            if self.stop():
                break
            messages = item.chat_messages(model)
            n = level.tokens(item)
            for s in fresh:
                engine.reset()
                t = self._run(engine, messages, item.options(spec(s), n))
                times[s.key].append(t)
                if s.speculate == "off":
                    prompt_s[item.name] = t.ttft_s
                    self._observe(setups[0], item, t)
            if after_prompt:
                if not any(s.speculate == "off" for s in fresh) and (remeasure or item.name not in prompt_s):
                    engine.reset()  # the prompt read from an empty cache: this load key's time to first token
                    t = self._run(engine, messages, item.options(SpeculationOptions(), 1))
                    prompt_s[item.name] = t.ttft_s
                    self._observe(setups[0], item, t)
                for s in after_prompt:
                    t = self._run(engine, messages, item.options(spec(s), n))
                    times[s.key].append(ItemTime(prompt_s[item.name], t.decode_s, t.generated, t.drafted, t.accepted))
                    self._observe(s, None, t)

    def _observe(self, setup: Setup, item: WorkItem | None, t: ItemTime) -> None:
        size = self._size(setup.model)
        if item is not None:
            self.prompts.append((size, _chars(item), t.ttft_s))
        if t.generated > 1 and t.decode_s > 0:
            self.tokens.append((size, t.decode_s / (t.generated - 1)))

    def _run(self, engine: Engine, messages: list[dict[str, str]], options: GenerateOptions) -> ItemTime:
        """One request; `stop()` is polled at every event (a token, a chunk of a long prompt): when
        it says so the request is cancelled and the group ends (_Stopped), so the budget holds."""
        try:
            gen = engine.chat(messages, options)
            for _event in gen:
                if not gen.cancelled and self.stop():
                    gen.cancel()
            done = gen.result()
        except ContextLengthError as e:  # the workload's, not the setup's: no setup can run it
            raise ContextLengthError(f"a workload request does not fit in {engine.name}'s context: {e}") from None
        if done.finish_reason == "cancelled":
            raise _Stopped
        st = done.stats
        spec = st.speculation
        return ItemTime(ttft_s=st.ttft_s, decode_s=st.decode_s, generated=st.generated_tokens,
                        drafted=spec.drafted if spec else 0, accepted=spec.accepted if spec else 0)
