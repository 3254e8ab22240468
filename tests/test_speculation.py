"""Speculative decoding is lossless: same greedy tokens, same sampling distribution, a KV cache
that stays consistent through accept/reject cycles; incompatible drafts are refused clearly."""

from __future__ import annotations

import collections
import threading
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
def f16_path(tmp_path_factory, default_model_path) -> Path:
    """The default model requantized to F16 by llama.cpp: its batched and one-token paths round
    alike, so greedy outputs can be compared token for token (Q4_1's cannot: its batched path rounds differently)."""
    from edgeinfer.quantize import quantize_model

    store = Store(tmp_path_factory.mktemp("spec-store"))
    result = quantize_model(default_model_path, "F16", store=store, allow_requantize=True)
    return result.path


@pytest.fixture(scope="module")
def f16_engine(f16_path):
    engine = edgeinfer.load(f16_path, n_ctx=4096, flash_attn=False)
    yield engine
    engine.close()


def greedy(n: int, spec: SpeculationOptions | None = None) -> GenerateOptions:
    return GenerateOptions(max_tokens=n, sampling=SamplingOptions(temperature=0.0),
                           speculation=spec or SpeculationOptions())


def run(engine, messages, opts):
    engine.reset()  # the same (empty) cache for every run: identical batch shapes for the prompt
    return engine.chat(messages, opts).result()


CASES = [
    ("code-edit", 0, SpeculationOptions(method="lookup")),
    ("code-edit", 0, SpeculationOptions(method="lookup", adaptive=False, draft_max=8)),  # drafts whenever it can
    ("code-edit", 0, SpeculationOptions(method="auto")),
    ("rag-quote", 1, SpeculationOptions(method="lookup", adaptive=False, draft_max=8)),
    ("free-chat", 2, SpeculationOptions(method="auto")),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[2].method}{'' if c[2].adaptive else '-fixed'}" for c in CASES])
def test_greedy_output_is_token_identical(f16_engine, case):
    _, prompt_index, spec = case
    messages = PROMPTS[prompt_index]
    plain = run(f16_engine, messages, greedy(80))
    fast = run(f16_engine, messages, greedy(80, spec))
    assert fast.tokens == plain.tokens
    assert fast.text == plain.text
    assert fast.stats.speculation is not None


def test_fixed_k_lookup_actually_drafts_on_code_edit(f16_engine):
    done = run(f16_engine, PROMPTS[0], greedy(96, SpeculationOptions(method="lookup", adaptive=False, draft_max=8)))
    sp = done.stats.speculation
    assert sp.drafted > 20 and sp.accepted > 10 and sp.steps > 3
    assert 0 < sp.acceptance_rate <= 1 and sp.mean_accepted_len > 0
    assert len(sp.per_position_acceptance) == 8


def test_draft_model_greedy_identical(f16_engine, default_model_path):
    spec = SpeculationOptions(method="draft", draft_model=str(default_model_path), adaptive=False, draft_max=4)
    for messages in PROMPTS[:2]:
        plain = run(f16_engine, messages, greedy(64))
        fast = run(f16_engine, messages, greedy(64, spec))
        assert fast.tokens == plain.tokens
        assert fast.stats.speculation.drafted > 0 and fast.stats.speculation.method == "draft"


def test_kv_cache_consistent_after_many_accept_reject_cycles(f16_engine):
    done = run(f16_engine, PROMPTS[0], greedy(160, SpeculationOptions(method="lookup", adaptive=False, draft_max=6)))
    sp = done.stats.speculation
    assert sp.steps > 5 and sp.accepted < sp.drafted  # there were rejections to clean up
    cached = list(f16_engine._runtime.cached)
    with f16_engine._slot.hold() as rt:  # white-box: the next-token logits of the speculated cache
        rt.truncate(len(cached) - 1)
        rt.decode([cached[-1]])
        ours = rt.logits_row(-1).copy()
    fresh = f16_engine.logits(cached)[-1]
    np.testing.assert_allclose(ours, fresh, atol=2e-2 * np.abs(fresh).max())
    assert int(np.argmax(ours)) == int(np.argmax(fresh))


