"""The pieces of speculative decoding that are pure logic: the n-gram index, the cost model and
the draft-length policy (no model needed, so these run in the fast tier)."""

from __future__ import annotations

import pytest

from edgeinfer import SpeculationOptions
from edgeinfer.engine.speculation import CostModel, LengthPolicy, NgramIndex
from edgeinfer.engine.speculation.policy import CALIBRATION_SIZES

# A cost curve shaped like F16 on this kind of machine: the first extra token costs half a step,
# every further one about a tenth.
F16_LIKE = {1: 0.030, 2: 0.046, 3: 0.047, 4: 0.054, 5: 0.056, 8: 0.070, 9: 0.062, 16: 0.086, 17: 0.096,
            32: 0.144, 33: 0.162}


def test_ngram_index_prefers_longest_then_most_recent():
    idx = NgramIndex(n_min=2, n_max=3)
    idx.extend([1, 2, 3, 9, 1, 2, 4, 7, 1, 2])
    assert idx.lookup(5) == ([4, 7, 1, 2], 2, 2)  # most recent "1 2" continues with 4
    idx.extend([3])
    assert idx.lookup(3) == ([9, 1, 2], 3, 3)  # "1 2 3" occurred once, followed by 9


def test_cost_model_interpolates_between_measured_sizes_and_extrapolates_beyond():
    costs = CostModel({1: 0.01, 3: 0.02, 5: 0.04})
    assert costs.ratio(1) == 1.0
    assert costs.ratio(2) == pytest.approx(1.5)
    assert costs.ratio(4) == pytest.approx(3.0)
    assert costs.ratio(7) == pytest.approx(6.0)  # the slope of the last two sizes continues
    assert CostModel.from_dict(costs.to_dict()).ratio(4) == pytest.approx(3.0)


def test_a_slower_machine_scales_the_whole_curve_not_one_point():
    # Regression: only the sizes actually observed used to follow the machine, so once plain
    # steps ran 1.5x slower, never-seen batch sizes looked 1.5x cheaper than they were.
    costs = CostModel(F16_LIKE)
    shape = {b: costs.ratio(b) for b in range(1, 34)}
    for _ in range(100):
        costs.observe(1, 0.045)
    assert costs.time(1) == pytest.approx(0.045, rel=0.01)
    for b in range(1, 34):
        assert costs.ratio(b) == pytest.approx(shape[b])
    assert costs.time(6) == pytest.approx(0.045 * shape[6], rel=0.01)


def test_verifications_teach_the_cost_of_their_size_and_outliers_are_damped():
    costs = CostModel(F16_LIKE)
    before = costs.ratio(6)
    for _ in range(60):
        costs.observe(6, 0.030 * 2.4)
    assert costs.ratio(6) == pytest.approx(2.4, rel=0.01)
    assert costs.ratio(5) == pytest.approx(0.056 / 0.030)  # measured neighbours are untouched
    assert before != pytest.approx(2.4, rel=0.01)
    costs.observe(6, 10.0)  # a step preempted by another process
    assert costs.ratio(6) < 2.4 * 1.5



def test_a_calibrated_size_is_not_moved_by_a_shared_machines_noisy_steps():
    """Steps on a shared machine vary ±10 % and a preempted one takes 1.5–3×: a size the
    calibration measured must not follow them (the choices between near-tie lengths would flip run
    to run), while a size never measured still learns from its first steps."""
    costs = CostModel(F16_LIKE)
    before = costs.ratio(16)
    for factor in [2.5, 1.0, 0.9, 1.1, 2.0, 1.0, 1.05, 3.0, 0.95, 1.0] * 3:  # a spike now and then
        costs.observe(16, F16_LIKE[16] * factor)
    assert costs.ratio(16) == pytest.approx(before, rel=0.05)
    guessed = CostModel.prior(10**8, 4, 256)  # nothing measured: a guess, learned at once
    guessed.observe(1, 0.01)
    old = guessed.ratio(16)
    guessed.observe(16, 0.01 * old * 1.4)
    assert guessed.ratio(16) > old * 1.05

