"""The scheduler core under both faces: every speculation method keeps greedy output at any
concurrency, the rejection rule keeps the target's distribution through the batch path, and a fault
stays where it happens (one request's error ends that request; a dead scheduler thread ends every
reader with an error, never a hang).

Comparisons across batch shapes run on an F16 copy of the default model (its batched and one-row
paths round alike); where an output still parts from the lone one, it must be at a near-tie (the
top-2 margin is printed) and stay greedy after it (greedy_compare).
"""

from __future__ import annotations

import collections
import threading
from dataclasses import replace

import pytest
from greedy_compare import assert_same_or_near_tie

import edgeinfer
from edgeinfer import BatchEngine, BatchOptions, GenerateOptions, SamplingOptions, SpeculationOptions
from edgeinfer.engine.llama.runtime import LlamaRuntime, ubatch_rows
from edgeinfer.engine.core.request import RequestState
from edgeinfer.engine.core.scheduler import Scheduler

pytestmark = pytest.mark.slow

CODE = """def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)
"""
PROMPTS = [
    [{"role": "user", "content": f"Rename `total` to `acc` and print the code:\n\n{CODE}"}],
    [{"role": "user", "content": "Quote this line exactly: the quick brown fox jumps over the lazy dog."}],
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": f"Repeat this code exactly:\n\n{CODE}"}],
    [{"role": "user", "content": "List three colours."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Say hello in Spanish."}],
    [{"role": "user", "content": "Explain what a CPU does in two sentences."}],
]
TOKENS = 24


def greedy(spec: SpeculationOptions | None = None) -> GenerateOptions:
    return GenerateOptions(max_tokens=TOKENS, sampling=SamplingOptions(temperature=0.0),
                           speculation=spec or SpeculationOptions())


@pytest.fixture(scope="module")
def f16_path(default_model_copy):
    return default_model_copy("F16")


@pytest.fixture(scope="module")
def single(f16_path):
    with edgeinfer.load(f16_path, n_ctx=2048, flash_attn=False) as engine:
        yield engine


@pytest.fixture(scope="module")
def plain(single):
    """Each prompt's tokens and its lone plain greedy output (Engine, one slot)."""
    out = []
    for messages in PROMPTS:
        prompt = single.chat_tokens(messages)
        single.reset()
        out.append((prompt, single.generate(prompt, greedy()).result().tokens))
    return out


def concurrently(engine: BatchEngine, prompts: list[list[int]], options: GenerateOptions) -> list[edgeinfer.DoneEvent]:
    gens = [engine.submit(p, options) for p in prompts]  # queued together: they share steps
    results: list[edgeinfer.DoneEvent | None] = [None] * len(gens)

    def read(i: int) -> None:
        results[i] = gens[i].result()

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(gens))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


# Fixed draft lengths draft every step where there is something to draft, so each method is
# exercised whatever this machine's costs say; "lookup" adaptive is the policy's own choice.
METHODS = {
    "lookup": "lookup",
    "lookup-fixed": SpeculationOptions(method="lookup", adaptive=False, draft_max=3),
    "lookup-fixed-one-cache": SpeculationOptions(method="lookup", adaptive=False, draft_max=3),  # kv_unified
    "draft-fixed": "draft",
    "self-fixed": "self",
    "auto-draft": "auto",
}


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_keeps_greedy_output_at_1_4_and_8_requests(name, f16_path, default_model_path, single, plain):
    method = METHODS[name]
    if method == "draft":
        spec = SpeculationOptions(method="draft", draft_model=str(default_model_path), adaptive=False, draft_max=3,
                                  p_min=0.0)
    elif method == "self":
        spec = SpeculationOptions(method="self", self_quant="Q8_0", adaptive=False, draft_max=3, p_min=0.0)
    elif method == "auto":
        spec = SpeculationOptions(method="auto", draft_model=str(default_model_path))
    else:
        spec = SpeculationOptions(method=method) if isinstance(method, str) else method
    batch = BatchOptions(parallel=8, calibrate_when_idle=False, kv_unified=name.endswith("-one-cache"))
    with BatchEngine.load(f16_path, batch=batch, n_ctx=8192, flash_attn=False, speculation=spec) as be:
        drafted = 0
        for n in (1, 4, 8):
            chosen = plain[:n] if n > 1 else plain[:1]
            done = concurrently(be, [p for p, _ in chosen], greedy(spec))
            for (prompt, reference), d in zip(chosen, done):
                assert d.stats.speculation is not None and d.stats.speculation.method.startswith(spec.method)
                drafted += d.stats.speculation.drafted
                assert_same_or_near_tie(single, prompt, reference, d.tokens)
        m = be.metrics()
        assert m.rows > m.steps  # steps carried several requests (and drafts)
        if not spec.adaptive:
            assert drafted > 0 and m.accepted > 0, (name, drafted, m)


def test_ubatch_rows_follows_llama_cpps_split():
    """llama_batch_allocr::split_equal (a stream per sequence, sequential): a run of consecutive
    sequence ids, the same rows from each; split_simple (one cache): n_ubatch pieces."""
    assert ubatch_rows([(0, 1), (1, 1), (2, 1), (3, 1)], 512, False) == [4]
    assert ubatch_rows([(0, 1), (1, 1), (2, 1), (3, 9)], 512, False) == [4, 8]  # one draft: a second pass
    assert ubatch_rows([(0, 4), (1, 4)], 512, False) == [8]  # equal drafts: one
    assert ubatch_rows([(0, 1), (2, 1), (3, 1)], 512, False) == [1, 2]  # a gap in the ids
    assert ubatch_rows([(0, 1), (1, 600)], 512, False) == [2, 512, 87]
    assert ubatch_rows([(0, 300), (1, 300)], 256, False) == [256, 256, 88]  # 128 rows of each, then the rest
    assert ubatch_rows([(0, 1), (2, 1), (3, 9), (7, 300)], 512, True) == [311]


def test_a_stream_per_slot_packs_requests_from_slot_0_and_keeps_the_caches(f16_path, single, plain):
    """A new request takes the lowest free slot; the prefix another slot holds is copied there
    (and the cache it overwrites is kept in the slot the choice gives up): prefix reuse as before,
    the same tokens, busy slots packed (a gap would cost every step a ubatch)."""
    (p0, r0), (p1, _), (p2, _), (p3, r3) = plain[:4]
    with BatchEngine.load(f16_path, batch=BatchOptions(parallel=4, calibrate_when_idle=False), n_ctx=4096,
                          flash_attn=False) as be:
        concurrently(be, [p0, p1, p2, p3], greedy())
        cached = [s.cached_tokens for s in be.metrics().slots]
        assert all(c > 0 for c in cached), cached  # four slots, four caches
        again = be.submit(p3, greedy()).result()  # p3's cache is in the last slot: it is copied to slot 0
        assert again.stats.cached_tokens == len(p3)
        assert_same_or_near_tie(single, p3, r3, again.tokens)
        slots = be.metrics().slots
        assert slots[0].cached_tokens >= len(p3) + len(r3) - 1, slots
        first = be.submit(p0, greedy()).result()  # p0's cache was kept in the slot given up
        assert first.stats.cached_tokens == len(p0), first.stats
        assert_same_or_near_tie(single, p0, r0, first.tokens)
        assert be.kv_unified is False


def test_a_request_above_a_free_slot_moves_down_into_it(f16_path, single, plain, monkeypatch):
    """With a stream per slot, the request in slot 2 moves into slot 1 when slot 1's request ends
    first (llama.cpp would cut every later step at the gap); slot 1's cache is kept in the free
    slot 3, and the moved request's tokens are its lone ones."""
    (p0, r0), (p1, _), (p2, r2) = plain[0], plain[1], plain[3]
    seen: list[set[int]] = []
    decode = LlamaRuntime.decode_batch

    def recorded_decode(self, rows):
        if len(rows) == len(set(rows.seqs)):  # decode steps (prompts read together share steps too)
            seen.append(set(rows.seqs))
        return decode(self, rows)

    monkeypatch.setattr(LlamaRuntime, "decode_batch", recorded_decode)
    short = replace(greedy(), max_tokens=3)
    with BatchEngine.load(f16_path, batch=BatchOptions(parallel=4, calibrate_when_idle=False), n_ctx=4096,
                          flash_attn=False) as be:
        gens = [be.submit(p0, greedy()), be.submit(p1, short), be.submit(p2, greedy())]
        done = [g.result() for g in gens]
        assert done[1].stats.generated_tokens == 3 and min(len(done[0].tokens), len(done[2].tokens)) > 8
        assert_same_or_near_tie(single, p0, r0, done[0].tokens)
        assert_same_or_near_tie(single, p2, r2, done[2].tokens)
        two = [ids for ids in seen if len(ids) == 2]  # the steps after slot 1's request ended
        assert two and all(ids == {0, 1} for ids in two), seen
        again = be.submit(p1, short).result()  # slot 1's cache was kept (in slot 3)
        assert again.stats.cached_tokens == len(p1), again.stats


def test_the_rejection_rule_keeps_the_distribution_through_the_batch_path(f16_path, default_model_path, single):
    """A draft model sampling its drafts (T = 0.7, fixed length) in a BatchEngine, four requests
    sharing each step: the first three tokens are distributed exactly as the target's own
    sampling (chi-square against llama.cpp's chain on the target's logits)."""
    from sequence_chi_square import sequence_chi_square

    prompt = single.chat_tokens([{"role": "user", "content": "Name a colour."}])
    sampling = SamplingOptions(temperature=0.7)
    spec = SpeculationOptions(method="draft", draft_model=str(default_model_path), adaptive=False, draft_max=3,
                              p_min=0.0)
    # n = 100: the fewest runs that give this prompt's concentrated first tokens the three cells expected
    # >= 5 times a chi-square needs (60 give one). At alpha = 1e-3 the test then rejects the first three
    # tokens drawn at twice the temperature (w = 0.42, 3 df) with power 0.67 only (sequence_chi_square.
    # chi_square_power): it is for gross errors; 200 runs would reach 0.99.
    n, length = 100, 3
    observed: collections.Counter = collections.Counter()
    drafted = accepted = 0
    with BatchEngine.load(f16_path, batch=BatchOptions(parallel=4, calibrate_when_idle=False), n_ctx=4096,
                          flash_attn=False, speculation=spec) as be:
        for group in range(0, n, 4):
            gens = [be.submit(prompt, GenerateOptions(max_tokens=length + 1, sampling=replace(sampling, seed=seed),
                                                      speculation=spec)) for seed in range(group, group + 4)]
            for g in gens:
                done = g.result()
                observed[tuple(done.tokens[:length])] += 1
                drafted += done.stats.speculation.drafted
                accepted += done.stats.speculation.accepted
    assert drafted >= 2 * n and 0 < accepted < drafted
    result, table = sequence_chi_square(single, prompt, sampling, observed, n, length)
    assert result.pvalue > 1e-3, (result, table)


def test_an_error_in_one_request_ends_that_request_only(f16_path, plain, monkeypatch):
    """A Python error while verifying one request's step ends that request with the error; the
    others sharing its steps go on and answer as they would alone."""
    poisoned = plain[1][0]
    real_verify = RequestState.verify

    def verify(self, rt, first, drafts, qs):
        if self.prompt == poisoned and len(self.generated) >= 3:
            raise ValueError("a bug in one request")
        return real_verify(self, rt, first, drafts, qs)

    monkeypatch.setattr(RequestState, "verify", verify)
    with BatchEngine.load(f16_path, batch=BatchOptions(parallel=4, calibrate_when_idle=False), n_ctx=4096,
                          flash_attn=False) as be:
        gens = [be.submit(p, greedy()) for p, _ in plain[:4]]
        with pytest.raises(edgeinfer.EdgeInferError, match="a bug in one request"):
            gens[1].result()
        for i in (0, 2, 3):
            assert gens[i].result().tokens == plain[i][1]
        assert be.metrics().requests_finished.get("error") == 1
        again = be.submit(plain[2][0], greedy()).result()  # the engine still serves
        assert again.tokens == plain[2][1]


def test_a_draft_model_that_fails_mid_step_turns_off_only_its_requests_speculation(f16_path, default_model_path,
                                                                                    plain, monkeypatch):
    """The draft model's decode fails in the middle of a step (llama.cpp gives an error code):
    the two requests it drafts for go on plain (their drafts are only proposals; the target's
    cache never saw them) and say why in their stats; the two lookup requests sharing the steps,
    the engine and later requests are untouched. Greedy outputs are all the lone ones."""
    drafted_decodes = []
    decode = LlamaRuntime.decode_batch

    def failing_draft_decode(self, rows):
        if self.path == default_model_path:  # the draft model (the target is its F16 copy)
            drafted_decodes.append(len(rows))
            if len(drafted_decodes) == 12:
                raise edgeinfer.InvalidModelError("llama_decode failed with code -3")
        return decode(self, rows)

    monkeypatch.setattr(LlamaRuntime, "decode_batch", failing_draft_decode)
    draft = SpeculationOptions(method="draft", draft_model=str(default_model_path), adaptive=False, draft_max=3,
                               p_min=0.0)
    lookup = SpeculationOptions(method="lookup", adaptive=False, draft_max=3)
    with BatchEngine.load(f16_path, batch=BatchOptions(parallel=4, calibrate_when_idle=False), n_ctx=4096,
                          flash_attn=False, speculation=draft) as be:
        specs = [draft, lookup, lookup, draft]  # (the draft model's requests answer at length: both run at the failure)
        gens = [be.submit(p, greedy(spec)) for (p, _), spec in zip(plain[:4], specs)]
        done = [g.result() for g in gens]
        assert len(drafted_decodes) >= 12  # (the failure came mid-run, after some steps were drafted)
        for (prompt, reference), d, spec in zip(plain, done, specs):
            assert d.tokens == reference
            sp = d.stats.speculation
            if spec is draft:
                assert "speculation off" in sp.note and "code -3" in sp.note and "\n" not in sp.note, sp
                assert sp.drafted > 0, sp
            else:
                assert sp.note == "", sp
        assert done[1].stats.speculation.drafted > 0  # (lookup drafted the quoted line)
        assert be.failure is None and "error" not in be.metrics().requests_finished
        again = be.submit(plain[0][0], greedy(draft)).result()  # the draft model drafts again (it was reset)
        assert again.tokens == plain[0][1] and again.stats.speculation.drafted > 0
        assert again.stats.speculation.note == ""


def test_a_dead_scheduler_thread_ends_every_reader_with_an_error(f16_path, plain, monkeypatch):
    """Whatever kills the scheduler thread, readers (blocking and polling) get an error instead of
    waiting for ever, and later submissions are refused."""
    real_step = Scheduler.step
    steps = []

    def step(self):
        steps.append(1)
        if len(steps) > 3:
            raise SystemError("the scheduler broke")
        return real_step(self)

    monkeypatch.setattr(Scheduler, "step", step)
    be = BatchEngine.load(f16_path, batch=BatchOptions(parallel=2, calibrate_when_idle=False), n_ctx=2048,
                          flash_attn=False)
    try:
        blocking = be.submit(plain[0][0], greedy())
        polling = be.submit(plain[1][0], greedy())
        queued = be.submit(plain[2][0], greedy())
        with pytest.raises(edgeinfer.EngineClosedError, match="scheduler stopped"):
            blocking.result()
        with pytest.raises(edgeinfer.EngineClosedError):
            while True:
                polling.poll()
        with pytest.raises(edgeinfer.EngineClosedError):
            queued.result()
        with pytest.raises(edgeinfer.EngineClosedError, match="scheduler stopped"):
            be.submit(plain[3][0], greedy())
    finally:
        be.close()


@pytest.mark.parametrize("face", ["Engine", "BatchEngine"])
def test_queue_and_first_token_times_mean_the_same_on_both_faces(face, f16_path, plain):
    """ttft_s counts from the request's queueing; queue_s is its wait for a slot: a request behind
    another on a one-slot engine waits about the other's whole run, then its own prefill."""
    opts = GenerateOptions(max_tokens=48, sampling=SamplingOptions(temperature=0.0))
    if face == "Engine":
        engine = edgeinfer.load(f16_path, n_ctx=2048, flash_attn=False)
        first = engine.generate(plain[0][0], opts)
        next(first)  # it holds the engine from here
        box: list = []
        second_thread = threading.Thread(target=lambda: box.append(engine.generate(plain[1][0], opts).result()))
        second_thread.start()
        a = first.result()
        second_thread.join(120)
        b = box[0]
    else:
        engine = BatchEngine.load(f16_path, batch=BatchOptions(parallel=1, calibrate_when_idle=False), n_ctx=2048,
                                  flash_attn=False)
        first, second = engine.submit(plain[0][0], opts), engine.submit(plain[1][0], opts)
        a, b = first.result(), second.result()
    engine.close()
    for d in (a, b):
        assert d.stats.ttft_s >= d.stats.queue_s + d.stats.prefill_s * 0.99, d.stats
    assert a.stats.queue_s < 0.5 * b.stats.queue_s, (a.stats, b.stats)
    assert b.stats.queue_s >= 0.8 * a.stats.decode_s, (a.stats, b.stats)  # (queued after a's first token at least)


# A cost curve whose knee is 32 rows (16 rows cost twice as much a row; 32 and up the same).
KNEE_32_CURVE = {1: 0.01, 2: 0.012, 16: 0.1, 32: 0.1, 48: 0.15, 64: 0.2, 96: 0.3, 128: 0.4, 192: 0.6, 256: 0.8,
                 384: 1.2, 512: 1.6}


def record_step_shapes(monkeypatch) -> list[list[tuple[int, int]]]:
    """Every decode from now on, as (sequence id, rows) runs in batch order."""
    steps: list[list[tuple[int, int]]] = []
    decode = LlamaRuntime.decode_batch

    def recorded_decode(self, rows):
        shape: list[list[int]] = []
        for seq in rows.seqs:
            if shape and shape[-1][0] == seq:
                shape[-1][1] += 1
            else:
                shape.append([seq, 1])
        steps.append([(s, n) for s, n in shape])
        return decode(self, rows)

    monkeypatch.setattr(LlamaRuntime, "decode_batch", recorded_decode)
    return steps


def test_prompt_steps_are_one_ubatch_and_a_short_tail_joins_its_chunk(f16_path, single, monkeypatch):
    """With a stream per slot, prompts read in the same step take equal rows on neighbouring
    sequence ids (one ubatch: llama.cpp would give any other mix a pass over the weights of its
    own), and a prompt whose rows left after a chunk would be fewer than the chunk reads them in
    that chunk. Outputs stay the lone ones."""
    steps = record_step_shapes(monkeypatch)
    batch = BatchOptions(parallel=4, cost_curve=KNEE_32_CURVE, calibrate_when_idle=False)
    words = ["alpha", "bravo", "charlie", "delta"]
    prompts = [single.tokenize(" ".join(f"{words[k]}{i} item" for i in range(60)))[:150 - 12 * k] for k in range(4)]
    lone = []
    for p in prompts:
        single.reset()
        lone.append(single.generate(p, replace(greedy(), max_tokens=8)).result().tokens)
    with BatchEngine.load(f16_path, batch=batch, n_ctx=4096, flash_attn=False) as be:
        alone = list(be.submit(prompts[3], replace(greedy(), max_tokens=8)))
        chunks = [e.done for e in alone if isinstance(e, edgeinfer.PrefillProgress)]
        assert chunks == [32, 64, 114], chunks  # 114 = 32 + 32 + 50: the 18 rows after a third chunk join it
        assert_same_or_near_tie(single, prompts[3], lone[3], alone[-1].tokens)
        steps.clear()
        done = concurrently(be, prompts[:3], replace(greedy(), max_tokens=8))
    prompt_steps = [s for s in steps if any(n > 1 for _, n in s)]
    print("prompt steps:", prompt_steps)
    assert all(len(ubatch_rows(s, 512, False)) == 1 for s in prompt_steps), prompt_steps
    assert any(len(s) > 1 for s in prompt_steps), prompt_steps  # prompts that came together read together
    assert sum(n for s in prompt_steps for _, n in s) == sum(len(p) - d.stats.cached_tokens
                                                             for p, d in zip(prompts, done))
    for p, ref, d in zip(prompts, lone, done):
        assert_same_or_near_tie(single, p, ref, d.tokens)


def test_streams_wait_for_the_prompts_that_came_with_them_and_those_read_together(f16_path, single, monkeypatch):
    """Prompts submitted together: the one that finishes first sits out the steps that read the
    others (as llama-server's streams wait for its batch) although each of those steps costs more
    than `decode_wait` by the curve, and while it sits out, the other prompts' rows are read
    together (equal rows on neighbouring ids: one ubatch), not one prompt a step. A prompt that
    arrives after the streams decode keeps the `decode_wait` bound: they ride its steps."""
    steps = record_step_shapes(monkeypatch)
    # every prompt step costs far more than the 1 ms bound by this curve
    batch = BatchOptions(parallel=4, cost_curve=KNEE_32_CURVE, calibrate_when_idle=False, decode_wait=0.001)
    words = ["alpha", "bravo", "charlie", "delta"]
    prompts = [single.tokenize(" ".join(f"{words[k]}{i} item" for i in range(60)))[:n]
               for k, n in enumerate([70, 150, 150, 150])]
    lone = []
    for p in prompts:
        single.reset()
        lone.append(single.generate(p, replace(greedy(), max_tokens=6)).result().tokens)
    with BatchEngine.load(f16_path, batch=batch, n_ctx=4096, flash_attn=False) as be:
        steps.clear()
        done = concurrently(be, prompts, replace(greedy(), max_tokens=6))
        together = [list(s) for s in steps]
        steps.clear()
        running = be.generate("1, 2, 3, 4, 5, 6, 7, 8,", replace(greedy(), max_tokens=40))
        first = next(e for e in running if isinstance(e, edgeinfer.TokenEvent))
        assert first.text
        fresh = single.tokenize(" ".join(f"echo{i} item" for i in range(60)))[:120]
        late = be.submit(fresh, replace(greedy(), max_tokens=2)).result()
        rest = running.result()
    print("steps of the prompts that came together:", together)
    prompt_steps = [i for i, s in enumerate(together) if any(n > 1 for _, n in s)]
    last_prompt_step = prompt_steps[-1]
    # No decode row until every prompt is read: the first to finish waited for the others ...
    assert all(all(n > 1 for _, n in s) for s in together[: last_prompt_step + 1]), together
    # ... and the steps it sat out read the other three together, as one ubatch each
    first_done = next(i for i in range(len(together))  # the step that read slot 0's last prompt row
                      if sum(n for s in together[: i + 1] for q, n in s if q == 0) >= 70)
    sat_out = together[first_done + 1 : last_prompt_step + 1]
    assert sat_out and all(len(s) == 3 and len(ubatch_rows(s, 512, False)) == 1 for s in sat_out), together
    for p, ref, d in zip(prompts, lone, done):
        assert_same_or_near_tie(single, p, ref, d.tokens)
    # The late prompt's steps: the running stream (slot 0 or another) rode them (1 ms bound)
    late_steps = [s for s in steps if any(n > 1 for _, n in s)]
    assert late.stats.prompt_tokens == 120 and late.stats.cached_tokens < 8 and rest.tokens
    assert any(any(n == 1 for _, n in s) for s in late_steps), steps
