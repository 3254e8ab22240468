"""The suffix drafter (`--speculate suffix`, and a source of `auto`): continuations of earlier answers
and of the request's own text, scored by frequency (speculation/suffix.py).

Pure tests of the tree's counts, the match-length rule, the memory bound and the scopes; then on the
default model's F16 copy: greedy output is plain decoding's alone and four at a time (the drafts
really come from earlier answers: `remembered`), the rejection rule keeps the target's distribution
at T > 0 (chi-square), and the server keeps one memory per API key.
"""

from __future__ import annotations

import collections
import threading

import numpy as np
import pytest
from test_batch_engine import f16_path, f16_single  # noqa: F401  (session/module fixtures shared with the engine tests)

import edgeinfer
from edgeinfer import BatchEngine, BatchOptions, GenerateOptions, SamplingOptions, SpeculationOptions
from edgeinfer.engine.core.sampler import TokenDistribution, verify_sampled_draft
from edgeinfer.engine.speculation.suffix import PROMPT_TAIL, SuffixMemory, SuffixSource, TokenCorpus, speculate
from greedy_compare import assert_same_or_near_tie


# -- the tree (pure) ---------------------------------------------------------------------------------
def test_the_most_frequent_continuation_is_drafted_with_its_frequency():
    corpus = TokenCorpus()
    for tail in ([7, 8, 9], [7, 8, 9], [7, 5, 6]):  # after 1 2 3 4: 7 always, then 8 two times in three
        corpus.add([1, 2, 3, 4, *tail])
    found = speculate([0, 1, 2, 3, 4], [corpus], 10)
    assert found.tokens == [7, 8, 9] and found.match == 4
    assert found.probs == pytest.approx([1.0, 2 / 3, 2 / 3])
    assert found.score == pytest.approx(1 + 4 / 3)


