"""Speculative decoding is lossless: same greedy tokens, same sampling distribution, a KV cache
that stays consistent through accept/reject cycles; incompatible drafts are refused clearly."""

from __future__ import annotations

import collections
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import edgeinfer
from edgeinfer import (
    Cancelled,
    GenerateOptions,
    IncompatibleDraftError,
    SamplingOptions,
    SpeculationOptions,
    SpeculationProgress,
    Store,
)

pytestmark = pytest.mark.slow

WORKLOADS = Path(__file__).resolve().parents[1] / "benchmarks" / "workloads"


def code_edit_messages() -> list[dict[str, str]]:
    code = (WORKLOADS / "code_edit.py").read_text()
    return [{"role": "user", "content": "Rename the function compute_total to total_stock_value everywhere in this "
             "file and return the whole file.\n\n```python\n" + code + "```"}]


PROMPTS = [
    code_edit_messages(),
    [{"role": "user", "content": "Here is a passage:\n\nThe lighthouse keeper climbed the one hundred and twelve "
      "steps every evening at dusk, trimmed the wick, polished the great lens, and wrote the weather in a "
      "leather logbook that his grandfather had started.\n\nQuote the sentence that says what he wrote in."}],
    [{"role": "user", "content": "Write a short story about a robot who learns to paint."}],
]


@pytest.fixture(scope="module")
def f16_path(default_model_copy) -> Path:
    """The default model requantized to F16 by llama.cpp: its batched and one-token paths round
    alike, so greedy outputs can be compared token for token (Q4_1's cannot: its batched path rounds differently)."""
    return default_model_copy("F16")


@pytest.fixture(scope="module")
def f16_engine(f16_path):
    engine = edgeinfer.load(f16_path, n_ctx=4096, flash_attn=False)
    yield engine
    engine.close()


def greedy(n: int, spec: SpeculationOptions | None = None) -> GenerateOptions:
    return GenerateOptions(max_tokens=n, sampling=SamplingOptions(temperature=0.0),
                           speculation=spec or SpeculationOptions())


def run(engine, messages, opts):
    """Every run starts from the prompt's KV as one prefill from an empty cache makes it (identical
    batch shapes): a cache that already holds this very prompt is that (its remembered last logits
    row gives the first token, nothing is decoded again); any other is reset."""
    prompt = engine.chat_tokens(messages)
    if engine._scheduler.slots[0].seq.cached[: len(prompt)] != prompt:  # white-box: what the cache holds
        engine.reset()
    return engine.chat(messages, opts).result()


N_GREEDY = 64  # tokens each lossless greedy comparison generates


def next_token_logits(engine) -> tuple[list[int], np.ndarray]:
    """White-box: what the engine's cache holds, and the logits its last cell gives (that token
    decoded again in place)."""
    with engine._slot.hold() as rt:
        seq = engine._scheduler.slots[0].seq
        cached = list(seq.cached)
        seq.truncate(len(cached) - 1)
        seq.decode([cached[-1]])
        return cached, rt.logits_row(-1).copy()


@pytest.fixture(scope="module")
def plain_greedy(f16_engine):
    """`plain_greedy(i)`: plain greedy decoding of PROMPTS[i], run once for the module (each
    comparison below runs only its speculative side; the prompt of the code edit alone is 3 s).
    `plain_greedy.cache[i]`: the tokens plain decoding left in the cache, one at a time, and the
    logits they give for the next token (next_token_logits)."""
    done: dict[int, edgeinfer.DoneEvent] = {}

    def get(prompt_index: int) -> edgeinfer.DoneEvent:
        if prompt_index not in done:
            done[prompt_index] = run(f16_engine, PROMPTS[prompt_index], greedy(N_GREEDY))
            get.cache[prompt_index] = next_token_logits(f16_engine)
        return done[prompt_index]

    get.cache = {}
    return get


# The code edit last: the test after these starts from its cache (its 736-token prompt is 3 s).
CASES = [
    ("rag-quote", 1, SpeculationOptions(method="lookup", adaptive=False, draft_max=8)),
    ("free-chat", 2, SpeculationOptions(method="auto")),
    ("code-edit", 0, SpeculationOptions(method="lookup")),
    ("code-edit", 0, SpeculationOptions(method="auto")),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[2].method}{'' if c[2].adaptive else '-fixed'}" for c in CASES])
