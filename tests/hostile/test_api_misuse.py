"""The public API used wrongly must not crash, hang or wrap: every misuse is one clear error.

Each case runs on the real default model with a timeout, since a regression here is a hang (an
abandoned generation holding the engine) or a dead interpreter (llama.cpp called on freed
memory, an out-of-range token id), not a wrong value.
"""

from __future__ import annotations

import ctypes
import gc
import threading
from pathlib import Path

import pytest

import edgeinfer
from edgeinfer import (
    DoneEvent,
    EngineBusyError,
    EngineClosedError,
    GenerateOptions,
    InvalidOptionError,
    LoadOptions,
    SamplingOptions,
    SpeculationOptions,
)

pytestmark = pytest.mark.timeout(60)

GREEDY = SamplingOptions(temperature=0.0)


def greedy(n: int) -> GenerateOptions:
    return GenerateOptions(max_tokens=n, sampling=GREEDY)


@pytest.fixture(scope="module")
def engine(default_model_path: Path):
    e = edgeinfer.load(default_model_path, n_ctx=256, flash_attn=False)
    yield e
    e.close()


def answers(engine) -> bool:
    """The engine still serves a request (from this thread)."""
    return engine.generate("Hello", greedy(2)).result().finish_reason in ("length", "eos")


def answers_from_another_thread(engine) -> bool:
    out: list[DoneEvent] = []
    t = threading.Thread(target=lambda: out.append(engine.generate("Hi", greedy(2)).result()), daemon=True)
    t.start()
    t.join(30)
    return not t.is_alive() and len(out) == 1


# -- a closed engine -----------------------------------------------------------------------------------


@pytest.mark.slow  # loads its own engine (it closes it)
def test_every_call_on_a_closed_engine_raises(default_model_path):
    e = edgeinfer.load(default_model_path, n_ctx=128)
    made_before = e.generate("Once", greedy(4))
    e.close()
    e.close()  # twice is fine
    assert e.closed
    calls = {
        "tokenize": lambda: e.tokenize("hi"),
        "detokenize": lambda: e.detokenize([1, 2]),
        "token_text": lambda: e.token_text(1),
        "render_chat": lambda: e.render_chat([{"role": "user", "content": "hi"}]),
        "chat_tokens": lambda: e.chat_tokens([{"role": "user", "content": "hi"}]),
        "generate": lambda: e.generate("hi", greedy(2)),
        "chat": lambda: e.chat([{"role": "user", "content": "hi"}], greedy(2)),
        "logits": lambda: e.logits([1, 2, 3]),
        "reset": e.reset,
        "prepare_speculation": lambda: e.prepare_speculation("lookup"),
        "a generation made before close: next": lambda: next(made_before),
        "a generation made before close: result": made_before.result,
    }
    for what, call in calls.items():
        with pytest.raises(EngineClosedError):
            call()
            pytest.fail(f"{what} did not raise")
    assert e.n_vocab > 0  # facts about the file stay readable


@pytest.mark.slow  # loads its own engine (it closes it)
def test_close_stops_a_generation_suspended_mid_stream(default_model_path):
    e = edgeinfer.load(default_model_path, n_ctx=256)
    gen = e.generate("Once upon a time", greedy(16))
    first = next(gen)
    assert first.token >= 0
    e.close()  # must not wait for the suspended generation
    assert gen.done is not None and gen.done.finish_reason == "cancelled"
    assert gen.done.tokens[0] == first.token
    with pytest.raises(StopIteration):
        next(gen)


@pytest.mark.slow  # loads its own engine (it closes it)
def test_close_while_a_generation_runs_in_another_thread(default_model_path):
    e = edgeinfer.load(default_model_path, n_ctx=512)
    gen = e.generate("Count to a thousand: one, two,", greedy(400))
    outcome: list[object] = []
    started = threading.Event()

    def consume() -> None:
        try:
            for ev in gen:
                started.set()
            outcome.append(gen.done)
        except EngineClosedError as err:
            outcome.append(err)

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    assert started.wait(30)
    e.close()
    t.join(30)
    assert not t.is_alive()
    assert isinstance(outcome[0], EngineClosedError) or outcome[0].finish_reason == "cancelled"


