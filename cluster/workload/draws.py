"""The length and arrival distributions every workload of cluster/workload/ draws from.

Two families, by the generator they take: the client-side workloads (token and text
prompts, disaggregation's streams) draw from a `random.Random`, the simulator's kinds from a
`numpy.random.Generator`. A seed means the sequence of draws a generator makes, so each
function draws exactly what it did where it came from: changing the order or the count of
draws changes every seeded workload built on it.
"""
from __future__ import annotations

import math
import random

import numpy as np


def lognormal_mu(mean: float, sigma: float) -> float:
    """The mu of a lognormal with this MEAN: mean = exp(mu + sigma^2 / 2)."""
    return math.log(mean) - sigma * sigma / 2.0


# -- random.Random ---------------------------------------------------------------------------
def sample_lengths(rng: random.Random, n: int, mean_len: int, range_ratio: float, minimum: int = 1) -> list[int]:
    """Lengths uniform in [mean * (1 - r), mean * (1 + r)] (vLLM's --random-range-ratio),
    at least `minimum`."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    low = max(minimum, math.floor(mean_len * (1.0 - range_ratio)))
    high = max(low, math.ceil(mean_len * (1.0 + range_ratio)))
    return [rng.randint(low, high) for _ in range(n)]


def arrival_times(num: int, request_rate: float, seed: int = 0, burstiness: float = 1.0) -> list[float]:
    """Seconds from the start at which each request is sent. Poisson process at
    `request_rate` req/s (gamma gaps with shape `burstiness`; 1.0 = exponential, as in
    vLLM); `inf` sends everything at t = 0. The first request goes at t = 0."""
    if num <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num
    if request_rate <= 0:
        raise ValueError("request_rate must be > 0 (or inf)")
    if burstiness <= 0:
        raise ValueError("burstiness must be > 0")
    rng = random.Random(f"kvserve-bench-arrivals:{seed}")
    theta = 1.0 / (request_rate * burstiness)  # mean gap = shape * scale = 1 / rate
    times, t = [0.0], 0.0
    for _ in range(num - 1):
        t += rng.gammavariate(burstiness, theta)
        times.append(t)
    return times


# -- numpy.random.Generator ------------------------------------------------------------------
def lognormal_lengths(rng: np.random.Generator, n: int, mean: float, sigma: float, lo: int, hi: int) -> np.ndarray:
    """Lognormal lengths with the given MEAN, rounded and clipped to [lo, hi]."""
    return np.clip(np.rint(rng.lognormal(lognormal_mu(mean, sigma), sigma, size=n)), lo, hi).astype(int)


def poisson_arrivals(rng: np.random.Generator, n: int, rate_rps: float) -> np.ndarray:
    return np.cumsum(rng.exponential(1.0 / rate_rps, size=n))


def gamma_arrivals(rng: np.random.Generator, n: int, rate_rps: float, shape: float) -> np.ndarray:
    """Gamma inter-arrival gaps with mean 1/rate; shape < 1 gives CV = 1/sqrt(shape) > 1
    (bursts of near-simultaneous arrivals separated by long lulls)."""
    return np.cumsum(rng.gamma(shape, 1.0 / (rate_rps * shape), size=n))


def around(rng: np.random.Generator, mean: int, size: int | None = None) -> np.ndarray | np.integer:
    """Uniform integers within +-50% of `mean` (at least 1): distinct draws of a similar size."""
    return rng.integers(max(1, mean // 2), mean * 3 // 2 + 1, size=size)


def log_uniform(rng: np.random.Generator, low: float, high: float) -> float:
    """One draw whose log is uniform in [log low, log high]: as many draws in 1-10 as in
    10-100 (tool calls: most return in seconds, some run for minutes)."""
    if not 0 < low <= high:
        raise ValueError(f"a log-uniform range needs 0 < low <= high, got {low}, {high}")
    return float(math.exp(rng.uniform(math.log(low), math.log(high))))