def policy(curve: dict[int, float], **spec) -> LengthPolicy:
    p = LengthPolicy(CostModel(curve), SpeculationOptions(method="lookup", **spec))
    if p.opts.adaptive:
        assert p.choose(32)[0] == 0  # a request's first step is plain: it measures t1 under today's load
        p.observe(0, 0, curve[1], 0.0)
    return p


def test_policy_drafts_long_inside_a_copied_span_and_stops_after_misses():
    p = policy(F16_LIKE)
    for _ in range(10):  # every draft accepted: we are copying
        p.observe(16, 16, 0.096, 0.0)
    k, rate = p.choose(32)
    assert k >= 12 and rate > 2.0
    for _ in range(10):  # every first draft token rejected
        p.observe(4, 0, 0.054, 0.0)
    assert p.choose(32)[0] == 0


def test_policy_never_drafts_when_verifying_costs_more_than_acceptance_buys():
    # Verifying even one extra token costs three plain steps: nothing can pay for that.
    p = policy({1: 0.01, 2: 0.03, 3: 0.045, 9: 0.12, 33: 0.4})
    for _ in range(10):
        p.observe(2, 2, 0.045, 0.0)
    chosen = [p.choose(32)[0] for _ in range(5)]
    assert chosen == [0] * 5


def test_policy_respects_draft_max_and_fixed_length_mode():
    p = policy(F16_LIKE, draft_max=4)
    for _ in range(10):
        p.observe(4, 4, 0.054, 0.0)
    assert p.choose(32)[0] == 4
    fixed = policy(F16_LIKE, adaptive=False, draft_max=8)
    assert fixed.choose(32)[0] == 8
    assert fixed.choose(3)[0] == 3


def test_ngram_index_continues_the_place_whose_context_agrees_longest():
    # "5 6 7 1 2" was followed by 3 long ago; "1 2" was followed by 8 more recently. The text now
    # ends in "5 6 7 1 2": the copy is of the first place, so the draft continues with 3.
    idx = NgramIndex(n_min=2, n_max=3)
    idx.extend([5, 6, 7, 1, 2, 3, 4, 9, 1, 2, 8, 9, 5, 6, 7, 1, 2])
    assert idx.lookup(2) == ([3, 4], 3, 5)  # "7 1 2" → 3, found via the 3-gram; "5 6 7 1 2" agrees
    idx2 = NgramIndex(n_min=2, n_max=2)
    idx2.extend([5, 6, 7, 1, 2, 3, 4, 9, 1, 2, 8, 9, 5, 6, 7, 1, 2])
    assert idx2.lookup(2) == ([3, 4], 2, 5)  # same answer with bigrams only, by agreement length
    idx2.extend([0, 0, 1, 2])
    assert idx2.lookup(2) == ([0, 0], 2, 2)  # no longer context anywhere: the most recent place


def test_a_draft_model_too_slow_to_ever_pay_is_recognized():
    p = policy(F16_LIKE)
    assert p.can_pay(0.05)  # a small sibling: a tenth of the target's cost per token
    assert not p.can_pay(0.7)  # a quantized copy of a small model: its time goes to overheads
    assert policy(F16_LIKE, adaptive=False).can_pay(0.7)  # fixed k: the user asked for it


def test_explorations_back_off_and_draft_the_cheapest_short_length():
    # Q8_0-like: a 4-token batch costs less than a 3-token one (tiles of 4 rows).
    q8_like = {1: 0.030, 2: 0.060, 3: 0.075, 4: 0.059, 5: 0.079, 8: 0.086, 9: 0.101, 16: 0.138, 17: 0.160,
               32: 0.229, 33: 0.233}
    p = policy(q8_like)
    for _ in range(20):
        p.observe(3, 0, 0.059, 0.0)
    chosen = [p.choose(32)[0] for _ in range(8)]
    assert chosen[:7] == [0] * 7 and chosen[7] == 3  # the 8th idle step explores, with b = 4
    p.observe(3, 0, 0.059, 0.0)  # the exploration failed: wait twice as long
    assert [p.choose(32)[0] for _ in range(16)] == [0] * 15 + [3]
    p.observe(3, 0, 0.059, 0.0)  # failed again: 32
    assert [p.choose(32)[0] for _ in range(32)] == [0] * 31 + [3]