def test_greedy_output_is_token_identical(f16_engine, plain_greedy, case):
    _, prompt_index, spec = case
    plain = plain_greedy(prompt_index)
    fast = run(f16_engine, PROMPTS[prompt_index], greedy(N_GREEDY, spec))
    assert fast.tokens == plain.tokens
    assert fast.text == plain.text
    sp = fast.stats.speculation
    assert sp is not None and sp.method == spec.method
    # Every step is a drafting or a plain one, and each gives one token plus what it accepted (the
    # first token comes from the prompt; an EOS that ends the output is a step's token too).
    assert sp.steps + sp.plain_steps + sp.accepted + 1 - len(fast.tokens) in (0, 1), sp
    if prompt_index != 2:  # text to copy (the free story may give lookup nothing): lookup drafts,
        # adaptive or not (the policy explores where its estimates say no), and is accepted
        assert sp.drafted > 0 and sp.accepted > 0, sp


def test_fixed_k_lookup_drafts_rejects_and_leaves_a_consistent_cache(f16_engine, plain_greedy):
    """Fixed 8-token lookup drafts on the code edit whenever it finds a match: the output is plain
    greedy's, it really drafted and accepted, and after its many accept/reject cycles the KV cache
    gives the logits that plain decoding's cache (filled one token at a time) gives for the same tokens."""
    done = run(f16_engine, PROMPTS[0], greedy(N_GREEDY, SpeculationOptions(method="lookup", adaptive=False, draft_max=8)))
    assert done.tokens == plain_greedy(0).tokens
    sp = done.stats.speculation
    assert sp.drafted > 20 and sp.accepted > 10 and sp.steps > 3
    assert 0 < sp.acceptance_rate <= 1 and sp.mean_accepted_len > 0
    assert len(sp.per_position_acceptance) == 8
    assert sp.accepted < sp.drafted  # there were rejections to clean up
    cached, ours = next_token_logits(f16_engine)
    plain_cached, plain = plain_greedy.cache[0]
    assert cached == plain_cached
    np.testing.assert_allclose(ours, plain, atol=2e-2 * np.abs(plain).max())
    assert int(np.argmax(ours)) == int(np.argmax(plain))


def test_draft_model_greedy_identical(f16_engine, plain_greedy, default_model_path):
    """The quoting prompt here; the story is the next test's (the same drafter, there with p_min 0,
    checked token for token too); the long code edit would add 5 s of prefill for both models."""
    spec = SpeculationOptions(method="draft", draft_model=str(default_model_path), adaptive=False, draft_max=4)
    fast = run(f16_engine, PROMPTS[1], greedy(N_GREEDY, spec))
    assert fast.tokens == plain_greedy(1).tokens
    assert fast.stats.speculation.drafted > 0 and fast.stats.speculation.method == "draft"


def test_a_draft_model_catches_up_within_its_first_draft_decode(f16_engine, plain_greedy, default_model_path,
                                                                 monkeypatch):
    """After a step that accepted its whole draft, the draft model is behind by its last drafted
    token and the target's bonus token: both enter with its next draft decode, so each drafted
    token costs one draft decode (none is spent only on catching up), and output stays plain's."""
    from edgeinfer.engine.llama.runtime import LlamaRuntime

    spec = SpeculationOptions(method="draft", draft_model=str(default_model_path), adaptive=False, draft_max=4,
                              p_min=0.0)
    plain = plain_greedy(2)
    run(f16_engine, PROMPTS[2], greedy(4, spec))  # loads the draft model and measures its step cost
    target = f16_engine._runtime  # white-box: tell the draft model's decodes from the target's
    rows: list[int] = []
    real_decode = LlamaRuntime.decode_batch

    def recording(self, batch):
        if self is not target and len(batch) <= 4:  # (the prompt's prefill is one long decode)
            rows.append(len(batch))
        return real_decode(self, batch)

    monkeypatch.setattr(LlamaRuntime, "decode_batch", recording)
    done = run(f16_engine, PROMPTS[2], greedy(N_GREEDY, spec))
    assert done.tokens == plain.tokens
    sp = done.stats.speculation
    assert sp.accepted > 0 and len(rows) == sp.drafted, (rows, sp)
    assert 2 in rows  # it did fall behind by two, and caught up in the same decode


def test_reset_makes_the_draft_model_read_the_prompt_again(f16_engine, default_model_path, monkeypatch):
    """Engine.reset empties the draft model's cache too: the next request's drafter reads the whole
    prompt, as a new request's does (what `tune` times a draft model by); without a reset it reuses
    what it holds."""
    from edgeinfer.engine.llama.runtime import LlamaRuntime

    spec = SpeculationOptions(method="draft", draft_model=str(default_model_path), adaptive=False, draft_max=4)
    prompt = f16_engine.chat_tokens(PROMPTS[1])
    f16_engine.chat(PROMPTS[1], greedy(8, spec)).result()  # the draft model loaded, the prompt in both caches
    target = f16_engine._runtime  # white-box: tell the draft model's decodes from the target's
    rows: list[int] = []
    real_decode = LlamaRuntime.decode_batch

    def recording(self, batch):
        if self is not target:
            rows.append(len(batch))
        return real_decode(self, batch)

    monkeypatch.setattr(LlamaRuntime, "decode_batch", recording)
    f16_engine.chat(PROMPTS[1], greedy(8, spec)).result()
    kept = sum(rows)
    rows.clear()
    f16_engine.reset()
    f16_engine.chat(PROMPTS[1], greedy(8, spec)).result()
    assert kept < len(prompt) // 2 <= len(prompt) - 8 <= sum(rows), (kept, sum(rows), len(prompt))


