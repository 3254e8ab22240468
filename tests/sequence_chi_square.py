"""The chi-square test of sampled sequences against the target's own distribution: the exact
probabilities of the likely first tokens, by walking the tree of prefixes with llama.cpp's sampler
chain on the target's logits (test_rejection_sampling.llama_chain_distribution)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence

from test_rejection_sampling import llama_chain_distribution

from edgeinfer.engine.core.options import SamplingOptions


def sequence_chi_square(engine, prompt: Sequence[int], sampling: SamplingOptions, observed: Counter,
                        n: int, length: int, key: Callable[[tuple[int, ...]], Hashable] = lambda ids: ids):
    """The chi-square result of `observed` (counts of the first `length` tokens over `n` runs, keyed
    by `key(token ids)`) against the exact probabilities, every sequence expected at least 5 times
    (the rest pooled)."""
    from scipy import stats

    prompt = list(prompt)
    expected: dict[tuple[int, ...], float] = {}
    frontier: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    while frontier:
        prefix, p = frontier.pop()
        row = engine.logits(prompt + list(prefix), start=len(prompt) + len(prefix) - 1)[-1]
        for token, q in llama_chain_distribution(row, sampling).items():
            if p * q * n < 5:
                continue  # pooled with the rest below
            if len(prefix) + 1 == length:
                expected[(*prefix, token)] = p * q
            else:
                frontier.append(((*prefix, token), p * q))
    expected = {key(ids): p for ids, p in expected.items()}
    keys = sorted(expected)
    assert len(keys) >= 3, f"the prompt's first tokens are not spread enough: {expected}"
    obs = [observed[k] for k in keys] + [n - sum(observed[k] for k in keys)]
    exp = [expected[k] * n for k in keys] + [n * (1 - sum(expected.values()))]
    if exp[-1] < 1e-9:  # nothing left to pool
        obs, exp = obs[:-1], exp[:-1]
    return stats.chisquare(obs, exp), list(zip(keys, obs, exp))


def sample_sequences(engine, prompt: Sequence[int], sampling: SamplingOptions, speculation, n: int,
                     length: int) -> tuple[Counter, int, int]:
    """(counts of the first `length` tokens, drafted, accepted) over `n` generations seeded 0..n-1
    (a token more is asked for: a step drafts at most the tokens before its last)."""
    from dataclasses import replace

    from edgeinfer import GenerateOptions

    observed: Counter = Counter()
    drafted = accepted = 0
    for seed in range(n):
        done = engine.generate(list(prompt), GenerateOptions(max_tokens=length + 1, sampling=replace(sampling, seed=seed),
                                                             speculation=speculation)).result()
        observed[tuple(done.tokens[:length])] += 1
        drafted += done.stats.speculation.drafted
        accepted += done.stats.speculation.accepted
    return observed, drafted, accepted