def test_the_policy_and_prompt_lookup_are_pure_python():
    """The policy modules import nothing that reaches llama.cpp, the engine or the store: they run
    the same under the replay benchmark as in a request."""
    import ast
    from pathlib import Path

    import edgeinfer.engine.speculation.lookup as lookup
    import edgeinfer.engine.speculation.policy as policy

    allowed = {"__future__", "dataclasses", "collections.abc", "typing", "heapq", "math", "..core.options", ".policy"}
    for module in (policy, lookup):
        imported = set()
        for node in ast.walk(ast.parse(Path(module.__file__).read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                imported.add("." * node.level + (node.module or ""))
        assert imported <= allowed, (module.__name__, imported - allowed)


# Qwen2.5-Coder-1.5B Q4_K_M after a 635-token prompt on this 2-core VM (seconds by rows).
QWEN_1_5B = {b: b / tok_s for b, tok_s in {1: 11.10, 2: 16.17, 3: 18.23, 4: 27.49, 5: 23.57, 8: 30.05,
                                            16: 45.56, 17: 41.01}.items()}


def test_a_match_is_full_once_the_text_copies_its_place_again_after_an_insertion():
    idx = NgramIndex()
    source = list(range(10, 40))
    idx.extend(source + [10, 11, 12, 13, 14, 15, 90, 91, 92, 16, 17])  # a copy with 90 91 92 inserted
    short = idx.lookup(4)
    assert short == ([18, 19, 20, 21], 2, 2) and not short.full  # "16 17" only: 92 is not before 16 in the source
    idx.extend([18, 19])
    resumed = idx.lookup(4)
    assert resumed == ([20, 21, 22, 23], 4, 4) and resumed.full


def test_rejected_short_matches_in_new_text_do_not_stop_drafting_where_the_copy_resumes():
    """Writing text the source does not have (a docstring the edit adds), lookup finds only short
    matches and each is rejected. Where the text copies the source again (a full match) the policy
    drafts at once: a full match is priced by the estimates inside copies, not by the short ones."""
    p = policy(QWEN_1_5B)
    p.full_match = True
    assert p.choose(16)[0] > 0  # the prior is enough to draft a full match
    p.full_match = False
    for _ in range(20):
        p.observe(2, 0, QWEN_1_5B[3], 0.0)
    assert p.choose(16)[0] == 0  # short matches: not any more
    p.full_match = True
    k, rate = p.choose(16)
    assert k >= 2 and rate > 1.05


def test_the_calibration_prices_every_small_draft_as_measured():
    """A size the calibration skips is interpolated and, if that makes it look dear, never drafted,
    so never learned: on the slow AVX2 machine (curve at depth 638) 7 rows cost 4.08 steps, where
    interpolating between 5 and 8 rows says 5.3 (edit-few replayed 1.46x against 1.57x)."""
    measured = {1: 1.0, 2: 1.63, 3: 2.04, 4: 2.60, 5: 3.48, 6: 4.06, 7: 4.08, 8: 6.26, 9: 6.95, 16: 8.80, 17: 11.81,
                32: 15.28, 33: 17.74}
    calibrated = CostModel({b: measured[b] for b in CALIBRATION_SIZES})
    for b in range(1, 10):
        assert calibrated.ratio(b, depth=0) == pytest.approx(measured[b]), b


def test_the_replay_benchmark_steps_the_engines_own_lookup_path():
    """benchmarks/replay_speculation.py replays RequestSpeculation the way the scheduler core steps
    one request: on a copy it drafts long and gains; where nothing repeats it never drafts."""
    from benchmarks.replay_speculation import parse_curve, replay

    curve = parse_curve("1:11.10,2:16.17,3:18.23,4:27.49,5:23.57,8:30.05,16:45.56,17:41.01")
    prompt = list(range(100, 400))
    copy = replay(prompt, prompt[50:250], curve, lambda: CostModel(dict(curve)))
    assert copy.speedup > 2.0 and copy.accepted == copy.drafted > 150
    new = replay(prompt, list(range(1000, 1200)), curve, lambda: CostModel(dict(curve)))
    assert new.drafted == 0 and new.speedup == pytest.approx(1.0) and new.no_match == new.steps
    # --fixed: a fixed length drafts exactly that wherever lookup has it (the first step is plain,
    # the end of the text leaves less room), and is judged under the same curve
    five = replay(prompt, prompt[50:250], curve, lambda: CostModel(dict(curve)), fixed=5)
    assert set(five.lengths) <= {0, 1, 2, 3, 4, 5} and five.lengths[5] >= 30
    assert five.accepted == five.drafted and 1.0 < five.speedup < copy.speedup


def test_a_position_not_tried_lately_is_priced_on_fresh_evidence():
    """Inside a long copy the policy drafted 3 tokens a step: positions 3.. were tried once and
    decayed back to the prior (0.9) while positions 0-2 climbed, so a long draft was priced stale and
    never tried (RESULTS.md, edit-add). They now fall back on the per-token acceptance of every
    position judged lately (at most FALLBACK_CAP); text that rejects often keeps the old pricing."""
    from edgeinfer.engine.speculation.policy import FALLBACK_CAP, AcceptanceModel

    copying = AcceptanceModel(prior=0.9)
    copying.update(8, 8)
    for _ in range(40):
        copying.update(3, 3)
    assert copying.prob(0) > 0.97
    assert copying.prob(6) > 0.97 and copying.prob(20) == pytest.approx(FALLBACK_CAP, abs=1e-3)  # was 0.90
    rejecting = AcceptanceModel(prior=0.7)
    for _ in range(20):
        rejecting.update(4, 1)
    assert rejecting.pooled() == 0.7  # never below the prior: each position priced as before
    w = rejecting.prior_weight
    assert rejecting.prob(1) == pytest.approx((rejecting.hits[1] + 0.7 * w) / (rejecting.tries[1] + w))
    assert rejecting.prob(1) < 0.3


# This VM's flatter curve (the 1.5B at depth ~640, RESULTS.md "The policy replayed on the 1.5B"):
# 32 rows cost ~5 one-token steps, so a long copy pays drafted 31 at a time.
FLAT = {b: b / tok_s for b, tok_s in {1: 16.2, 2: 25.9, 3: 34.7, 4: 43.2, 5: 47.6, 8: 61.7, 9: 63.0, 16: 83.6,
                                      17: 80.0, 32: 101.6, 33: 98.0}.items()}


def copying(curve: dict[int, float]) -> LengthPolicy:
    p = LengthPolicy(CostModel(curve), SpeculationOptions(method="lookup"), copies=True)
    assert p.choose(32)[0] == 0
    p.observe(0, 0, curve[1], 0.0)
    return p


def test_a_copy_broken_deep_in_is_drafted_long_again_once_it_resumes():
    """A copy of a file with a name renamed every ~50 tokens: a 31-token draft is rejected at its
    14th token, 55 tokens into the copy. That says the copy broke after 55 tokens, not that drafts
    break after 14: once the next copy runs (a resumed full match of 6, all accepted), it is drafted
    31 long at once instead of ramping up from ~14 again (edit-few, RESULTS.md)."""
    p = copying(FLAT)
    for k, ok in ((3, 3), (11, 11), (27, 27), (31, 14)):
        p.observe(k, ok, FLAT.get(k + 1, FLAT[33]), 0.0)
    p.full_match = True
    p.observe(6, 6, FLAT[8] * 0.9, 0.0)
    assert p.in_run and p.origin() == 6
    assert p.choose(31)[0] >= 28


def test_copies_that_break_at_the_same_depth_are_drafted_short_of_it():
    """Lines copied with a docstring inserted every ~20 tokens: runs end 20 tokens in, so a run
    that has accepted 6 drafts about what is left of it, not 31."""
    p = copying(FLAT)
    for _ in range(6):
        p.full_match = True
        p.observe(6, 6, FLAT[8] * 0.9, 0.0)
        k = p.choose(31)[0]
        p.observe(k, min(k, 14), FLAT.get(k + 1, FLAT[33]), 0.0)
    p.full_match = True
    p.observe(6, 6, FLAT[8] * 0.9, 0.0)
    assert 8 <= p.choose(31)[0] <= 16


def test_a_draft_models_positions_count_within_each_draft():
    """A draft model's or a head's i-th token is judged as the i-th of its draft, run or not."""
    p = LengthPolicy(CostModel(FLAT), SpeculationOptions(method="draft"))
    p.observe(0, 0, FLAT[1], 0.0)
    p.observe(4, 4, FLAT[5], 0.0)
    assert p.in_run and p.origin() == 0
    assert copying(FLAT).origin() == 0


def test_a_full_match_resuming_a_copy_is_priced_by_how_far_copies_went():
    """After a renamed name the text copies its source again (a full match, 8 tokens agree). Copies
    in this text went on for 60 tokens and more, so the draft is long at once: priced by the
    estimates inside copies at the copy's length, not by fresh prior-bound ones (which drafted 3,
    then 8, 15 before 31 after every rename)."""
    p = copying(FLAT)
    for copied, k, ok in ((6, 7, 7), (14, 15, 15), (30, 31, 31), (62, 31, 27)):
        p.full_match, p.copied = True, copied
        p.observe(k, ok, FLAT.get(k + 1, FLAT[33]), 0.0)
    p.full_match = False  # the renamed name: a short match, rejected
    p.observe(3, 0, FLAT[4], 0.0)
    p.full_match, p.copied = True, 8
    assert not p.in_run and p.origin() == 8
    assert p.choose(31)[0] >= 24


def test_a_draft_model_whose_cost_is_only_estimated_explores_at_once():
    """A draft model's first cost is a probe's estimate (and can read cheap): where the plan
    declines it, its first idle step drafts a little so the cost gate decides on a measured cost;
    once the runtime's cost was measured, later requests wait like any other drafter."""
    from edgeinfer.engine.speculation import ModelDrafter
    from edgeinfer.engine.speculation.draft_model import DraftJob

    class Runtime:  # (weakly referenced: the measured cost is kept per draft runtime)
        pass

    class Seq:
        runtime = Runtime()
        cached: list[int] = []  # nothing to probe after: the estimate is a guess
        can_drop_suffix = True

    context = type("Context", (), {"runtime": Seq.runtime, "seqs": {0: Seq()}})()

    def first_idle_steps(drafter: ModelDrafter) -> list[int]:
        drafter.start(Seq(), 0)
        gains = drafter.policy.gains(4)
        return [drafter.policy.settle(0, 4, gains, drafter.draft_cost()) for _ in range(3)]

    fresh = ModelDrafter(context, LengthPolicy(CostModel(F16_LIKE), SpeculationOptions(method="draft")), 0.0)
    steps = first_idle_steps(fresh)
    assert fresh.enabled and steps[0] >= 1 and steps[1:] == [0, 0], steps
    job = DraftJob(0, [1, 2, 3], steps[0])
    job.tokens, job.seconds = [7] * steps[0], 0.001 * steps[0]  # what drafting really cost: a thirtieth
    fresh.drafted(job)
    later = ModelDrafter(context, LengthPolicy(CostModel(F16_LIKE), SpeculationOptions(method="draft")), 0.0)
    assert first_idle_steps(later) == [0, 0, 0]


def test_a_draft_model_that_is_on_but_never_worth_drafting_says_so():
    """The cost gate judges a draft model at high acceptance; the plan at the acceptance expected.
    Between the two the draft stays on and drafts nothing: the stats say why (a clean-clone run saw
    the 0.5B end with drafted=0 and no note, its cost measured cheap by an earlier request)."""
    from edgeinfer.engine.core.events import SpeculationStats
    from edgeinfer.engine.speculation import RequestSpeculation

    class Runtime:
        pass

    class Seq:
        runtime = Runtime()
        cached: list[int] = []
        can_drop_suffix = True

    context = type("Context", (), {"runtime": Seq.runtime, "seqs": {0: Seq()}, "method": "draft"})()
    stats = SpeculationStats(method="draft")
    spec = RequestSpeculation(SpeculationOptions(method="draft"), CostModel(F16_LIKE), stats, context, None)
    spec.start(Seq(), 0)
    assert spec.model is not None and spec.model.enabled and stats.note == ""
    for _ in range(3):
        spec.observe(None, 0, 0, 0.03, 0.03)
    assert "off" in stats.note and "target steps" in stats.note and stats.plain_steps == 3, stats
