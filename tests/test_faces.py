"""Engine and BatchEngine are two faces of one core: each behaviour they share is run here on both.

One handle type (`Generation`: the same properties, poll, close, a dropped handle given up without
the garbage collector's help), one load path (every argument type-checked the same way), every
request option on both (`logprobs`, `system`, `notify`, `tools`), one KV-state API (`save_slot`,
`restore_slot`, `erase_slot`, a state saved on one face restored on the other). The flash-attention
rule on both faces: tests/test_flash_choice.py. On an F16 copy of the default model (its batched
and one-token paths round alike: tests/greedy_compare.py), greedy; the BatchEngine has one slot, so
that "the next request runs" proves that a slot was freed.
"""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import numpy as np
import pytest

import edgeinfer
from edgeinfer import (
    BatchEngine,
    BatchOptions,
    DoneEvent,
    GenerateOptions,
    Generation,
    InvalidOptionError,
    SamplingOptions,
    ScoredTokenEvent,
    TokenEvent,
    ToolCallEvent,
)

pytestmark = pytest.mark.timeout(120)

FACES = ("Engine", "BatchEngine")
ONE_SLOT = BatchOptions(parallel=1, max_backlog=2, calibrate_when_idle=False)


def greedy(n: int) -> GenerateOptions:
    return GenerateOptions(max_tokens=n, sampling=SamplingOptions(temperature=0.0))


def open_face(face: str, path: Path, **kw):
    if face == "Engine":
        return edgeinfer.load(path, n_ctx=1024, flash_attn=False, **kw)
    return BatchEngine.load(path, batch=ONE_SLOT, n_ctx=1024, flash_attn=False, **kw)


@pytest.fixture(scope="module")
def f16(default_model_copy) -> Path:
    return default_model_copy("F16")


@pytest.fixture(scope="module", params=FACES)
def engine(request, f16: Path):
    with open_face(request.param, f16) as e:
        yield e


@pytest.fixture(scope="module")
def reference(f16: Path):
    """An Engine of its own, for what either face's answers are compared with."""
    with edgeinfer.load(f16, n_ctx=1024, flash_attn=False) as e:
        yield e


def serves(engine) -> bool:
    """The engine's (only) slot is free: a new request runs to its end."""
    return engine.generate("Hello", greedy(2)).result().finish_reason in ("length", "eos")


# -- one handle ---------------------------------------------------------------------------------------


def test_one_handle_type_with_the_same_properties(engine):
    assert edgeinfer.BatchGeneration is Generation
    gen = engine.generate("Once upon a time", greedy(6))
    assert type(gen) is Generation
    assert gen.state in ("new", "waiting") and not gen.finished and not gen.cancelled
    assert gen.prompt_tokens == engine.tokenize("Once upon a time") and gen.options.max_tokens == 6
    first = next(gen)
    assert isinstance(first, TokenEvent) and gen.state == "running"
    done = gen.result()
    assert gen.state == "done" and gen.finished and gen.done is done and done.tokens[0] == first.token
    assert gen.stats is done.stats and done.stats.generated_tokens == len(done.tokens) == 6


def test_polling_reads_what_iterating_reads(engine, reference):
    expected = reference.generate("The capital of France", greedy(8)).result()
    gen = engine.generate("The capital of France", greedy(8))
    events = []
    while not gen.finished:
        events += gen.poll()  # (an Engine's poll takes one step of the core)
    assert isinstance(events[-1], DoneEvent) and events[-1] is gen.done
    assert [e.token for e in events if isinstance(e, TokenEvent)] == expected.tokens == gen.done.tokens
    assert gen.poll() == []


def test_notify_says_when_events_arrive(engine):
    calls: list[int] = []
    gen = engine.generate("Once upon a time", greedy(4), notify=lambda: calls.append(1))
    done = gen.result()
    assert len(calls) >= len(done.tokens)  # at least one call per step that made a token
    with pytest.raises(InvalidOptionError, match="notify"):
        engine.generate("Hi", greedy(2), notify="soon")  # type: ignore[arg-type]


def test_close_mid_stream_keeps_what_was_made_and_frees_the_slot(engine):
    gen = engine.generate("1, 2, 3, 4,", greedy(40))
    got = [next(gen).token for _ in range(3)]
    gen.close()
    with pytest.raises(StopIteration):
        next(gen)
    done = gen.result()  # (a BatchEngine's request ends at its scheduler's next step)
    assert done.finish_reason == "cancelled" and done.tokens[:3] == got and gen.done is done
    assert serves(engine)


