"""The engine on the real default model: our decode loop against llama-cpp-python's own."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import edgeinfer
from edgeinfer import (
    ContextLengthError,
    DoneEvent,
    EngineClosedError,
    GenerateOptions,
    InvalidOptionError,
    SamplingOptions,
    TokenEvent,
)

pytestmark = pytest.mark.slow

GREEDY = SamplingOptions(temperature=0.0)


def greedy(n: int, **kw) -> GenerateOptions:
    return GenerateOptions(max_tokens=n, sampling=GREEDY, **kw)


def collect(gen):
    events = list(gen)
    assert isinstance(events[-1], DoneEvent)
    assert all(isinstance(e, TokenEvent) for e in events[:-1])
    return events[:-1], events[-1]


def test_greedy_matches_llama_cpp_python(default_engine, default_model_path):
    """Token for token the same as llama-cpp-python's own high-level greedy loop."""
    import llama_cpp

    prompt = default_engine.tokenize("The three primary colors are")
    done = default_engine.generate(prompt, greedy(40)).result()
    ref = llama_cpp.Llama(str(default_model_path), n_ctx=2048, verbose=False)
    try:
        ref_ids = []
        for tok in ref.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0):
            if tok == ref.token_eos() or len(ref_ids) == 40:
                break
            ref_ids.append(tok)
    finally:
        ref.close()
    assert done.tokens == ref_ids


def test_streamed_text_equals_final_text(default_engine):
    tokens, done = collect(default_engine.chat([{"role": "user", "content": "Write a haiku about autumn"}], greedy(60)))
    assert "".join(t.text for t in tokens) == done.text
    assert [t.token for t in tokens] == done.tokens
    assert done.finish_reason in ("eos", "length")
    s = done.stats
    assert s.prompt_tokens > 10 and s.generated_tokens == len(done.tokens)
    assert s.ttft_s > 0 and s.prefill_tok_s > 0 and s.decode_tok_s > 0


def test_a_token_reaches_the_reader_in_the_step_that_sampled_it(default_engine):
    """No event waits for the next token (under load a step is seconds: the first token would
    show a step late): only one whose text is held back, here while " 9," may be a stop string."""
    gen = default_engine.generate("1, 2, 3, 4, 5,", greedy(12))
    seen = []
    for e in gen:
        if isinstance(e, edgeinfer.TokenEvent):
            seen.append((e.text, gen.stats.generated_tokens))
    assert [n for _, n in seen] == list(range(1, 13))  # event i while i tokens were sampled
    gen = default_engine.generate("1, 2, 3, 4, 5,", greedy(12, stop=(" 9,",)))
    held = []
    for e in gen:
        if isinstance(e, edgeinfer.TokenEvent):
            held.append(gen.stats.generated_tokens - len(held) - 1)
    text = gen.result().text
    assert text == " 6, 7, 8," and 1 in held  # a " 9" (or " ") waited for what could end the stop string


def test_chat_template_is_the_models_own(default_engine):
    rendered = default_engine.render_chat([{"role": "user", "content": "Hi"}])
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    toks = default_engine.chat_tokens([{"role": "user", "content": "Hi"}])
    assert toks[0] == default_engine.tokenize("<|im_start|>", add_special=False, parse_special=True)[0]


def test_max_tokens_and_stop_strings(default_engine):
    _, full = collect(default_engine.generate("1, 2, 3, 4, 5,", greedy(30)))
    assert full.finish_reason == "length" and len(full.tokens) == 30
    assert " 9," in full.text
    tokens, stopped = collect(default_engine.generate("1, 2, 3, 4, 5,", greedy(30, stop=(" 9,",))))
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index(" 9,")]
    assert "".join(t.text for t in tokens) == stopped.text


def test_prefix_cache_reuse(default_engine, default_model_path):
    """A follow-up turn re-uses the cached conversation and only prefills what is new; the cached
    state gives the same distribution as a fresh context (up to batch-shape rounding)."""
    msgs = [{"role": "user", "content": "Name two planets."}]
    first = default_engine.chat(msgs, greedy(20)).result()
    assert first.stats.cached_tokens == 0 or first.stats.cached_tokens < first.stats.prompt_tokens
    follow = msgs + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And a third one?"}]
    prompt = default_engine.chat_tokens(follow)
    second = default_engine.chat(follow, greedy(5)).result()
    assert second.stats.cached_tokens >= len(default_engine.chat_tokens(msgs))
    assert second.stats.prompt_tokens == len(prompt)
    # white-box: the cached state's next-token logits vs a fresh context fed the same tokens
    with default_engine._slot.hold() as rt:
        seq = default_engine._scheduler.slots[0].seq
        seq.truncate(len(prompt) - 1)
        seq.decode([prompt[-1]])
        cached = rt.logits_row(-1).copy()
    fresh = default_engine.logits(prompt)[-1]
    assert np.abs(cached - fresh).max() < 0.05 * np.abs(fresh).max()
    assert int(np.argmax(cached)) == int(np.argmax(fresh)) == second.tokens[0]


