"""The speculation cost model: depth, a size prior learned online, and the bench's fit."""

from __future__ import annotations

import pytest

from edgeinfer import SpeculationOptions
from edgeinfer.engine.speculation import CostModel, LengthPolicy, fit_costs

# A 1.5B Q4_K_M on this 2-core CPU (llama-bench, depth 0): seconds per b-token batch.
SHAPE = {1: 1.0, 2: 1.55, 3: 2.1, 4: 2.6, 5: 3.3, 8: 5.5, 9: 6.0, 16: 7.3, 17: 7.9, 32: 15.0, 33: 15.6}
T1, ALPHA = 0.052, 2.4e-4


def truth(b: int, d: int) -> float:
    """An independent statement of the model the cost model should recover."""
    lo = max(s for s in SHAPE if s <= b)
    hi = min(s for s in SHAPE if s >= b)
    shape = SHAPE[lo] if lo == hi else SHAPE[lo] + (SHAPE[hi] - SHAPE[lo]) * (b - lo) / (hi - lo)
    return T1 * (shape + ALPHA * b * d)


def test_ratio_follows_depth():
    costs = CostModel({b: T1 * r for b, r in SHAPE.items()}, attention=ALPHA)
    assert costs.ratio(16, depth=0) == pytest.approx(7.3)
    # After 800 tokens attention makes a 16-row batch dearer relative to a 1-row step.
    assert costs.ratio(16, depth=800) == pytest.approx((7.3 + ALPHA * 16 * 800) / (1 + ALPHA * 800))
    assert costs.at(800).ratio(16) == costs.ratio(16, depth=800)
    assert costs.time(1, depth=800) == pytest.approx(T1 * (1 + ALPHA * 800))


def test_times_measured_at_a_depth_mean_the_same_curve():
    at_800 = {b: truth(b, 800) for b in SHAPE}
    costs = CostModel(at_800, attention=ALPHA, depth=800)
    for b in (1, 4, 16, 33):
        assert costs.time(b, depth=0) == pytest.approx(truth(b, 0))
        assert costs.time(b, depth=2000) == pytest.approx(truth(b, 2000))


def test_fit_recovers_shape_and_attention_from_two_depths():
    seconds = {d: {b: truth(b, d) for b in SHAPE} for d in (64, 1024)}
    costs = fit_costs(seconds)
    assert costs.attention == pytest.approx(ALPHA, rel=1e-6)
    assert costs.t1 == pytest.approx(T1, rel=1e-6)
    for b in SHAPE:
        assert costs.ratio(b, depth=500) == pytest.approx(truth(b, 500) / truth(1, 500), rel=1e-6)
    again = CostModel.from_dict(costs.to_dict())
    assert again.ratio(9, depth=700) == pytest.approx(costs.ratio(9, depth=700))


def test_prior_learns_the_curve_from_the_steps_taken():
    """Start from the size prior; observe the true times of the sizes a policy would use (plain
    steps and 4-row verifications); the sizes observed converge, the others move with them."""
    prior = CostModel.prior(1_117_320_768, n_layer=28, n_embd=1536)
    prior.attention = ALPHA  # the depth part is not what this test is about
    wrong = abs(prior.ratio(4, 800) - truth(4, 800) / truth(1, 800))
    for _ in range(30):
        prior.observe(1, truth(1, 800), depth=800)
        prior.observe(4, truth(4, 800), depth=800)
    assert prior.ratio(4, 800) == pytest.approx(truth(4, 800) / truth(1, 800), rel=0.02)
    assert abs(prior.ratio(4, 800) - truth(4, 800) / truth(1, 800)) < wrong / 10
    assert prior.time(1, 800) == pytest.approx(truth(1, 800), rel=0.02)
    # The neighbour never verified moved in the same direction as size 4 did.
    fresh = CostModel.prior(1_117_320_768, n_layer=28, n_embd=1536)
    assert (prior.shape(3) - fresh.shape(3)) * (prior.shape(4) - fresh.shape(4)) > 0


def test_prior_lets_a_reliable_drafter_draft_after_one_plain_step():
    """The first step of a request is plain (it measures t1 under today's load, whatever the
    prior or another session said); from the second on, a reliable drafter drafts."""
    costs = CostModel.prior(1_117_320_768, n_layer=28, n_embd=1536).at(800)
    policy = LengthPolicy(costs, SpeculationOptions(method="lookup"))
    policy.in_run = True
    assert policy.choose(16) == (0, 1.0)
    policy.observe(0, 0, verify_s=3 * costs.time(1))  # a machine three times slower than the prior
    assert costs.time(1) == pytest.approx(3 * CostModel.prior(1_117_320_768, 28, 1536).time(1, 800))
    k, rate = policy.choose(16)
    assert 2 <= k <= 8 and rate > 1.2


