"""The one percentile helper of kvserve's tools (`kvserve bench serve`, the simulator's
metrics, benchmarks/).

`q` is in [0, 100], as numpy's. No values give nan: a figure over nothing is printed as
nan, never hidden. Three methods, each the definition some published figure was computed
with (a method changes which value a percentile picks, so a figure keeps its method):

- "linear" (the default): numpy's default, interpolating between the sorted values at
  positions floor(p) and floor(p) + 1, p = (n - 1) * q / 100.
- "nearest_rank": the smallest value with at least q% of the values at or below it
  (numpy's "inverted_cdf"). It picks a value that occurred, and an infinite value counts:
  with failed requests as infinite TTFTs, p99 is infinite once more than 1% failed.
- "strict_rank": the value at sorted position floor(n * q / 100): the smallest with more
  than q% of the positions at or below it (describes a workload's lengths).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sized

import numpy as np

METHODS = ("linear", "nearest_rank", "strict_rank")


def percentile(values: Iterable[float], q: float, *, method: str = "linear") -> float:
    """The q-th percentile (0..100) of `values` by `method` (see the module docstring)."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q}")
    if method == "linear":
        arr = np.asarray(values if isinstance(values, Sized) else list(values), dtype=np.float64)
        return float(np.percentile(arr, q)) if arr.size else math.nan
    if method not in METHODS:
        raise ValueError(f"unknown percentile method {method!r}; one of {', '.join(METHODS)}")
    xs = sorted(values)
    if not xs:
        return math.nan
    fraction = q / 100.0
    if method == "nearest_rank":
        index = math.ceil(fraction * len(xs)) - 1
    else:
        index = int(fraction * len(xs))
    return float(xs[min(len(xs) - 1, max(0, index))])