def test_seeded_sampling_is_reproducible(default_engine):
    opts = GenerateOptions(max_tokens=20, sampling=SamplingOptions(temperature=1.0, seed=1234))
    a = default_engine.generate("Once upon a time", opts).result()
    b = default_engine.generate("Once upon a time", opts).result()
    assert a.tokens == b.tokens
    others = {tuple(default_engine.generate("Once upon a time", opts.with_sampling(seed=s)).result().tokens) for s in range(5)}
    assert len(others) > 1


def test_logits_match_llama_cpp_python(default_engine, default_model_path):
    import llama_cpp

    toks = default_engine.tokenize("def fibonacci(n):\n    if n < 2:\n        return n")
    ours = default_engine.logits(toks)
    assert ours.shape == (len(toks), default_engine.n_vocab)
    ref = llama_cpp.Llama(str(default_model_path), n_ctx=512, logits_all=True, verbose=False)
    try:
        ref.eval(toks)
        theirs = np.array(ref.scores[: len(toks)])
    finally:
        ref.close()
    np.testing.assert_allclose(ours, theirs, atol=1e-3, rtol=1e-3)
    tail = default_engine.logits(toks, start=len(toks) - 3)
    np.testing.assert_allclose(tail, ours[-3:], atol=1e-4)


def test_cancel_from_another_thread(default_engine):
    gen = default_engine.generate("Count from one to a thousand: one, two,", greedy(400))
    seen = 0
    for ev in gen:
        if isinstance(ev, TokenEvent):
            seen += 1
            if seen == 5:
                threading.Thread(target=gen.cancel).start()
    assert gen.done.finish_reason == "cancelled"
    assert 5 <= len(gen.done.tokens) < 400
    # the engine is usable afterwards
    assert default_engine.generate("Hello", greedy(3)).result().finish_reason in ("length", "eos")


def test_cancel_before_start(default_engine):
    gen = default_engine.generate("Hello there", greedy(50))
    gen.cancel()
    done = gen.result()
    assert done.finish_reason == "cancelled" and done.tokens == []


def test_two_threads_share_one_engine(default_engine):
    prompts = ["The sun is", "Water boils at"]
    expected = [default_engine.generate(p, greedy(15)).result().tokens for p in prompts]
    results: dict[int, list[int]] = {}

    def work(i: int) -> None:
        results[i] = default_engine.generate(prompts[i], greedy(15)).result().tokens

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == {0: expected[0], 1: expected[1]}


def test_prompt_longer_than_context(default_model_path):
    with edgeinfer.load(default_model_path, n_ctx=256) as engine:
        with pytest.raises(ContextLengthError, match="context holds 256"):
            engine.generate("word " * 400, greedy(5))


def test_context_larger_than_model_supports(default_model_path):
    with pytest.raises(ContextLengthError, match="trained for"):
        edgeinfer.load(default_model_path, n_ctx=100_000)


@pytest.mark.parametrize(
    "bad",
    [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(min_p=1.0), dict(top_k=-3),
     dict(repeat_penalty=0.0), dict(temperature=float("nan")), dict(seed=2**63)],
)
def test_invalid_sampling_values(default_engine, bad):
    with pytest.raises(InvalidOptionError):
        default_engine.generate("Hi", GenerateOptions(sampling=SamplingOptions(**bad)))


# Quantized KV caches: tests/test_kv_cache.py (same greedy prefix as f16, measured KLD ordering).


def test_unknown_load_option(default_model_path):
    with pytest.raises(InvalidOptionError, match="unknown load option"):
        edgeinfer.load(default_model_path, n_ctxx=5)
    with pytest.raises(InvalidOptionError, match="KV-cache type"):
        edgeinfer.load(default_model_path, kv_type="q3")


def test_cancel_inside_a_long_prefill(default_model_path):
    """cancel() reaches into llama_decode (abort callback): a long prompt stops part-way."""
    with edgeinfer.load(default_model_path, n_ctx=4096, flash_attn=False) as engine:
        prompt = engine.tokenize("The quick brown fox jumps over the lazy dog. " * 300)
        gen = engine.generate(prompt, greedy(10))

        def cancel_when_running() -> None:
            while gen.state != "running":
                threading.Event().wait(0.001)
            gen.cancel()

        t = threading.Thread(target=cancel_when_running)
        t.start()
        done = gen.result()
        t.join()
        assert done.finish_reason == "cancelled" and done.tokens == []
        assert len(engine._scheduler.slots[0].seq) < len(prompt)
        # and the engine still works, with what was cached so far reused correctly
        assert engine.generate("Hello", greedy(3)).result().finish_reason in ("length", "eos")