@pytest.mark.slow  # loads its own engine (it closes it)
def test_a_request_waiting_for_the_engine_gets_engine_closed(default_model_path):
    e = edgeinfer.load(default_model_path, n_ctx=256)
    holder = e.generate("Once upon a time", greedy(16))
    next(holder)  # holds the engine, suspended in this thread
    errors: list[BaseException] = []
    waiting = e.generate("Hi", greedy(2))

    def wait_for_engine() -> None:
        try:
            waiting.result()
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    t = threading.Thread(target=wait_for_engine, daemon=True)
    t.start()
    while waiting.state != "waiting":
        t.join(0.01)
    e.close()
    t.join(30)
    assert not t.is_alive() and len(errors) == 1 and isinstance(errors[0], EngineClosedError)


@pytest.mark.slow  # loads its own engine (it closes it)
def test_close_during_speculation_preparation(default_model_path):
    """The engine closed while its draft model is being prepared (here: from the progress
    callback, just before the draft loads): the preparation ends with EngineClosedError, without
    touching the freed target (the vocabulary check runs under the draft models' lock)."""
    e = edgeinfer.load(default_model_path, n_ctx=128)

    def close_on_load(event) -> None:
        if event.stage == "load":
            e.close()

    with pytest.raises(EngineClosedError):
        e.prepare_speculation(f"draft={default_model_path}", progress=close_on_load)
    assert e.closed


# -- token ids ----------------------------------------------------------------------------------------


def test_token_ids_are_range_and_type_checked(engine):
    n = engine.n_vocab
    for bad in (-1, n, n + 10**9, 2**63):
        with pytest.raises(InvalidOptionError, match="outside the vocabulary"):
            engine.token_text(bad)
        with pytest.raises(InvalidOptionError, match="outside the vocabulary"):
            engine.detokenize([1, bad])
        with pytest.raises(InvalidOptionError, match="outside the vocabulary"):
            engine.generate([1, bad], greedy(2))
        with pytest.raises(InvalidOptionError, match="outside the vocabulary"):
            engine.logits([1, 2, bad])
    for bad in ("a", 1.5, None):
        with pytest.raises(InvalidOptionError, match="integer"):
            engine.token_text(bad)
    with pytest.raises(InvalidOptionError):
        engine.detokenize("abc")
    assert engine.token_text(n - 1) is not None and answers(engine)


# -- abandoned generations ----------------------------------------------------------------------------


def test_leaving_a_loop_early_releases_the_engine(engine):
    for _ in engine.generate("Once upon a time", greedy(16)):
        break
    assert answers(engine) and answers_from_another_thread(engine)


def test_dropping_a_started_generation_releases_the_engine(engine):
    gen = engine.generate("Once upon a time", greedy(16))
    next(gen)
    del gen
    assert answers_from_another_thread(engine) and answers(engine)


def test_a_generation_dropped_inside_a_reference_cycle_is_given_up_once_the_collector_freed_it(engine):
    """The library never runs the collector (nor any code when a handle is garbage): a generation
    in an unreachable cycle is alive until the collector frees it, so until then it is this
    thread's unfinished generation; after that the next request gives it up."""

    class Holder:
        pass

    gc.disable()  # (the collector must not run between the two checks below)
    try:
        h = Holder()
        h.me = h
        h.gen = engine.generate("Once upon a time", greedy(16))
        next(h.gen)
        del h  # only the cyclic collector can free it now
        with pytest.raises(EngineBusyError, match="unfinished generation"):
            answers(engine)
        gc.collect()
        assert answers(engine)
    finally:
        gc.enable()


def test_a_second_request_of_the_same_thread_raises_instead_of_deadlocking(engine):
    first = engine.generate("Once upon a time", greedy(16))
    next(first)
    second = engine.generate("Hi", greedy(2))
    with pytest.raises(EngineBusyError, match="unfinished generation"):
        next(second)
    with pytest.raises(EngineBusyError):
        engine.logits([1, 2, 3])
    with pytest.raises(EngineBusyError):
        engine.reset()
    # the first one is untouched and can go on
    rest = first.result()
    assert rest.finish_reason in ("length", "eos") and len(rest.tokens) > 1
    assert answers(engine)


def test_a_cancelled_unfinished_generation_gives_way_to_the_next_request(engine):
    first = engine.generate("Once upon a time", greedy(16))
    next(first)
    first.cancel()
    assert answers(engine)
    assert first.done is not None and first.done.finish_reason == "cancelled"