def test_a_slower_machine_is_not_mistaken_for_a_dearer_curve():
    """Verifications that keep taking longer than predicted (load came) make the policy re-measure
    t1 with a plain step, after which the curve's shape is what it was: it keeps drafting."""
    costs = CostModel({b: truth(b, 0) for b in SHAPE}, attention=ALPHA).at(800)
    policy = LengthPolicy(costs, SpeculationOptions(method="lookup"))
    policy.observe(0, 0, verify_s=truth(1, 800))
    policy.in_run = True
    k, _ = policy.choose(16)
    assert k > 0
    for _ in range(2):  # the machine became twice as slow
        policy.observe(k, k, verify_s=2 * truth(k + 1, 800))
    assert costs.t1_stale
    drafted = 0  # a plain step comes within a few steps (not at once: noise makes surprises common)
    while policy.choose(16)[0] != 0:
        policy.observe(k, k, verify_s=2 * truth(k + 1, 800))
        drafted += 1
        assert drafted <= 8
    policy.observe(0, 0, verify_s=2 * truth(1, 800))
    assert costs.ratio(k + 1) == pytest.approx(truth(k + 1, 800) / truth(1, 800), rel=0.2)
    assert policy.choose(16)[0] > 0


def test_persisted_form_keeps_only_measurements():
    prior = CostModel.prior(500_000_000, n_layer=24, n_embd=896)
    prior.observe(1, 0.03)
    prior.observe(4, 0.08)
    kept = prior.to_dict()
    assert set(kept) == {"1", "4", "attention"}


def test_break_even_draft_cost_matches_the_policy_gate():
    from edgeinfer.engine.speculation import break_even_draft_cost

    costs = CostModel({b: truth(b, 0) for b in SHAPE}, attention=ALPHA).at(800)
    policy = LengthPolicy(costs, SpeculationOptions(method="draft"))
    for a in (0.7, 0.9):
        c = break_even_draft_cost(costs, a, margin=policy.margin)
        assert policy.can_pay(c * 0.95, acceptance=a)
        assert not policy.can_pay(c * 1.05, acceptance=a)
    # The 0.5B draft of the 1.5B costs 0.45 steps a token: it cannot pay at 90 %.
    assert break_even_draft_cost(costs, 0.9) < 0.45


def test_busy_machine_is_recognised():
    from edgeinfer.bench import MachineLoad

    assert not MachineLoad(before=0.1, after=2.1, cpus=2, threads=2).busy
    assert MachineLoad(before=1.5, after=3.0, cpus=2, threads=2).busy  # another process held a core
    assert not MachineLoad(before=0.9, after=1.9, cpus=2, threads=1).busy  # one core was left free for it
    assert MachineLoad(before=12.0, after=14.0, cpus=2, threads=1).busy


def test_the_prefill_knee_is_the_smallest_chunk_near_the_cheapest_per_row():
    """Per-row cost falls to 128 rows and rises after (as llama-bench shows for the 1.5B on this
    CPU): prompts enter 128 rows a step. A curve not measured that far leaves the whole ubatch."""
    seconds = {1: 0.05, 4: 0.19, 16: 0.32, 32: 0.78, 64: 0.48, 128: 0.82, 256: 2.4, 512: 5.2}
    assert CostModel(seconds).prefill_knee(512) == 128
    assert CostModel(seconds).prefill_knee(100) == 64  # a smaller ubatch: the best it holds
    flat = {b: 0.01 * max(1.0, b / 64) for b in (1, 8, 64, 128, 256, 512)}
    assert CostModel(flat).prefill_knee(512) == 64
    assert CostModel({1: 0.01, 2: 0.012, 33: 0.2}).prefill_knee(512) == 512  # not measured that far
    assert CostModel.prior(1_117_320_768, n_layer=28, n_embd=1536).prefill_knee(512) == 512


def test_adopting_a_measured_curve_keeps_it_non_decreasing():
    costs = CostModel.prior(1_117_320_768, n_layer=28, n_embd=1536)
    costs.adopt({1: 0.05, 2: 0.06, 4: 0.055, 8: 0.1})  # 4 rows timed faster than 2: noise, not a fact
    assert [costs.shape(b) for b in (1, 2, 4, 8)] == sorted(costs.shape(b) for b in (1, 2, 4, 8))
    assert costs.shape(4) == pytest.approx(costs.shape(2))
    assert costs.is_measured(8) and not costs.is_prior
    assert costs.shape(3) == pytest.approx(costs.shape(2))  # the prior's guess for 3 is gone: interpolated
    assert costs.time(1) == pytest.approx(0.05)
