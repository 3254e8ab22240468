"""BatchEngine: parallel sequences in one context answer as a single-sequence Engine does.

Token-for-token comparisons across batch shapes use an F16 copy of the default model (its batched
and one-token paths round alike; Q4_1's logits differ in the last bits between batch sizes). Where
a batched output still parts from the lone one, the test requires a near-tie there and prints the top-2 margin.
"""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import edgeinfer
from edgeinfer import BatchEngine, BatchOptions, GenerateOptions, SamplingOptions, SpeculationOptions
from edgeinfer.engine.faces.batch import plan_drafts
from edgeinfer.engine.llama.runtime import LlamaRuntime
from edgeinfer.engine.core.sequence import KVSequence
from edgeinfer.engine.speculation.calibration import IDLE_CALIBRATION_ENV
from edgeinfer.engine.speculation.policy import CALIBRATION_SIZES, CostModel
from greedy_compare import assert_same_or_near_tie


PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three colours."}],
    [{"role": "user", "content": "Explain what a CPU does in two sentences."}],
    [{"role": "user", "content": "Say hello in Spanish."}],
    [{"role": "user", "content": "What is 2 + 2?"}],
]

CODE = """def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for v in values:
        total += (v - m) ** 2
    return total / len(values)
"""
CODE_EDIT = [{"role": "user", "content": f"Rename the variable `total` to `acc` in this code and print all of it:\n\n{CODE}"}]


def greedy(n: int, spec: str = "off") -> GenerateOptions:
    return GenerateOptions(max_tokens=n, sampling=SamplingOptions(temperature=0.0),
                           speculation=SpeculationOptions(method=spec))


@pytest.fixture(scope="session")
def f16_path(default_model_copy) -> Path:
    """The default model requantized to F16 by llama.cpp (made once per test run)."""
    return default_model_copy("F16")


@pytest.fixture(scope="module")
def f16_batch(f16_path):
    engine = BatchEngine.load(f16_path, batch=BatchOptions(parallel=4), n_ctx=8192, flash_attn=False)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def f16_single(f16_path):
    engine = edgeinfer.load(f16_path, n_ctx=2048, flash_attn=False)
    yield engine
    engine.close()


# -- the draft policy (pure: no model) --------------------------------------------------------------

# Shaped like a CPU: rows up to 4 cost little more than one (memory-bound), then each row costs
# its share (compute-bound).
CPU_LIKE_SECONDS = {1: 0.010, 2: 0.0105, 3: 0.011, 4: 0.0115, 5: 0.0140, 8: 0.0200, 16: 0.040, 32: 0.080, 64: 0.160}
CPU_LIKE = CostModel(CPU_LIKE_SECONDS)


@pytest.mark.parametrize("bad", [-0.5, 3601, float("nan"), float("inf"), True, None, "5"])
def test_decode_wait_must_be_seconds_in_range(bad):
    with pytest.raises(edgeinfer.InvalidOptionError, match="decode_wait"):
        BatchOptions(decode_wait=bad).validate()
    assert BatchOptions(decode_wait=0).validate().decode_wait == 0
    assert BatchOptions(decode_wait=2.5).validate().decode_wait == 2.5


def test_plan_drafts_drafts_when_rows_are_nearly_free():
    counts = plan_drafts([[0.9, 0.8, 0.7, 0.6]], base_rows=1, cost=CPU_LIKE.time, max_rows=512)
    assert counts[0] >= 2


def test_plan_drafts_drafts_less_as_the_batch_grows():
    draft = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4]
    totals = []
    for b in (1, 2, 4, 8, 16):
        counts = plan_drafts([draft] * b, base_rows=b, cost=CPU_LIKE.time, max_rows=512)
        totals.append(sum(counts) / b)
    assert totals == sorted(totals, reverse=True), totals
    assert totals[0] > 0 and totals[-1] == 0, totals