def test_an_explicitly_closed_generation_keeps_what_it_made(engine):
    gen = engine.generate("1, 2, 3, 4,", greedy(20))
    got = [next(gen).token for _ in range(3)]
    gen.close()
    assert gen.done.finish_reason == "cancelled" and gen.done.tokens[: len(got)] == got
    assert gen.result() is gen.done and answers(engine)


def test_closing_a_generation_that_never_ran(engine):
    gen = engine.generate("Hi", greedy(5))
    gen.close()
    assert gen.result().finish_reason == "cancelled" and answers(engine)


def test_many_abandoned_generations_leave_nothing_held(engine):
    for i in range(8):
        gen = engine.generate(f"Item {i}:", greedy(4))
        if i % 2:
            next(gen)
    del gen  # the last one was still referenced: a kept generation holds the engine, by design
    assert answers_from_another_thread(engine)


# -- wrong option types and unbounded numbers -------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        GenerateOptions(max_tokens="5"),  # type: ignore[arg-type]
        GenerateOptions(max_tokens=2**40),
        GenerateOptions(stop="###"),  # type: ignore[arg-type]
        GenerateOptions(stop=(1,)),  # type: ignore[arg-type]
        GenerateOptions(sampling={"temperature": 0}),  # type: ignore[arg-type]
        GenerateOptions(speculation="lookup"),  # type: ignore[arg-type]
        GenerateOptions(sampling=SamplingOptions(top_k=1.5)),  # type: ignore[arg-type]
        GenerateOptions(sampling=SamplingOptions(top_k=2**40)),
        GenerateOptions(sampling=SamplingOptions(temperature="hot")),  # type: ignore[arg-type]
        GenerateOptions(sampling=SamplingOptions(temperature=True)),
        GenerateOptions(sampling=SamplingOptions(temperature=float("inf"))),
        GenerateOptions(sampling=SamplingOptions(top_p=float("nan"))),
        GenerateOptions(sampling=SamplingOptions(top_p=5.0)),
        GenerateOptions(sampling=SamplingOptions(min_p=float("inf"))),
        GenerateOptions(sampling=SamplingOptions(repeat_penalty=float("nan"))),
        GenerateOptions(sampling=SamplingOptions(seed="7")),  # type: ignore[arg-type]
        GenerateOptions(sampling=SamplingOptions(repeat_last_n=None)),  # type: ignore[arg-type]
        GenerateOptions(speculation=SpeculationOptions(method=3)),  # type: ignore[arg-type]
        GenerateOptions(speculation=SpeculationOptions(method="lookup", draft_max="8")),  # type: ignore[arg-type]
        GenerateOptions(speculation=SpeculationOptions(method="lookup", adaptive="no")),  # type: ignore[arg-type]
        GenerateOptions(speculation=SpeculationOptions(method="draft", draft_model=5)),  # type: ignore[arg-type]
        {"max_tokens": 5},
    ],
    ids=lambda o: repr(o)[:60],
)
def test_wrong_generate_options_are_one_line_errors(engine, options):
    with pytest.raises(InvalidOptionError):
        engine.generate("Hi", options)  # type: ignore[arg-type]


def test_top_k_beyond_the_vocabulary_is_refused(engine):
    with pytest.raises(InvalidOptionError, match="vocabulary size"):
        engine.generate("Hi", GenerateOptions(sampling=SamplingOptions(top_k=engine.n_vocab + 1)))
    assert engine.generate("Hi", GenerateOptions(max_tokens=2, sampling=SamplingOptions(top_k=engine.n_vocab, seed=1)))


