"""cluster/percentile.py: the one percentile helper of bench serve, the simulator and
benchmarks/, each method by its definition."""
from __future__ import annotations

import math
import random
from array import array

import numpy as np
import pytest

from cluster.percentile import percentile


def test_linear_interpolates_between_closest_ranks() -> None:
    xs = [10.0, 20.0, 30.0, 40.0]
    assert percentile(xs, 0) == 10.0
    assert percentile(xs, 100) == 40.0
    assert percentile(xs, 50) == 25.0  # position 1.5
    assert percentile(xs, 90) == pytest.approx(37.0)  # position 2.7
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # sorts
    assert percentile([7.0], 99) == 7.0


def test_linear_is_numpys_default_on_lists_arrays_and_generators() -> None:
    rng = random.Random(0)
    values = [rng.expovariate(3.0) for _ in range(1001)]
    for q in (10, 50, 90, 99, 99.9):
        expected = float(np.percentile(np.asarray(values), q))
        assert percentile(values, q) == expected
        assert percentile(array("d", values), q) == expected
        assert percentile((v for v in values), q) == expected


def test_nearest_rank_picks_a_value_that_occurred_and_counts_infinite_ones() -> None:
    xs = [1.0, 2.0, 3.0, 4.0]
    assert percentile(xs, 50, method="nearest_rank") == 2.0  # 2 of 4 at or below
    assert percentile(xs, 51, method="nearest_rank") == 3.0
    assert percentile(xs, 0, method="nearest_rank") == 1.0
    assert percentile(xs, 100, method="nearest_rank") == 4.0
    # A failed request is an infinite TTFT: p99 is infinite once more than 1% failed.
    assert percentile([0.1] * 99 + [math.inf], 99, method="nearest_rank") == 0.1
    assert percentile([0.1] * 98 + [math.inf] * 2, 99, method="nearest_rank") == math.inf


def test_nearest_rank_is_numpys_inverted_cdf() -> None:
    rng = random.Random(1)
    for n in (1, 7, 100, 128, 333):
        values = [rng.random() for _ in range(n)]
        for q in (1, 10, 50, 90, 99):
            assert percentile(values, q, method="nearest_rank") == float(np.percentile(values, q, method="inverted_cdf"))


def test_strict_rank_takes_the_position_past_q() -> None:
    xs = list(range(10))
    assert percentile(xs, 50, method="strict_rank") == 5  # 5 of 10 at or below 4: not more than half
    assert percentile(xs, 49, method="strict_rank") == 4
    assert percentile(xs, 99, method="strict_rank") == 9
    assert percentile(xs, 100, method="strict_rank") == 9  # clipped to the last


@pytest.mark.parametrize("method", ["linear", "nearest_rank", "strict_rank"])
def test_no_values_give_nan(method: str) -> None:
    assert math.isnan(percentile([], 50, method=method))


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="q must be"):
        percentile([1.0], 101)
    with pytest.raises(ValueError, match="q must be"):
        percentile([1.0], 0.99 - 1)
    with pytest.raises(ValueError, match="unknown percentile method"):
        percentile([1.0], 50, method="midpoint")
