"""Compare two greedy outputs of one model that were computed with different batch shapes.

llama.cpp's logits can differ in the last bits between batch sizes (and Q4_1's batched and one-token
paths round differently), so two greedy runs over the same tokens may part where the top two
candidates are a near-tie. Where they part, the reference's top-2 margin decides: below NEAR_TIE the
flip is rounding; above it the outputs really differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

NEAR_TIE = 0.05  # logits: a top-2 margin below this may flip with the batch shape


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where a and b differ (or where the shorter ends), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_same_or_near_tie(engine, prompt: Sequence[int], reference: Sequence[int], other: Sequence[int]) -> None:
    """`other` equals `reference` (both greedy continuations of `prompt`) or parts from it first at a
    near-tie of `engine`'s logits and stays a greedy continuation after that: each of its later
    tokens is the engine's top token (or within a near-tie of it) given the tokens before it. An
    output that stops early while the other goes on fails."""
    i = first_divergence(reference, other)
    if i is None:
        return
    if i >= min(len(reference), len(other)):
        pytest.fail(f"outputs of different lengths agree up to {i} tokens but one stops there")
    rows = engine.logits(list(prompt) + list(other), start=len(prompt) + i - 1)
    top2 = np.sort(rows[0])[-2:]
    margin = float(top2[1] - top2[0])
    print(f"outputs part at token {i}: top-2 margin {margin:.4f}")
    assert margin < NEAR_TIE, f"outputs differ at token {i} where the top-2 margin is {margin:.4f}"
    # After the tie `other` follows its own branch: it must still be greedy there, token by token.
    for j in range(i + 1, len(other)):
        row = rows[j - i]
        behind = float(row.max() - row[other[j]])
        assert behind < NEAR_TIE, (f"after the near-tie at {i}, token {j} ({other[j]}) is {behind:.4f} below the "
                                   "top logit: not a greedy continuation")