def test_wrong_prompt_and_message_types(engine):
    for prompt in (123, None, 4.5, b"bytes"):
        with pytest.raises(InvalidOptionError):
            engine.generate(prompt, greedy(2))  # type: ignore[arg-type]
    for messages in ("hi", {"role": "user", "content": "hi"}, [1, 2], [{"role": "user"}],
                     [{"role": "user", "content": 5}], None):
        with pytest.raises(InvalidOptionError):
            engine.chat(messages, greedy(2))  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError):
        engine.chat([{"role": "user", "content": "hi"}], greedy(2), system=5)  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError):
        engine.tokenize(5)  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError):
        engine.logits([1, 2, 3], start="0")  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError):
        engine.prepare_speculation(42)  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError):
        GenerateOptions().with_sampling(temprature=0.5)
    for spec in (5, None, "lookup=3", "warp"):
        with pytest.raises(InvalidOptionError):
            SpeculationOptions.parse(spec)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "load_kw",
    [dict(n_threads=9999), dict(n_threads=2**31), dict(n_threads="2"), dict(n_threads=0), dict(n_ctx=2**40),
     dict(n_ctx="4096"), dict(n_batch=2**32), dict(n_batch=1.5), dict(kv_type=8), dict(flash_attn="yes")],
    ids=lambda d: repr(d),
)
def test_wrong_load_options_are_refused_before_llama_cpp(default_model_path, load_kw):
    with pytest.raises(InvalidOptionError):
        edgeinfer.load(default_model_path, **load_kw)


def test_wrong_load_arguments(default_model_path):
    with pytest.raises(InvalidOptionError):
        edgeinfer.load(default_model_path, options={"n_ctx": 128})  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError):
        edgeinfer.load(12345)  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError, match="threads must be in"):
        LoadOptions(n_threads=10**6).validate()


# -- ctypes structs ----------------------------------------------------------------------------------


def test_assigning_an_undeclared_struct_field_fails_loudly():
    from edgeinfer.engine.llama.runtime import backend, set_fields

    ll = backend()
    params = ll.llama_model_default_params()
    with pytest.raises(AttributeError, match="use_mmap"):
        set_fields(params, n_gpu_layers=0, use_mmap=True)  # 0.3.36 has load_mode instead
    set_fields(params, n_gpu_layers=0, load_mode=ll.LLAMA_LOAD_MODE_MMAP)
    assert params.load_mode == ll.LLAMA_LOAD_MODE_MMAP

    class Pair(ctypes.Structure):
        _fields_ = [("a", ctypes.c_int)]

    class Triple(Pair):
        _fields_ = [("b", ctypes.c_int)]

    t = set_fields(Triple(), a=1, b=2)  # fields of base classes count
    assert (t.a, t.b) == (1, 2)
    with pytest.raises(AttributeError, match="'c'"):
        set_fields(t, c=3)


def test_the_model_is_memory_mapped_as_asked(engine, default_model_path):
    """load_mode=MMAP really reaches llama.cpp: the GGUF file is mapped into this process."""
    maps = Path("/proc/self/maps").read_text()
    assert str(Path(default_model_path).resolve()) in maps


def test_engine_llama_assigns_no_struct_field_directly():
    """Every llama.cpp struct the engine fills goes through set_fields (a plain `params.x = ...`
    on a ctypes struct silently accepts a field the struct lacks)."""
    import ast

    import edgeinfer.engine.llama.runtime as llama_module
    import edgeinfer.engine.core.sampler as sampler_module

    for module in (llama_module, sampler_module):
        tree = ast.parse(Path(module.__file__).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                            and target.value.id in ("mparams", "cparams", "params", "b")):
                        allowed = target.value.id == "b" and target.attr == "n_tokens"  # batch: fields checked once
                        assert allowed, f"{module.__name__}:{node.lineno} sets {target.value.id}.{target.attr} directly"


def test_the_child_processes_assign_only_declared_struct_fields():
    """The load probe and the quantizer child import nothing from edgeinfer (no set_fields): every
    field they assign on a llama.cpp struct must be one the installed struct declares."""
    import ast

    import edgeinfer.load_probe as probe_module
    import edgeinfer.quantize_child as quantize_module
    from edgeinfer.engine.llama.runtime import backend

    ll = backend()
    structs = {"mparams": ll.llama_model_params, "cparams": ll.llama_context_params,
               "params": ll.llama_model_quantize_params}
    checked = 0
    for module in (probe_module, quantize_module):
        tree = ast.parse(Path(module.__file__).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                            and target.value.id in structs:
                        declared = {f[0] for f in structs[target.value.id]._fields_}
                        assert target.attr in declared, f"{module.__name__}:{node.lineno} sets undeclared " \
                                                        f"{target.value.id}.{target.attr}"
                        checked += 1
    assert checked >= 15  # the probe's 7 context/model fields and the quantizer's 9