def test_plan_drafts_follows_the_curve_not_the_batch_size():
    """The same batch drafts on a flat (memory-bound) curve and does not on a linear one."""
    flat = CostModel({1: 0.01, 64: 0.0101})
    linear = CostModel({1: 0.01, 64: 0.64})
    drafts = [[0.9, 0.8, 0.7]] * 8
    assert sum(plan_drafts(drafts, 8, flat.time, 512)) > 0
    assert sum(plan_drafts(drafts, 8, linear.time, 512)) == 0


def test_plan_drafts_takes_best_rows_first_and_respects_capacity():
    counts = plan_drafts([[0.99, 0.98], [0.2]], base_rows=2, cost=CPU_LIKE.time, max_rows=3)
    assert counts == [1, 0]


# -- the engine ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_single_request_matches_engine(default_engine, default_model_path):
    """One request on a BatchEngine gives the tokens Engine gives (same batch shapes: a whole
    prefill, then one-row decodes), even on the quantized default model."""
    opts = greedy(48)
    default_engine.reset()
    expected = default_engine.chat(PROMPTS[3], opts).result()
    with BatchEngine.load(default_model_path, batch=BatchOptions(parallel=2), n_ctx=2048, flash_attn=False) as be:
        got = be.chat(PROMPTS[3], opts).result()
    assert got.tokens == expected.tokens
    assert got.text == expected.text
    assert got.finish_reason == expected.finish_reason


@pytest.mark.slow
def test_concurrent_submissions_match_lone_requests(f16_batch, f16_single):
    opts = greedy(24)  # six requests in four slots: 144 tokens compared, in batches of 1 to 4 rows
    prompts = [f16_batch.chat_tokens(m) for m in PROMPTS]
    alone = [f16_batch.submit(p, opts).result().tokens for p in prompts]

    results: dict[int, edgeinfer.DoneEvent] = {}
    start = threading.Barrier(len(prompts))

    def client(i: int) -> None:
        start.wait()
        results[i] = f16_batch.submit(prompts[i], opts).result()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(len(prompts)))
    for i, p in enumerate(prompts):
        assert_same_or_near_tie(f16_single, p, alone[i], results[i].tokens)
    m = f16_batch.metrics()
    assert m.queue_depth == 0 and m.active == 0
    assert m.rows > m.steps  # some steps did carry several requests


@pytest.mark.slow
def test_prefix_of_a_finished_request_is_reused(f16_batch):
    opts = greedy(16)
    first = f16_batch.chat(PROMPTS[0], opts).result()
    again = f16_batch.chat(PROMPTS[0], opts).result()
    assert again.tokens == first.tokens
    assert again.stats.cached_tokens == again.stats.prompt_tokens  # nothing decoded again: as on Engine
    follow_up = PROMPTS[0] + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Why?"}]
    longer = f16_batch.chat(follow_up, opts).result()
    assert longer.stats.cached_tokens >= first.stats.prompt_tokens - 1


@pytest.mark.slow
def test_cancel_frees_the_slot_at_once(f16_path):
    """A cancelled request stops within a step of the cancel: with a backlog of 4 its engine is at
    most 4 events ahead of its reader, so it has made at most those and one more step's token;
    the request waiting for its only slot then runs to its end."""
    batch = BatchOptions(parallel=1, max_backlog=4)
    with BatchEngine.load(f16_path, batch=batch, n_ctx=2048, flash_attn=False) as be:
        long = be.generate("Once upon a time", GenerateOptions(max_tokens=1500, sampling=SamplingOptions(seed=1)))
        waiting = be.chat(PROMPTS[5], greedy(8))
        first = next(long)
        assert isinstance(first, edgeinfer.TokenEvent)
        long.cancel()
        assert waiting.result().finish_reason in ("eos", "length")
        done = long.result()
        assert done.finish_reason == "cancelled"
        assert 1 <= len(done.tokens) <= 1 + 4 + 1, len(done.tokens)

        # A generation dropped by its reader is cancelled too.
        dropped = be.generate("Once upon a time", GenerateOptions(max_tokens=1500, sampling=SamplingOptions(seed=2)))
        next(dropped)
        del dropped
        gc.collect()
        assert be.chat(PROMPTS[5], greedy(8)).result().finish_reason in ("eos", "length")
        assert be.metrics().requests_finished.get("cancelled") == 2