def test_cancel_from_another_thread_ends_with_a_cancelled_done_event(engine):
    gen = engine.generate("Once upon a time", greedy(200))
    next(gen)
    threading.Thread(target=gen.cancel).start()
    done = gen.result()
    assert gen.cancelled and done.finish_reason == "cancelled" and 1 <= len(done.tokens) < 200
    assert serves(engine)


def test_a_dropped_generation_is_given_up_without_the_collector(engine):
    gc.disable()  # nothing may depend on the collector: a dropped handle is noticed by the engine
    try:
        gen = engine.generate("Once upon a time", greedy(200))
        next(gen)
        del gen
        assert serves(engine)
        waiting = engine.generate("Once upon a time", greedy(200))  # dropped before its first read
        del waiting
        assert serves(engine)
    finally:
        gc.enable()


def test_a_dropped_generation_whose_reader_fell_behind_is_noticed_by_the_idle_scheduler(f16):
    """A BatchEngine pauses a request whose reader is `max_backlog` events behind and then has
    nothing to step: it still looks for a handle its reader dropped (every ABANDONED_CHECK_S), and
    ends that request without any new request waking it. (An Engine's suspended generation is one
    nobody steps: the next request gives it up, as above.)"""
    with open_face("BatchEngine", f16) as engine:
        gen = engine.generate("Once upon a time", greedy(200))
        next(gen)
        while gen.stats.generated_tokens < 1 + ONE_SLOT.max_backlog:  # paused for its reader
            threading.Event().wait(0.01)
        del gen
        while engine.metrics().requests_finished.get("cancelled") != 1:
            threading.Event().wait(0.05)
        assert engine.metrics().active == 0 and serves(engine)


def test_a_grammar_compiled_for_a_request_that_never_runs_is_freed(engine, monkeypatch):
    """A request's grammar is compiled when it is made (in the caller's thread) and the request owns
    it: one closed before its first read (on an Engine it never reaches the core) frees it, on
    either face, without the garbage collector (every sampler is held here, so no finalizer runs)."""
    from edgeinfer.engine.core.sampler import Sampler

    made: list[Sampler] = []
    closed: list[Sampler] = []
    real_init, real_close = Sampler.__init__, Sampler.close

    def init(self, *args, **kw):
        real_init(self, *args, **kw)
        made.append(self)

    def close(self):
        closed.append(self)
        real_close(self)

    monkeypatch.setattr(Sampler, "__init__", init)
    monkeypatch.setattr(Sampler, "close", close)
    gen = engine.generate("Answer:", GenerateOptions(max_tokens=4, grammar='root ::= "yes" | "no"'))
    assert len(made) == 1  # compiled here, before anything ran
    gen.close()
    assert gen.result().finish_reason == "cancelled"
    pause = threading.Event()
    for _ in range(200):  # (a BatchEngine frees it at its scheduler's next step)
        if any(s is made[0] for s in closed):
            break
        pause.wait(0.05)
    assert any(s is made[0] for s in closed)
    assert serves(engine)


# -- every option on both faces -----------------------------------------------------------------------


def test_logprobs_match_an_independent_softmax(engine, reference):
    prompt = reference.tokenize("The quick brown fox")
    events = [e for e in engine.generate(prompt, greedy(5), logprobs=2) if isinstance(e, TokenEvent)]
    assert all(isinstance(e, ScoredTokenEvent) for e in events)
    tokens = [e.token for e in events]
    rows = reference.logits(prompt + tokens, start=len(prompt) - 1)[: len(tokens)].astype(np.float64)
    m = rows.max(axis=1, keepdims=True)
    ref = rows - (m + np.log(np.exp(rows - m).sum(axis=1, keepdims=True)))  # log-softmax
    for e, r in zip(events, ref):  # (the reference reads the text in one batch: batch-shape rounding)
        assert e.logprob == pytest.approx(r[e.token], abs=5e-2)
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0][0] == e.token  # greedy: the top one
    with pytest.raises(InvalidOptionError, match="logprobs"):
        engine.generate("Hi", greedy(2), logprobs=21)
    with pytest.raises(InvalidOptionError, match="logprobs"):
        engine.chat([{"role": "user", "content": "Hi"}], greedy(2), logprobs=True)