def test_a_draft_is_at_most_as_long_as_its_match_and_stops_below_min_prob():
    corpus = TokenCorpus()
    corpus.add([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert speculate([50, 51, 3, 4], [corpus], 10).tokens == [5, 6]  # a 2-token match: 2 tokens
    assert speculate([1, 2, 3, 4], [corpus], 10).tokens == [5, 6, 7, 8]
    assert speculate([1, 2, 3, 4], [corpus], 3).tokens == [5, 6, 7]  # the caller's limit
    split = TokenCorpus()
    for t in range(12):  # twelve different continuations: each 1/12 < min_prob 0.1
        split.add([1, 2, 3, 4, 100 + t])
    assert speculate([1, 2, 3, 4], [split], 10).tokens == []
    assert speculate([9, 9], [corpus], 10).tokens == []  # nothing matches


def test_ties_go_to_the_most_recent_text_and_the_request_s_own_text_first():
    corpus = TokenCorpus()
    corpus.add([1, 2, 3, 4, 5])
    corpus.add([1, 2, 3, 4, 6])
    assert speculate([1, 2, 3, 4], [corpus], 1).tokens == [6]
    source = SuffixSource(corpus, own=True)
    own = [1, 2, 3, 4, 7, 0, 1, 2, 3, 4]  # the request itself wrote 1 2 3 4 7 earlier
    found = source.draft(own, 1)
    assert found.tokens == [7] and not source.remembered(found)


def test_past_a_value_written_otherwise_the_frame_continues_from_the_place_it_agrees_with():
    """A tool call with other values: where `"city": "Denver",` stops agreeing with the earlier
    `"city": "Paris",` (one token against two), the earlier place is known from the frame before
    the value, so the next key is drafted; a token that matches without such a frame drafts nothing."""
    key, colon, quote, end, indent = 501, 502, 503, 504, 505
    city, unit, days, paris, celsius, three = 601, 602, 603, 701, 702, 703
    corpus = TokenCorpus()
    corpus.add([indent, quote, city, colon, quote, paris, 711, end, indent, quote, unit, colon, quote, celsius,
                end, indent, quote, days, colon, three, end])
    context = [9, 9, indent, quote, city, colon, quote, 800, end]  # "city": "Denver",  (one token)
    found = SuffixSource(corpus, own=False).draft(context, 6)
    assert found.tokens[:4] == [indent, quote, unit, colon] and found.match > 1
    # The same anchor after a frame that agrees with nothing: no draft (one token is a guess).
    assert SuffixSource(corpus, own=False).draft([9, 9, 9, 9, 800, end], 6).tokens == []


def test_a_suffix_draft_may_run_twice_as_long_as_its_match():
    corpus = TokenCorpus()
    corpus.add(list(range(1, 21)))
    found = SuffixSource(corpus, own=False).draft([50, 51, 3, 4, 5], 10)  # a 3-token match
    assert found.tokens == [6, 7, 8, 9, 10, 11]


def test_short_suffix_matches_are_priced_by_how_often_their_first_token_was_right():
    """Drafts after 2-token matches keep being rejected, drafts after 5-token matches accepted: the
    short ones' first row is then priced lower (the tree's own frequencies say 1.0 for both)."""
    from edgeinfer.engine.core.events import SpeculationStats
    from edgeinfer.engine.speculation import CostModel, RequestSpeculation

    memory = TokenCorpus()
    memory.add(list(range(1, 31)))
    costs = CostModel({b: 0.01 * (1 + 0.2 * (b - 1)) for b in range(1, 34)})
    spec = RequestSpeculation(SpeculationOptions(method="auto"), costs, SpeculationStats("auto"), None, None, memory)
    short, long_ = [900, 901, 902, 11, 12], [903, 904, 7, 8, 9, 10, 11, 12]  # matches of 2 and 6 tokens
    for _ in range(6):
        p = spec.propose(short, 16, 0)
        assert p is not None and p.kind == "suffix"
        spec.observe(p, p.limit, 0, 0.02, 0.01)
        p = spec.propose(long_, 16, 0)
        spec.observe(p, p.limit, p.limit, 0.02, 0.01)
    spec.observe(spec.propose(short, 16, 0), 4, 0, 0.02, 0.01)  # (outside a run again)
    assert spec.propose(short, 16, 0).gains[0] < 0.6 * spec.propose(long_, 16, 0).gains[0]


def test_memory_is_bounded_and_drops_the_least_recently_used_answers():
    memory = SuffixMemory(max_tokens=100)
    for i in range(20):
        memory.remember("k", [0] * 20, list(range(1000 * i, 1000 * i + 20)))
    corpus = memory.corpus("k")
    assert memory.size <= 100 and corpus.size == memory.size
    kept = list(corpus.texts)
    assert len(kept) == 100 // (PROMPT_TAIL + 20) and kept[-1] == 19  # the latest answers stay
    # Drafting from an answer makes it recently used: it outlives newer ones.
    first = kept[0]
    SuffixSource(corpus, own=False).draft([0] * 4 + list(range(1000 * first, 1000 * first + 4)), 4)
    memory.remember("k", [0] * 20, list(range(99000, 99020)))
    assert first in corpus.texts and kept[1] not in corpus.texts
    # Dropped texts' index entries are swept: a long run keeps the index bounded too.
    for i in range(2000):
        memory.remember("k", [0] * 20, list(range(5000 + i, 5020 + i)))
    assert sum(len(v) for v in corpus._index.values()) <= 3 * (memory.size + 4096)


def test_scopes_never_see_each_other_s_answers():
    memory = SuffixMemory()
    memory.remember("alice", [1, 2, 3], [10, 11, 12, 13, 14, 15])
    bob = SuffixSource(memory.corpus("bob"), own=False)
    assert bob.draft([1, 2, 3, 10, 11], 4).tokens == []
    alice = SuffixSource(memory.corpus("alice"), own=False)
    found = alice.draft([1, 2, 3, 10, 11], 4)
    assert found.tokens == [12, 13, 14, 15] and alice.remembered(found)


def test_the_memory_scope_option_is_checked():
    assert SpeculationOptions(method="suffix", memory_scope="team-a").validate().memory_scope == "team-a"
    with pytest.raises(edgeinfer.InvalidOptionError, match="memory_scope"):
        SpeculationOptions(method="suffix", memory_scope=3).validate()  # type: ignore[arg-type]
    with pytest.raises(edgeinfer.InvalidOptionError, match="at most 256"):
        SpeculationOptions(method="suffix", memory_scope="x" * 257).validate()
    assert SpeculationOptions.parse("suffix").method == "suffix"


def test_a_point_mass_draft_under_the_rejection_rule():
    """A tree draft's q is a point mass on x: the rule keeps x with probability min(1, p(x)/1) = p(x),
    else draws from norm(max(0, p − q)) = p without x. That is what sample-and-match does (draw from p,
    keep x if the draw is x): both give p. 8,000 draws each; 6 cells, chi-square at 1e-3 (power ~1
    against keeping x always, or resampling from p including x: effect sizes w >= 0.3)."""
    from scipy import stats

    rng = np.random.default_rng(7)
    p = TokenDistribution(np.arange(6), np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))
    q = TokenDistribution(np.array([1]), np.array([1.0]))  # the draft: token 1, certainly
    n = 8_000
    rule = collections.Counter()
    kept = 0
    for _ in range(n):
        ok, tok = verify_sampled_draft(p, q, 1, rng)
        kept += ok
        rule[tok] += 1
    assert abs(kept / n - 0.25) < 4 * (0.25 * 0.75 / n) ** 0.5
    match = collections.Counter(rng.choice(p.ids, size=n, p=p.probs).tolist())  # sample-and-match's token
    for counts in (rule, match):
        result = stats.chisquare([counts[i] for i in range(6)], [n * x for x in p.probs])
        assert result.pvalue > 1e-3, (counts, result)


# -- on a real model -----------------------------------------------------------------------------------
CITIES = ["Paris", "Berlin", "Madrid", "Rome", "Vienna", "Prague", "Lisbon", "Oslo"]


def tool_call(city: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": "Reply with only a JSON object calling the tool get_weather with "
             f"fields city, unit (celsius), days (3) and include_hourly (false), for {city}."}]