@pytest.mark.slow
def test_cancel_while_queued(f16_path):
    with BatchEngine.load(f16_path, batch=BatchOptions(parallel=1), n_ctx=2048, flash_attn=False) as be:
        running = be.chat(PROMPTS[1], greedy(30))
        queued = be.chat(PROMPTS[2], greedy(30))
        queued.cancel()
        assert queued.result().finish_reason == "cancelled"
        assert queued.result().tokens == []
        assert running.result().finish_reason in ("eos", "length")


@pytest.mark.slow
def test_lookup_speculation_keeps_greedy_output(f16_path, f16_single):
    """Drafted rows in the batch change speed, not tokens. The cost curve is given (memory-bound,
    as on an idle CPU) so that drafting happens whatever the load on the test machine."""
    batch = BatchOptions(parallel=2, cost_curve=CPU_LIKE_SECONDS)
    with BatchEngine.load(f16_path, batch=batch, n_ctx=4096, flash_attn=False) as be:
        prompt = be.chat_tokens(CODE_EDIT)
        plain = be.submit(prompt, greedy(80)).result()
        fast = be.submit(prompt, greedy(80, "lookup")).result()
        spec = fast.stats.speculation
        assert spec is not None and spec.method == "lookup"
        assert spec.drafted > 0 and spec.accepted > 0
        assert_same_or_near_tie(f16_single, prompt, plain.tokens, fast.tokens)
        assert be.metrics().drafted == spec.drafted


def test_the_idle_calibration_can_be_turned_off_for_every_engine(monkeypatch):
    """$EDGEINFER_IDLE_CALIBRATION=0 makes not calibrating the default (`edgeinfer serve` too: it
    takes BatchOptions' defaults); an explicit calibrate_when_idle wins either way."""
    monkeypatch.setenv(IDLE_CALIBRATION_ENV, "0")
    assert BatchOptions().calibrate_when_idle is False
    assert BatchOptions(calibrate_when_idle=True).calibrate_when_idle is True
    monkeypatch.delenv(IDLE_CALIBRATION_ENV)
    assert BatchOptions().calibrate_when_idle is True
    assert BatchOptions(calibrate_when_idle=False).calibrate_when_idle is False


@pytest.mark.slow
def test_the_cost_curve_is_measured_while_idle_and_kept(tmp_path, monkeypatch):
    """With no curve in the store, an idle engine times decodes up to a full ubatch on a sequence
    of its own, keeps the curve in the store (the next engine starts from it), and a request that
    arrives meanwhile is served at once (the calibration decode under way is aborted). Each size
    is timed as it is used: drafting sizes with every row's logits (a verification reads them
    all), larger ones with the last row's only (a prompt chunk). On a 2-layer random llama with the
    default model's tokenizer (the mechanism is what is tested: the default model's F16 copy took
    11 CPU-seconds of the suite for the same assertions)."""
    from test_quantize import make_synthetic_gguf

    f16_path = make_synthetic_gguf(tmp_path / "tiny-llama-f16.gguf")
    timed: list[tuple[int, int | None]] = []  # (rows, first row with logits) of each sequence decode
    decode = KVSequence.decode

    def recorded(self, tokens, logits_from=None):
        timed.append((len(tokens), logits_from))
        return decode(self, tokens, logits_from)

    monkeypatch.setattr(KVSequence, "decode", recorded)
    store = edgeinfer.Store(tmp_path / "home")
    calibrating = BatchOptions(parallel=2, calibrate_when_idle=True)  # (the suite turns it off by default)
    with BatchEngine.load(f16_path, batch=calibrating, n_ctx=2048, flash_attn=False, store=store) as be:
        assert be._calibration is not None and be._calibration.pending()  # white-box: it is to do
        done = be.chat(PROMPTS[2], greedy(4)).result()  # arrives during the calibration
        assert done.stats.queue_s < 0.5, done.stats
        deadline = time.monotonic() + 600  # sizes up to 512 rows, twice: minutes on a slow, shared machine
        while be._calibration.pending() and time.monotonic() < deadline:
            time.sleep(0.05)
        curve = be.cost_curve()
        assert {1, 8, 64, 512} <= set(curve) and set(be._calibration.best) <= set(curve), curve
        assert (8, 0) in timed and (33, 0) in timed and (64, 63) in timed and (512, 511) in timed, timed
        assert all(first == (0 if n in CALIBRATION_SIZES else n - 1) for n, first in timed if n in curve), timed
        again = be.chat(PROMPTS[2], greedy(4)).result()
        assert again.tokens == done.tokens  # the calibration emptied an idle slot only: same answer
    with BatchEngine.load(f16_path, batch=calibrating, n_ctx=2048, flash_attn=False, store=store) as be:
        assert be._calibration is None  # measured before: nothing to do
        assert be.cost_curve() == pytest.approx(curve, rel=1e-6)