def test_system_goes_first_unless_the_conversation_has_one(engine):
    user = [{"role": "user", "content": "Hi"}]
    gen = engine.chat(user, greedy(2), system="Answer in French.")
    assert gen.prompt_tokens == engine.chat_tokens([{"role": "system", "content": "Answer in French."}, *user])
    own = [{"role": "system", "content": "Be brief."}, *user]
    assert engine.chat(own, greedy(2), system="Answer in French.").prompt_tokens == engine.chat_tokens(own)
    gen.close()
    with pytest.raises(InvalidOptionError, match="system"):
        engine.chat(user, greedy(2), system=["no"])  # type: ignore[arg-type]


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_tool_calls_are_a_layer_of_the_one_handle(engine):
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    gen = engine.chat(messages, greedy(40), tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert type(gen) is Generation
    events = list(gen)
    calls = [e for e in events if isinstance(e, ToolCallEvent)]
    assert calls and calls[-1].call is not None and calls[-1].call.name == "get_weather"
    assert gen.done is events[-1] and gen.done.finish_reason == "tool_calls" and gen.done.tool_calls == (calls[-1].call,)
    assert gen.stats.generated_tokens == len(gen.done.tokens)
    # tool_choice "none": nothing offered, nothing parsed: the plain chat
    plain = engine.chat(messages, greedy(6), tools=[WEATHER], tool_choice="none")
    assert plain.prompt_tokens == engine.chat_tokens(messages) and plain.result().tool_calls == ()


# -- one KV-state API ---------------------------------------------------------------------------------


@pytest.mark.parametrize("saver, restorer", [("Engine", "BatchEngine"), ("BatchEngine", "Engine")])
def test_a_slot_saved_on_one_face_is_restored_on_the_other(saver, restorer, f16, tmp_path):
    conversation = [{"role": "user", "content": "Name three rivers of Europe, then three of Asia. " * 8}]
    path = tmp_path / "chat.kv"
    with open_face(saver, f16) as engine:
        first = engine.chat(conversation, greedy(8)).result()
        info = engine.save_slot(0, path, conversation)
        assert info.written and info.tokens > 50
        assert engine.erase_slot(0) == info.tokens and engine.erase_slot(0) == 0
        with pytest.raises(InvalidOptionError, match="slot"):
            engine.save_slot(engine.parallel, path)
    with open_face(restorer, f16) as engine:
        result = engine.restore_slot(0, path, conversation)
        assert result and result.tokens == info.tokens
        again = engine.chat(conversation, greedy(8)).result()
        assert again.stats.cached_tokens >= info.tokens - 1 and again.tokens == first.tokens


# -- one load path --------------------------------------------------------------------------------------


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("kw, what", [
    ({"options": {"n_ctx": 512}}, "options must be LoadOptions"),
    ({"model": 5}, "model must be"),
    ({"store": "elsewhere"}, "store must be a Store"),
    ({"speculation": 5}, "speculation must be"),
    ({"speculation": "fast"}, "unknown speculation method"),
    ({"progress": "loud"}, "progress must be a callable"),
    ({"n_ctxx": 512}, "unknown load option"),
    ({"n_ctx": "512"}, "context size must be an integer"),
])
def test_every_load_argument_is_checked_the_same_way_before_llama_cpp(face, kw, what):
    load = edgeinfer.load if face == "Engine" else BatchEngine.load
    with pytest.raises(InvalidOptionError, match=what):
        load(**kw)


@pytest.mark.parametrize("batch, what", [
    ({"parallel": 2}, "batch must be BatchOptions"),
    (BatchOptions(parallel="2"), "parallel must be an integer"),  # type: ignore[arg-type]
    (BatchOptions(max_backlog=2.5), "max_backlog must be an integer"),  # type: ignore[arg-type]
    (BatchOptions(margin="a little"), "margin must be a finite number"),  # type: ignore[arg-type]
    (BatchOptions(calibrate_when_idle="no"), "calibrate_when_idle must be True or False"),  # type: ignore[arg-type]
    (BatchOptions(cost_curve=[0.01]), "cost_curve must be"),  # type: ignore[arg-type]
    (BatchOptions(cost_curve={"1": 0.01}), "cost_curve rows must be an integer"),  # type: ignore[dict-item]
])
def test_batch_options_are_type_checked(batch, what):
    with pytest.raises(InvalidOptionError, match=what):
        BatchEngine.load(batch=batch)