def test_a_failing_decode_is_an_error_not_an_abort_whatever_the_abort_flag_says(default_model_path):
    """llama_decode's own codes decide: a batch it refuses (an invalid token, positions that do not
    follow on: code -1) is an error even while the abort flag happens to be set (a cancel, an idle
    calibration interrupted); only its abort code (2, inside `abortable()`) is DecodeAborted. A
    refused batch leaves nothing in the cache: the next decode at those positions works."""
    from edgeinfer.engine.core.options import LoadOptions
    from edgeinfer.engine.llama.runtime import DecodeAborted, DecodeRows, LlamaRuntime

    rt = LlamaRuntime(default_model_path, LoadOptions(n_ctx=256).validate())
    try:
        invalid_token, gap = DecodeRows(), DecodeRows()
        invalid_token.add(rt.facts.n_vocab + 5, 0, 0, True)
        gap.extend([1, 2], 0, 0, None)
        gap.add(3, 7, 0, True)  # position 7 after 0, 1
        rt.abort_flag.set()
        for rows in (invalid_token, gap):
            with pytest.raises(edgeinfer.EdgeInferError, match="code -1") as e:
                rt.decode_batch(rows)
            assert not isinstance(e.value, DecodeAborted) and "\n" not in str(e.value)
        rt.abort_flag.clear()
        fine = DecodeRows()
        fine.extend([1, 2, 3], 0, 0, 2)
        rt.decode_batch(fine)
        long = DecodeRows()
        long.extend(list(range(10, 200)), 3, 0, None)
        rt.abort_flag.set()  # an abort asked for: the callback stops the decode (code 2)
        with rt.abortable(), pytest.raises(DecodeAborted):
            rt.decode_batch(long)
    finally:
        rt.abort_flag.clear()
        rt.close()


def test_close_after_abandoning_a_generation(default_model_path):
    engine = edgeinfer.load(default_model_path, n_ctx=256)
    gen = engine.generate("Once upon a time", greedy(50))
    for ev in gen:
        break  # the caller walks away mid-stream
    engine.close()  # must not wait forever for the abandoned generation
    with pytest.raises(EngineClosedError, match="closed"):
        engine.generate("Hi", greedy(2))


def test_same_request_twice_gives_the_same_answer(default_model_path):
    """The second identical request re-uses the cached prompt; on this Q4_1 model a one-token
    re-decode rounds differently from the batched prefill, enough to flip the near-tie between
    'La' (24.07) and 'The' (23.93) here. The engine restores the prompt's logits instead."""
    msgs = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"}]
    with edgeinfer.load(default_model_path, n_ctx=1024, flash_attn=False) as engine:
        done = [engine.chat(msgs, greedy(12)).result() for _ in range(3)]
        answers = [d.tokens for d in done]
        assert answers[0] == answers[1] == answers[2]
        # nothing of the prompt is decoded again: its last logits row was remembered
        assert [d.stats.cached_tokens for d in done[1:]] == [done[0].stats.prompt_tokens] * 2
        engine.reset()
        assert engine.chat(msgs, greedy(12)).result().tokens == answers[0]

        # After a decode that left no output row (as an aborted one does) there is nowhere to put
        # the row back: the last prompt token is decoded again, and the answer is still the same.
        with engine._slot.hold() as rt:  # white-box
            engine._scheduler.slots[0].seq.decode([answers[0][0]], logits_from=1)  # no row asks for logits
            with pytest.raises(IndexError):
                rt.logits_row(-1)
        again = engine.chat(msgs, greedy(12)).result()
        assert again.tokens == answers[0]
        assert again.stats.cached_tokens == again.stats.prompt_tokens - 1


def test_llama_cpp_log_lines_reach_the_logger(default_model_path, caplog):
    """llama.cpp's own log is not dropped: each line is a DEBUG record of `edgeinfer.llama_cpp`
    (quiet unless a front end asks, e.g. the CLI's --verbose)."""
    import logging

    with caplog.at_level(logging.DEBUG, logger="edgeinfer.llama_cpp"):
        edgeinfer.load(default_model_path, n_ctx=128).close()
    records = [r for r in caplog.records if r.name == "edgeinfer.llama_cpp"]
    assert records and all(r.levelno == logging.DEBUG for r in records)
    text = "\n".join(r.getMessage() for r in records)
    assert "llama" in text and all("\n" not in r.getMessage() for r in records)  # whole lines, one each


def test_no_resource_warning_at_exit_after_loading_and_quantizing(tmp_path, default_model_path):
    """llama-cpp-python opens /dev/null twice at import and never closes it; the backend closes
    both at exit, so no `ResourceWarning: unclosed file ... /dev/null` ends a run."""
    import subprocess
    import sys

    code = (
        "import edgeinfer, edgeinfer.quantize as q\n"
        f"e = edgeinfer.load({str(default_model_path)!r}, n_ctx=64); e.close()\n"
        "print(q.available_quant_types()[:1])\n"
    )
    out = subprocess.run([sys.executable, "-W", "always::ResourceWarning", "-c", code], capture_output=True,
                         text=True, timeout=120, env={**__import__("os").environ, "EDGEINFER_HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert "ResourceWarning" not in out.stderr, out.stderr
