"""The n-gram proposer against a direct reading of its rule: the longest suffix (between
min_n and max_n tokens) that occurred earlier, its most recent earlier occurrence, and
the tokens that followed it."""
from __future__ import annotations

import random

import pytest

from worker.spec.ngram import NgramProposer


def _reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The rule, read literally: try n = max_n down to min_n; the latest start i < len - n
    with tokens[i:i+n] == the last n tokens wins."""
    num = len(tokens)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        tail = tokens[num - n:]
        for i in range(num - n - 1, -1, -1):
            if tokens[i:i + n] == tail:
                return tokens[i + n:i + n + k]
    return []


def test_copies_the_continuation_of_the_longest_match() -> None:
    proposer = NgramProposer(num_tokens=3, min_n=1, max_n=3)
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 6, 7]
    # "6 7" occurs at 1 and 6; the 3-gram "2 6 7" nowhere earlier: the latest "6 7" (6) wins.
    assert proposer.propose(tokens) == [2, 6, 7]
    # A longer match beats a more recent shorter one: "5 6 7" at 0 ends in 7 as "1 6 7" does.
    assert NgramProposer(3, 1, 3).propose([5, 6, 7, 8, 0, 6, 7, 3, 5, 6, 7]) == [8, 0, 6]


def test_limits_and_misses() -> None:
    proposer = NgramProposer(num_tokens=4, min_n=2, max_n=4)
    assert proposer.propose([1, 2, 3, 4, 1, 2], max_tokens=2) == [3, 4]
    assert proposer.propose([1, 2, 3, 4, 9, 2]) == []  # only a 1-gram matches; min_n is 2
    assert proposer.propose([7]) == []
    assert proposer.propose([1, 2, 1, 2], max_tokens=0) == []
    # The continuation may run into the suffix itself (a repeated token): still a copy.
    assert NgramProposer(4, 1, 2).propose([3, 3, 3]) == [3]


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 4), (2, 3), (3, 5)])
def test_matches_the_literal_rule_on_random_sequences(min_n: int, max_n: int) -> None:
    rng = random.Random(min_n * 10 + max_n)
    proposer = NgramProposer(num_tokens=5, min_n=min_n, max_n=max_n)
    for _ in range(400):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 60))]
        assert proposer.propose(tokens) == _reference(tokens, 5, min_n, max_n), tokens
