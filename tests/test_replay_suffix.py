"""benchmarks/replay_suffix.py's oracle rows, against independent brute force (pure, no model)."""

from __future__ import annotations

import functools
import random

from benchmarks.oracle_drafter import OracleDrafts
from benchmarks.replay_suffix import oracle_accepts, oracle_plan, oracle_seconds, padded


def brute_accepts(prompt: list[int], output: list[int], earlier: list[list[int]], i: int, min_match: int = 1) -> int:
    """The longest prefix of output[i:] that follows, somewhere in the corpus, a place whose
    preceding min_match tokens are the text's last ones (every place and length tried)."""
    own = prompt + output[:i]
    best = 0
    for text in [own] + earlier:
        for p in range(min_match, len(text)):
            if text[p - min_match:p] != own[len(own) - min_match:]:
                continue
            for c in range(min(32, len(output) - i), 0, -1):
                if text[p:p + c] == output[i:i + c]:
                    best = max(best, c)
                    break
    return best


def brute_seconds(accepts: list[int], curve: dict[int, float], start: int = 1) -> float:
    """Every sequence of step lengths from `start` tried (recursion over positions), each step at
    any number of rows that holds its drafts."""
    n = len(accepts)

    @functools.lru_cache(maxsize=None)
    def cost(i: int) -> float:
        if i >= n:
            return 0.0
        return min(curve[r] + cost(i + j + 1) for j in range(accepts[i] + 1)
                   for r in curve if r >= min(j + 1, max(curve)))  # any rows past the drafts: padding

    return cost(start)


def test_the_any_match_oracle_is_the_best_continuation_of_any_agreeing_place():
    rng = random.Random(3)
    for _ in range(30):
        prompt = [rng.randrange(6) for _ in range(12)]
        output = [rng.randrange(6) for _ in range(15)]
        earlier = [[rng.randrange(6) for _ in range(10)] for _ in range(2)]
        got = oracle_accepts(prompt, output, earlier, rule="any")
        assert got[1:] == [brute_accepts(prompt, output, earlier, i) for i in range(1, len(output))]
        longest = oracle_accepts(prompt, output, earlier, rule="longest")
        assert all(a <= b for a, b in zip(longest, got))  # the longest-match places are some of them


def test_the_oracle_time_is_the_least_over_every_choice_of_step_lengths():
    rng = random.Random(5)
    curve = {1: 1.0, 2: 1.5, 3: 1.8, 4: 1.7, 5: 2.1, 6: 2.5, 7: 2.8, 8: 3.4, 9: 3.2}
    for _ in range(50):
        accepts = [0] + [rng.choice([0, 0, 1, 2, 3, 5, 8]) for _ in range(14)]
        assert abs(oracle_seconds(accepts, curve) - brute_seconds(accepts, curve)) < 1e-9
    assert oracle_seconds([0, 0, 0, 0], curve) == 3.0  # nothing right: three plain steps
    assert oracle_seconds([0, 3, 2, 1, 0], curve) == 1.7  # one 3-token draft, all accepted, then done
    assert oracle_seconds([0, 2, 1, 0], curve) == 1.7  # 2 right and one padding row: 4 rows cost less than 3


def _walk(accepts: list[int], plan: list[int], curve: dict[int, float], start: int = 1) -> float:
    """The time of the schedule the plan gives, stepping from `start`."""
    i, spent = start, 0.0
    while i < len(accepts):
        assert 0 <= plan[i] <= accepts[i]  # never more than is right
        spent += curve[padded(curve)[min(plan[i] + 1, max(curve))]]
        i += plan[i] + 1
    return spent


def test_the_oracle_plan_walks_the_cheapest_schedule_from_every_position():
    rng = random.Random(7)
    curve = {1: 1.0, 2: 1.5, 3: 1.8, 4: 1.7, 5: 2.1, 6: 2.5, 7: 2.8, 8: 3.4, 9: 3.2}
    for _ in range(50):
        accepts = [0] + [rng.choice([0, 0, 1, 2, 3, 5, 8]) for _ in range(14)]
        plan = oracle_plan(accepts, curve)
        for start in range(1, len(accepts)):  # also where a plain step (a refresh) left the path
            assert abs(_walk(accepts, plan, curve, start) - brute_seconds(accepts, curve, start)) < 1e-9
    assert oracle_plan([0, 3, 2, 1, 0], curve)[1] == 3


def test_a_step_pads_to_the_cheapest_rows_that_hold_its_drafts():
    curve = {1: 1.0, 2: 1.5, 3: 1.8, 4: 1.7, 5: 2.1, 6: 2.5, 7: 2.8, 8: 3.4, 9: 3.2}
    assert padded(curve) == {1: 1, 2: 2, 3: 4, 4: 4, 5: 5, 6: 6, 7: 7, 8: 9, 9: 9}


def test_the_oracle_drafter_pads_a_step_with_a_token_that_is_not_kept():
    curve = {1: 1.0, 2: 1.5, 3: 1.8, 4: 1.7, 5: 2.6}
    oracle = OracleDrafts([[9, 1, 2], [8, 1, 2]], [[1, 2, 5, 7, 7, 7], [1, 2, 5, 6, 6, 6]], curve)
    # after the first token the earlier answer is right for two (2, 5), then parts (7 against 6):
    # those two and a padding token (4 rows cost less than 3), which is not the right 6
    assert oracle.draft([8, 1, 2, 1], room=8) == [2, 5, 7]
    assert oracle.draft([8, 1, 2, 1], room=2) == [2, 5]


def test_the_oracle_drafter_drafts_the_answer_only_on_its_path():
    curve = {1: 1.0, 2: 1.2, 3: 1.4, 4: 1.5, 5: 1.6}
    first, second = [9, 9, 1, 2, 3, 4, 5], [8, 8, 1, 2, 3, 4, 5]
    answer = [1, 2, 3, 4, 5, 6]
    oracle = OracleDrafts([first, second], [[1, 2, 3, 4, 5, 6], answer], curve)
    assert oracle.right == 5  # every position after the first: the earlier answer continues it
    # 4 drafted and the 6 sampled with them (5 rows: 1.6) ends the answer in one step
    assert oracle.draft(second + answer[:1], room=8) == [2, 3, 4, 5]
    assert oracle.draft(second + answer[:1], room=2) == [2, 3]  # never past the room
    assert oracle.draft(second + answer[:5], room=8) == []  # the plan's plain step there (nothing after 6)
    assert oracle.draft(second + [7], room=8) == []  # the text parted from the answer
    assert oracle.draft(first + answer[:1], room=8) == []  # request 1 has nothing earlier to draft from
