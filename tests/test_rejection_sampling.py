"""Speculative sampling's rejection rule, model-free: one speculative position is distributed as the
target's p whatever the draft's q (chi-square on many draws), and the numpy transforms that give p and
q are llama.cpp's own sampler chain (checked against the chain applied to the same logits)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from edgeinfer.engine.core.options import SamplingOptions
from edgeinfer.engine.core.sampler import TokenDistribution, sampling_distribution, verify_sampled_draft
from edgeinfer.llama_backend import backend


def _dist(probs: dict[int, float]) -> TokenDistribution:
    ids = np.array(sorted(probs), dtype=np.int64)
    p = np.array([probs[i] for i in sorted(probs)], dtype=np.float64)
    return TokenDistribution(ids, p / p.sum())


def _speculative_token(p: TokenDistribution, q: TokenDistribution, rng: np.random.Generator) -> tuple[int, bool]:
    drafted = q.draw(rng)
    kept, tok = verify_sampled_draft(p, q, drafted, rng)
    return tok, kept


CASES = {
    # q covers tokens p lacks (5, 6) and lacks tokens p has (3, 4)
    "disjoint parts": ({0: 0.4, 1: 0.25, 2: 0.15, 3: 0.12, 4: 0.08}, {0: 0.1, 1: 0.5, 2: 0.2, 5: 0.15, 6: 0.05}),
    "close": ({0: 0.5, 1: 0.3, 2: 0.2}, {0: 0.45, 1: 0.35, 2: 0.2}),
    "one-hot draft": ({0: 0.3, 1: 0.6, 2: 0.1}, {1: 1.0}),
    "no overlap": ({0: 0.7, 1: 0.3}, {2: 0.5, 3: 0.5}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_speculative_position_is_distributed_as_p(case: str) -> None:
    from scipy import stats  # (here: scipy takes a second to import, for every worker's collection)

    p, q = (_dist(d) for d in CASES[case])
    rng = np.random.default_rng(1234)
    n = 5_000
    counts: dict[int, int] = {}
    kept = 0
    for _ in range(n):
        tok, k = _speculative_token(p, q, rng)
        counts[tok] = counts.get(tok, 0) + 1
        kept += k
    assert set(counts) <= set(p.ids.tolist()), "a token p gives probability 0 came out"
    observed = np.array([counts.get(int(t), 0) for t in p.ids])
    result = stats.chisquare(observed, p.probs * n)
    assert result.pvalue > 1e-3, (case, observed, p.probs * n)
    # The acceptance rate is Σ min(p, q) (the overlap), which sample-and-match cannot reach (Σ p·q).
    overlap = float(np.minimum(p.probs, q.prob(p.ids)).sum())
    assert abs(kept / n - overlap) < 4 * np.sqrt(overlap * (1 - overlap) / n) + 1e-9


def test_the_rule_detects_a_wrong_residual() -> None:
    """The chi-square above has the power to see a mistake: resampling from p instead of the
    residual after a rejection gives a distribution that is not p."""
    from scipy import stats

    p, q = (_dist(d) for d in CASES["disjoint parts"])
    rng = np.random.default_rng(7)
    n = 5_000
    counts = np.zeros(len(p.ids))
    for _ in range(n):
        x = q.draw(rng)
        tok = x if rng.random() * q.prob(x) < p.prob(x) else p.draw(rng)
        counts[np.searchsorted(p.ids, tok)] += 1
    assert stats.chisquare(counts, p.probs * n).pvalue < 1e-6


def test_draws_are_reproducible_from_the_seed() -> None:
    p, q = (_dist(d) for d in CASES["close"])
    runs = [[_speculative_token(p, q, rng)[0] for _ in range(50)]
            for rng in (np.random.default_rng(5), np.random.default_rng(5))]
    assert runs[0] == runs[1]


# -- the transforms against llama.cpp's own chain -------------------------------------------------------


def llama_chain_distribution(logits: np.ndarray, o: SamplingOptions) -> dict[int, float]:
    """Apply llama.cpp's top-k → top-p → min-p → temp samplers to a candidates array, then softmax:
    what its dist sampler draws from."""
    ll = backend()
    n = len(logits)
    data = (ll.llama_token_data * n)()
    for i, v in enumerate(logits.tolist()):
        data[i].id, data[i].logit, data[i].p = i, v, 0.0
    arr = ll.llama_token_data_array(data=ctypes.cast(data, ctypes.POINTER(ll.llama_token_data)), size=n,
                                    selected=-1, sorted=False)
    chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
    try:
        if o.top_k > 0:
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_k(o.top_k))
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_p(o.top_p, 1))
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_min_p(o.min_p, 1))
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_temp(o.temperature))
        ll.llama_sampler_apply(chain, ctypes.byref(arr))
        kept = [(arr.data[i].id, arr.data[i].logit) for i in range(arr.size)]
    finally:
        ll.llama_sampler_free(chain)
    z = np.array([v for _, v in kept], dtype=np.float64)
    e = np.exp(z - z.max())
    return {t: float(w) for (t, _), w in zip(kept, e / e.sum())}


@pytest.mark.parametrize("options", [
    SamplingOptions(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05),
    SamplingOptions(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0),
    SamplingOptions(temperature=1.3, top_k=20, top_p=1.0, min_p=0.1),
])
def test_sampling_distribution_is_llama_cpps_chain(options: SamplingOptions) -> None:
    rng = np.random.default_rng(3)
    for _ in range(5):
        logits = (rng.standard_normal(2000) * 3).astype(np.float32)
        ours = sampling_distribution(logits, options)
        ref = llama_chain_distribution(logits, options)
        assert sorted(ref) == ours.ids.tolist()
        np.testing.assert_allclose(ours.prob(np.array(sorted(ref))), [ref[t] for t in sorted(ref)], rtol=1e-5)