@pytest.mark.slow
def test_logprobs_match_an_independent_softmax(f16_batch, f16_single):
    prompt = f16_batch.chat_tokens(PROMPTS[0])
    gen = f16_batch.submit(prompt, greedy(6), logprobs=3)
    events = [e for e in gen if isinstance(e, edgeinfer.TokenEvent)]
    assert all(isinstance(e, edgeinfer.ScoredTokenEvent) for e in events)
    tokens = [e.token for e in events]
    rows = f16_single.logits(prompt + tokens, start=len(prompt) - 1)[: len(tokens)].astype(np.float64)
    m = rows.max(axis=1, keepdims=True)
    ref = rows - (m + np.log(np.exp(rows - m).sum(axis=1, keepdims=True)))  # log-softmax
    # The reference decodes the whole text in one batch, the engine token by token: logits agree
    # to llama.cpp's batch-shape rounding (~1e-2 on F16), far inside what a wrong softmax would be off.
    for e, r in zip(events, ref):
        assert e.logprob == pytest.approx(r[e.token], abs=2e-2)
        assert e.top_logprobs[0][0] == e.token  # greedy: the chosen token is the top one
        assert [lp for _, lp in e.top_logprobs] == sorted((lp for _, lp in e.top_logprobs), reverse=True)
        assert e.top_logprobs[1][1] == pytest.approx(np.sort(r)[-2], abs=2e-2)


@pytest.mark.slow
def test_a_slow_reader_pauses_only_its_own_request(f16_path):
    opts = GenerateOptions(max_tokens=24, sampling=SamplingOptions(temperature=0.0))  # 6x the backlog
    with BatchEngine.load(f16_path, batch=BatchOptions(parallel=2, max_backlog=4), n_ctx=2048, flash_attn=False) as be:
        slow = be.generate("The history of the bicycle", opts)
        fast = be.generate("The history of the telephone", opts)
        assert fast.result().finish_reason in ("eos", "length")
        assert len(slow.poll()) <= 4  # it waited for its reader instead of buffering everything
        assert slow.result().finish_reason in ("eos", "length")