def greedy(n: int, method: str = "off", scope: str = "") -> GenerateOptions:
    return GenerateOptions(max_tokens=n, sampling=SamplingOptions(temperature=0.0),
                           speculation=SpeculationOptions(method=method, memory_scope=scope))


@pytest.fixture(scope="module")
def suffix_batch(f16_path):  # noqa: F811
    with BatchEngine.load(f16_path, batch=BatchOptions(parallel=4, calibrate_when_idle=False), n_ctx=8192,
                          flash_attn=False) as engine:
        yield engine


@pytest.mark.slow
def test_suffix_greedy_is_plain_alone_and_four_at_a_time(suffix_batch, f16_single):  # noqa: F811
    prompts = [suffix_batch.chat_tokens(tool_call(c)) for c in CITIES]
    plain = [suffix_batch.submit(p, greedy(40)).result().tokens for p in prompts]
    remembered = []
    for p, ref in zip(prompts[:4], plain):  # one at a time: each answer is remembered for the next
        done = suffix_batch.submit(p, greedy(40, "suffix", "one")).result()
        assert done.tokens == ref
        remembered.append(done.stats.speculation.remembered)
    assert remembered[0] == 0 and sum(remembered[1:]) > 0, remembered

    results: dict[int, edgeinfer.DoneEvent] = {}
    start = threading.Barrier(4)

    def client(i: int, method: str) -> None:
        start.wait()
        results[i] = suffix_batch.submit(prompts[i], greedy(40, method, "one")).result()

    for method in ("suffix", "auto"):  # auto drafts from the same memory beside lookup
        threads = [threading.Thread(target=client, args=(i, method)) for i in range(4, 8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i in range(4, 8):
            assert_same_or_near_tie(f16_single, prompts[i], plain[i], results[i].tokens)
        assert sum(results[i].stats.speculation.remembered for i in range(4, 8)) > 0, method
    assert suffix_batch.metrics().active == 0


@pytest.mark.slow
def test_the_rejection_rule_keeps_the_distribution_with_remembered_drafts(suffix_batch, f16_single):  # noqa: F811
    """Fixed 3-token tree drafts at T = 0.7, four requests sharing each step, the memory warm from
    the start (each finished request is remembered too): the first three tokens are distributed as
    the target's own sampling (chi-square against llama.cpp's chain on the target's logits)."""
    from sequence_chi_square import sample_sequences, sequence_chi_square

    prompt = f16_single.chat_tokens([{"role": "user", "content": "Name a colour."}])
    sampling = SamplingOptions(temperature=0.7)
    spec = SpeculationOptions(method="suffix", adaptive=False, draft_max=3, memory_scope="chi")
    for _ in range(2):  # warm: the greedy answer, twice (its first tokens then draft at every run)
        suffix_batch.submit(prompt, GenerateOptions(max_tokens=8, sampling=SamplingOptions(temperature=0.0),
                                                    speculation=spec)).result()
    # n = 100 on this prompt, as tests/test_core.py's rejection-rule test: its three cells expected
    # >= 5 times; power 0.67 at alpha 1e-3 against the tokens drawn at twice the temperature (w = 0.42)
    # and ~1 against a rule that kept every remembered draft (the greedy answer's first three tokens
    # would then come 100 times in 100, where the target gives them ~40 %).
    n, length = 100, 3
    observed, drafted, accepted = sample_sequences(suffix_batch, prompt, sampling, spec, n, length, group=4)
    assert drafted >= n and 0 < accepted < drafted, (drafted, accepted)
    result, table = sequence_chi_square(f16_single, prompt, sampling, observed, n, length)
    assert result.pvalue > 1e-3, (result, table)


@pytest.mark.slow
def test_the_server_keeps_one_memory_per_api_key(f16_path):  # noqa: F811
    """Two clients with different keys ask the same: the second's drafts never come from the
    first's answers; the first's next request does draft from them; a keyless client is a scope too."""
    from starlette.testclient import TestClient

    from server.app import create_app

    engine = BatchEngine.load(f16_path, batch=BatchOptions(parallel=1, calibrate_when_idle=False), n_ctx=2048,
                              flash_attn=False)
    try:
        body = {"messages": tool_call("Paris"), "max_tokens": 40, "temperature": 0, "speculation": "suffix"}
        with TestClient(create_app(engine), base_url="http://127.0.0.1") as http:
            def ask(key: str | None) -> dict:
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                r = http.post("/v1/chat/completions", json=body, headers=headers)
                assert r.status_code == 200, r.text
                return r.json()

            first = ask("alice-key")
            stats = [first["edgeinfer"]["speculation"]]
            for key in ("bob-key", None, "alice-key"):
                reply = ask(key)
                assert reply["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
                stats.append(reply["edgeinfer"]["speculation"])
        assert [s.get("remembered", 0) > 0 for s in stats] == [False, False, False, True], stats
    finally:
        engine.close()