def test_sampling_distribution_matches_plain(f16_engine, default_model_path):
    """Sampling (the default top-k/top-p/min-p chain at temperature 0.7), a draft model speculating
    with a fixed length (every step drafts; the second and third tokens are both drafted, so a
    rejection can come at either) gives the first three tokens exactly the target's own
    distribution: chi-square of the speculative samples against the probabilities llama.cpp's
    sampler chain gives on the target's logits, for every sequence expected at least 5 times (the
    rest pooled). (A fourth token is asked for: a step drafts at most the tokens before its last.)"""
    from sequence_chi_square import sequence_chi_square

    prompt = f16_engine.chat_tokens([{"role": "user", "content": "Name a colour."}])
    sampling = SamplingOptions(temperature=0.7)
    spec = SpeculationOptions(method="draft", draft_model=str(default_model_path), adaptive=False, draft_max=3, p_min=0.0)
    # n = 100: the fewest runs that give this prompt's concentrated first tokens the three cells expected
    # >= 5 times a chi-square needs (60 give one). At alpha = 1e-3 the test then rejects the first three
    # tokens drawn at twice the temperature (w = 0.42, 3 df) with power 0.67 only (sequence_chi_square.
    # chi_square_power): it is for gross errors; 200 runs would reach 0.99.
    n, length = 100, 3

    observed: collections.Counter = collections.Counter()
    drafted = accepted = 0
    for seed in range(n):
        done = f16_engine.generate(prompt, GenerateOptions(max_tokens=length + 1, sampling=replace(sampling, seed=seed),
                                                           speculation=spec)).result()
        observed[tuple(done.tokens[:length])] += 1
        drafted += done.stats.speculation.drafted
        accepted += done.stats.speculation.accepted
    assert drafted >= 2 * n and 0 < accepted < drafted  # tokens 2 and 3 were drafted, and rejected at times

    result, table = sequence_chi_square(f16_engine, prompt, sampling, observed, n, length)
    assert result.pvalue > 1e-3, (result, table)


def test_same_seed_gives_same_sample_with_speculation(f16_engine, default_model_path):
    """Prompt lookup is verified by the target's own sampler chain, position by position, so with one
    seed it samples the same tokens as plain decoding. A draft model at T > 0 samples its drafts and
    is verified by the rejection rule (tests/test_rejection_sampling.py: same distribution, not the
    same tokens); with one seed it gives the same tokens every time."""
    lookup = SpeculationOptions(method="lookup", adaptive=False, draft_max=4)
    draft = SpeculationOptions(method="draft", draft_model=str(default_model_path), adaptive=False, draft_max=4)

    def sample(prompt_index: int, seed: int, spec: SpeculationOptions | None) -> edgeinfer.DoneEvent:
        opts = GenerateOptions(max_tokens=16, sampling=SamplingOptions(temperature=0.8, seed=seed),
                               speculation=spec or SpeculationOptions())
        return run(f16_engine, PROMPTS[prompt_index], opts)

    # Lookup on the quoting prompt, where it finds drafts (on the story it drafts next to nothing).
    same = drafted = accepted = 0
    for seed in range(4):
        plain, fast = sample(1, seed, None), sample(1, seed, lookup)
        same += plain.tokens == fast.tokens
        drafted += fast.stats.speculation.drafted
        accepted += fast.stats.speculation.accepted
    assert same >= 3 and drafted > 0 and accepted > 0, (same, drafted, accepted)
    for seed in range(2):
        first, again = sample(2, seed, draft), sample(2, seed, draft)
        assert first.tokens == again.tokens
        assert first.stats.speculation.drafted > 0


def test_incompatible_draft_is_refused(f16_engine, tmp_path):
    """A draft with another vocabulary (a SentencePiece model) is refused, naming the mismatch."""
    from hf_models import make_random_hf_model

    from edgeinfer.convert import convert_model

    corpus = (Path(__file__).read_text()) * 3
    src = make_random_hf_model(tmp_path / "spm", "llama", sentencepiece_corpus=corpus)
    other = convert_model(src, "f16", tmp_path / "spm.gguf", register=False).path
    spec = SpeculationOptions(method="draft", draft_model=str(other))
    with pytest.raises(IncompatibleDraftError, match="incompatible with the target: vocabulary"):
        f16_engine.chat(PROMPTS[1], greedy(8, spec)).result()
    # the engine is still usable
    assert f16_engine.chat(PROMPTS[1], greedy(4)).result().tokens