@pytest.mark.slow
def test_metrics_polled_while_eight_streams_run_and_end_never_fail(q4_path):
    """metrics() polled from another thread while 8 streams run and end one after another, ten
    times over: no call fails, and the counters add up. A thread switched out between reading a
    slot's request and using it would meet a request the scheduler has just ended; the test opens
    that window wide (another thread's read of a busy slot's request takes a millisecond), so a
    metrics() that read the core's slots mid-step fails within a round or two."""
    from edgeinfer.engine.core.scheduler import Slot

    poller: list[threading.Thread] = []

    class PreemptedSlot(Slot):
        @property
        def request(self):
            value = self.__dict__["request"]
            if value is not None and threading.current_thread() in poller:
                time.sleep(0.001)  # switched out after the read: the scheduler runs meanwhile
            return value

        @request.setter
        def request(self, value):
            self.__dict__["request"] = value

    with BatchEngine.load(q4_path, batch=BatchOptions(parallel=8, calibrate_when_idle=False), n_ctx=4096,
                          flash_attn=False) as be:
        for s in be._core.slots:
            s.__class__ = PreemptedSlot
        stop = threading.Event()
        failures: list[BaseException] = []
        polls = [0]

        def poll() -> None:
            while not stop.is_set():
                try:
                    be.metrics()
                    polls[0] += 1
                except BaseException as e:  # noqa: BLE001 - what the test is about
                    failures.append(e)
                time.sleep(0.0005)  # (the scheduler takes the engine's lock between steps too)

        poller.append(threading.Thread(target=poll))
        poller[0].start()
        try:
            generated = 0
            for _ in range(10):  # streams of 2..16 tokens: they end one after another
                gens = [be.generate(f"Count from {i} to {i + 20}:", greedy(2 + 2 * i)) for i in range(8)]
                generated += sum(len(g.result().tokens) for g in gens)
        finally:
            stop.set()
            poller[0].join(30)
        assert not failures, f"{len(failures)} of {polls[0] + len(failures)} metrics() calls failed: {failures[0]!r}"
        m = be.metrics()
        assert polls[0] > 80 and sum(m.requests_finished.values()) == m.requests_submitted == 80
        assert m.generated_tokens == generated and m.active == 0 and not any(s.busy for s in m.slots)


@pytest.mark.slow
@pytest.mark.parametrize("face", ["BatchEngine", "Engine"])
def test_a_grammar_is_compiled_once_per_request_and_never_on_the_scheduler_thread(face, f16_batch, f16_single,
                                                                                  monkeypatch):
    """A request's grammar or JSON schema becomes llguidance's matcher over the vocabulary once, in
    the thread that submits it (the check before it is queued), and the request samples with that
    matcher: the scheduler thread, which steps every stream, never builds one (a large grammar would
    stall them all). Its text is compiled at most once (the same schema again: never)."""
    from edgeinfer.engine.core import sampler as sampler_module
    from edgeinfer.engine.structured import llg as llg_module

    built: list[str] = []
    compiled: list[str] = []
    real_constraint, real_compile = sampler_module.Constraint, llg_module.llguidance_grammar

    def constraint(runtime, grammar, *args):
        built.append(threading.current_thread().name)
        return real_constraint(runtime, grammar, *args)

    def compile_grammar(grammar):
        with llg_module._compiled_lock:
            cached = any(key[1] in (grammar.json_schema, grammar.gbnf) for key in llg_module._compiled)
        if not cached:
            compiled.append(threading.current_thread().name)
        return real_compile(grammar)

    monkeypatch.setattr(sampler_module, "Constraint", constraint)
    monkeypatch.setattr(llg_module, "llguidance_grammar", compile_grammar)
    engine = f16_batch if face == "BatchEngine" else f16_single
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"],
              "additionalProperties": False}
    me = threading.current_thread().name
    for constraint_field in ({"grammar": 'root ::= "The answer is " [0-9]+ "."'}, {"json_schema": schema}):
        built.clear()
        compiled.clear()
        opts = GenerateOptions(max_tokens=24, sampling=SamplingOptions(temperature=0.0), **constraint_field)
        done = engine.generate("Answer:", opts).result()
        assert done.finish_reason in ("eos", "stop", "length") and done.tokens
        assert built == [me], built  # the matcher: once, here
        assert compiled in ([], [me]), compiled  # (none: compiled for an earlier request)


@pytest.mark.slow
def test_bad_requests_are_refused_before_queueing(f16_batch):
    with pytest.raises(edgeinfer.ContextLengthError):
        f16_batch.submit([1] * f16_batch.n_ctx, greedy(4))
    with pytest.raises(edgeinfer.InvalidOptionError):
        f16_batch.submit([], greedy(4))
    with pytest.raises(edgeinfer.InvalidOptionError):
        f16_batch.submit([f16_batch.n_vocab], greedy(4))
    with pytest.raises(edgeinfer.InvalidOptionError, match="not prepared"):
        f16_batch.submit([1, 2, 3], greedy(4, "self"))
    assert f16_batch.metrics().queue_depth == 0