def test_sampling_distribution_matches_plain(f16_engine, default_model_path):
    """At temperature 1 the first tokens follow the target's distribution with a (fixed-k) draft
    model speculating: chi-square between plain and speculative samples over disjoint seed sets."""
    from scipy.stats import chi2_contingency

    messages = [{"role": "user", "content": "Name a colour."}]
    spec = SpeculationOptions(method="draft", draft_model=str(default_model_path), adaptive=False, draft_max=3, p_min=0.0)
    n = 120

    def sample(speculation: SpeculationOptions | None, seeds: range) -> tuple[collections.Counter, int, int]:
        seqs: collections.Counter = collections.Counter()
        drafted = accepted = 0
        for seed in seeds:
            opts = GenerateOptions(max_tokens=3, sampling=SamplingOptions(temperature=1.0, top_k=0, top_p=1.0,
                                   min_p=0.0, seed=seed), speculation=speculation or SpeculationOptions())
            done = f16_engine.chat(messages, opts).result()
            seqs[tuple(done.tokens[:3])] += 1
            if done.stats.speculation:
                drafted += done.stats.speculation.drafted
                accepted += done.stats.speculation.accepted
        return seqs, drafted, accepted

    plain, _, _ = sample(None, range(n))
    spec_counts, drafted, accepted = sample(spec, range(n, 2 * n))
    assert drafted >= n and accepted > 0  # the drafter really took part (one draft step each)
    # categories: sequences seen at least 8 times overall, the rest pooled
    keys = [k for k in set(plain) | set(spec_counts) if plain[k] + spec_counts[k] >= 8]
    table = [[plain[k] for k in keys] + [n - sum(plain[k] for k in keys)],
             [spec_counts[k] for k in keys] + [n - sum(spec_counts[k] for k in keys)]]
    table = [list(col) for col in zip(*table) if sum(col) > 0]
    _, p_value, _, _ = chi2_contingency(np.array(table).T)
    assert p_value > 0.001, (p_value, table)


def test_same_seed_gives_same_sample_with_speculation(f16_engine, default_model_path):
    """Prompt lookup is verified by the target's own sampler chain, position by position, so with one
    seed it samples the same tokens as plain decoding. A draft model at T > 0 samples its drafts and
    is verified by the rejection rule (tests/test_rejection_sampling.py: same distribution, not the
    same tokens); with one seed it gives the same tokens every time."""
    lookup = SpeculationOptions(method="lookup", adaptive=False, draft_max=4)
    draft = SpeculationOptions(method="draft", draft_model=str(default_model_path), adaptive=False, draft_max=4)
    same = 0
    for seed in range(4):
        opts = GenerateOptions(max_tokens=24, sampling=SamplingOptions(temperature=0.8, seed=seed))
        runs = []
        for spec in (None, lookup, draft, draft):
            f16_engine.reset()
            o = opts if spec is None else GenerateOptions(max_tokens=24, sampling=opts.sampling, speculation=spec)
            runs.append(f16_engine.chat(PROMPTS[2], o).result())
        same += runs[0].tokens == runs[1].tokens
        assert runs[2].tokens == runs[3].tokens
        assert runs[2].stats.speculation.drafted > 0
    assert same >= 3


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


def test_self_draft_is_made_by_the_quantizer_and_lossless(f16_path, tmp_path):
    """Not prepared beforehand, the first speculative request makes its self-draft itself and says
    so: SpeculationProgress events (one per tensor quantized) come before its first token."""
    store = Store()
    f16 = store.register(f16_path, "spec-target", "f16", owned=False)
    with edgeinfer.load(f16.ref, n_ctx=4096, flash_attn=False) as engine:
        spec = SpeculationOptions(method="self", self_quant="Q8_0", adaptive=False, draft_max=4)
        plain = run(engine, PROMPTS[1], greedy(48))
        engine.reset()
        events = list(engine.chat(PROMPTS[1], greedy(48, spec)))
        progress = [e for e in events if isinstance(e, SpeculationProgress)]
        assert progress and events[: len(progress)] == progress  # all of them before any token
        quantized = [e for e in progress if e.stage == "quantize"]
        assert quantized[-1].done == quantized[-1].total > 10 and progress[-1].stage == "ready"
        fast = events[-1]
        assert fast.tokens == plain.tokens
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