def test_self_draft_is_made_by_the_quantizer_and_lossless(f16_path, plain_greedy):
    """Not prepared beforehand, the first speculative request makes its self-draft itself and says
    so: SpeculationProgress events (one per tensor quantized) come before its first token. (Its
    engine loads the module's F16 file as the module's does: plain greedy output is the module's.)"""
    store = Store()
    f16 = store.register(f16_path, "spec-target", "f16", owned=False)
    plain = plain_greedy(1)
    with edgeinfer.load(f16.ref, n_ctx=4096, flash_attn=False) as engine:
        spec = SpeculationOptions(method="self", self_quant="Q8_0", adaptive=False, draft_max=4)
        events = list(engine.chat(PROMPTS[1], greedy(N_GREEDY // 2, spec)))  # (identity on 64: the tests above)
        progress = [e for e in events if isinstance(e, SpeculationProgress)]
        assert progress and events[: len(progress)] == progress  # all of them before any token
        quantized = [e for e in progress if e.stage == "quantize"]
        assert quantized[-1].done == quantized[-1].total > 10 and progress[-1].stage == "ready"
        fast = events[-1]
        assert fast.tokens == plain.tokens[: N_GREEDY // 2]
        assert fast.stats.speculation.method == "self=Q8_0" and fast.stats.speculation.drafted > 0
        engine.reset()
        again = list(engine.chat(PROMPTS[1], greedy(8, spec)))
        assert not any(isinstance(e, SpeculationProgress) for e in again)  # prepared once per engine
    made = [m for m in store.list() if m.name == "spec-target" and m.tag != "f16"]
    assert made and made[0].derived_from == "spec-target:f16" and made[0].quant == "Q8_0"


def test_prepare_speculation_reports_progress_and_can_be_cancelled(f16_path):
    """The explicit step: progress per tensor, a cancel that leaves nothing behind, nothing to do
    once prepared, and load(speculation=...) finding the copy the store now has."""
    store = Store()
    f16 = store.register(f16_path, "prep-target", "f16", owned=False)

    def copies() -> list:
        return [m for m in store.list() if m.name == "prep-target" and m.tag != "f16"]

    with edgeinfer.load(f16.ref, n_ctx=512) as engine:
        stop = threading.Event()
        seen: list[SpeculationProgress] = []

        def on_progress(event: SpeculationProgress) -> None:
            seen.append(event)
            if event.stage == "quantize" and event.done >= 3:
                stop.set()

        with pytest.raises(Cancelled):
            engine.prepare_speculation("self=Q8_0", progress=on_progress, cancel=stop)
        assert seen and copies() == []
        seen.clear()
        engine.prepare_speculation("self=Q8_0", progress=seen.append)
        assert [e.stage for e in seen[-2:]] == ["load", "ready"]
        assert max(e.done for e in seen if e.stage == "quantize") == seen[0].total > 10
        assert len(copies()) == 1
        seen.clear()
        engine.prepare_speculation(SpeculationOptions(method="self", self_quant="Q8_0"), progress=seen.append)
        engine.prepare_speculation("lookup", progress=seen.append)
        assert seen == []
    loaded: list[SpeculationProgress] = []
    with edgeinfer.load(f16.ref, n_ctx=512, speculation="self=Q8_0", progress=loaded.append) as engine:
        assert [e.stage for e in loaded] == ["load", "ready"]
        done = engine.chat(PROMPTS[1], greedy(8, SpeculationOptions(method="self", self_quant="Q8_0"))).result()
        assert done.stats.speculation.method == "self=Q8_0"


def test_cli_shows_the_self_draft_being_made_before_answering(f16_path):
    """`edgeinfer run --speculate self=Q8_0` on a model without that copy prepares it first, with
    its progress on stderr, instead of a silent first token that looks hung."""
    import os
    import subprocess
    import sys

    store = Store()
    store.register(f16_path, "cli-target", "f16", owned=False)
    r = subprocess.run(
        [sys.executable, "-m", "edgeinfer", "run", "cli-target:f16", "Say hi", "--speculate", "self=Q8_0", "-n", "4",
         "--temperature", "0", "--threads", "1"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
    )
    assert r.returncode == 0, r.stderr
    bar = [line for line in r.stderr.splitlines() if "self-draft of cli-target:f16" in line]
    assert bar and "100.0%" in bar[-1] and "tensors" in bar[-1]
    assert r.stdout.strip() and any(m.name == "cli-target" and m.tag != "f16" for m in store.list())