@pytest.mark.slow
def test_close_cancels_running_requests(f16_path):
    be = BatchEngine.load(f16_path, batch=BatchOptions(parallel=1), n_ctx=2048, flash_attn=False)
    gen = be.generate("Once upon a time", GenerateOptions(max_tokens=1500, sampling=SamplingOptions(seed=3)))
    next(gen)
    be.close(grace=0.0)
    assert gen.result().finish_reason == "cancelled"
    with pytest.raises(edgeinfer.EngineClosedError):
        be.generate("again")


@pytest.mark.slow
@pytest.mark.parametrize("decode_wait", [0.0, 0.25, 3600.0])
def test_a_long_prompt_enters_in_chunks_while_others_keep_decoding(q4_path, decode_wait, monkeypatch):
    """Continuous batching: while a 750-token prompt is prefilled (`prefill_chunk` caps what the
    cost curve's knee would give: 64 rows a step while others decode), a running request waits for
    its next token at most `decode_wait` seconds of prompt-only steps: with 0 it rides every step,
    with an hour none (it goes on after the prefill), and between, it sits a step out only while
    the steps it sat out took less than the bound."""
    steps: list[tuple[bool, bool, float]] = []  # per decode: a prompt chunk of slot 1, a row of slot 0, seconds
    decode = LlamaRuntime.decode_batch

    def recorded_decode(self, rows):
        seqs = list(rows.seqs)
        t0 = time.perf_counter()
        try:
            return decode(self, rows)
        finally:
            steps.append((seqs.count(1) > 1, 0 in seqs, time.perf_counter() - t0))

    monkeypatch.setattr(LlamaRuntime, "decode_batch", recorded_decode)
    batch = BatchOptions(parallel=2, prefill_chunk=64, decode_wait=decode_wait)
    with BatchEngine.load(q4_path, batch=batch, n_ctx=4096, flash_attn=False) as be:  # (compares no outputs)
        decoding = threading.Event()

        def read(gen) -> None:
            for e in gen:
                if isinstance(e, edgeinfer.TokenEvent):
                    decoding.set()

        counting = be.generate("1, 2, 3, 4, 5, 6, 7, 8,", greedy(200))  # still running after the prefill
        reader = threading.Thread(target=read, args=(counting,))
        reader.start()
        assert decoding.wait(timeout=300)  # the first request decodes before the long one arrives
        long_prompt = be.tokenize("word " * 750)
        assert len(long_prompt) > 600
        late = be.submit(long_prompt, greedy(4))
        late_events = list(late)
        reader.join()
        assert late.done.stats.cached_tokens == 0
        progress = [e for e in late_events if isinstance(e, edgeinfer.PrefillProgress)]
        assert [p.done for p in progress] == list(range(64, len(long_prompt), 64)) + [len(long_prompt)]
        chunk_steps = [(running, s) for chunk, running, s in steps if chunk]
        last_chunk = max(i for i, (chunk, _, _) in enumerate(steps) if chunk)
        assert any(running for _, running, _ in steps[last_chunk + 1:]), "the running request ended during the prefill"
        assert len(chunk_steps) == len(progress)  # one step per chunk
        rides = [running for running, _ in chunk_steps]
        print("chunk steps (rode, seconds):", [(r, round(s, 3)) for r, s in chunk_steps])
        if decode_wait == 0:
            assert all(rides), rides
        elif decode_wait == 3600:
            assert not any(rides), rides
        else:
            # Twelve chunks take longer than the bound on any machine, so the request rode; and
            # of each run of steps it sat out, all but the last took at most the bound (it sat
            # the last one out because the time so far and that chunk's predicted cost fit in it;
            # whether any fit at all depends on this machine's speed).
            assert any(rides), chunk_steps
            held: list[float] = []
            for running, s in chunk_steps + [(True, 0.0)]:
                if running:
                    assert sum(held[:-1]) <= decode_wait, (held, chunk_steps)
                    held = []
                else:
                    held.append(s)
