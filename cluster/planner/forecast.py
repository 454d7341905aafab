"""The load a pool will see: arrival rate and token mix, forecast from what it saw.

Each planner tick hands over what a pool saw since the last one (`Arrivals`: requests that
arrived, their prompt tokens, and the output tokens generated). The forecast keeps

    rate     Holt's linear smoothing: level <- a r + (1 - a)(level + trend dt)
                                      trend <- b (level - level_before) / dt + (1 - b) trend
    mix      the mean prompt and output tokens per request, ratios of sums over the last
             `mix_window_s`: prompt tokens over the requests that arrived, output tokens over
             the requests that started answering (`num_answering`: a disaggregated decode
             pool's own arrivals, which come after their prefill however long it queued;
             otherwise the arrivals), so a burst still queued for prefill does not read as
             short answers; only the answers under way bias it, by their share of the window
    season   the per-tick rate history; when its autocorrelation at some lag L (longer than
             the look-ahead) reaches `season_min_correlation` over at least a whole period
             of pairs (L at most half the history: a burst seen once is not yet a season),
             the load is recurring with period L, and what came one period ago is a forecast
             too; both copies must vary alike (a step lined up with a noisy tick is no season)

The planner sizes for the MOST load expected before a replica started now would be ready,
so `peak(h)` is the largest of the level now and, when recurring, the rate history's peak
over [now - L, now - L + h], else the trend's value at h. A ramp is met before its top, and a
recurring burst before it starts.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from cluster.planner.targets import PlannerSettings


@dataclass(frozen=True)
class Arrivals:
    """What a pool saw during `dt_s`."""

    dt_s: float
    num_requests: float = 0.0
    prompt_tokens: float = 0.0
    output_tokens: float = 0.0  # generated during dt_s, by any request
    # Requests that started answering during dt_s (None: num_requests): what output_tokens
    # are per request of.
    num_answering: float | None = None

    @property
    def answering(self) -> float:
        return self.num_requests if self.num_answering is None else self.num_answering


@dataclass(frozen=True)
class Load:
    """A request rate and its token mix (means per request)."""

    rate: float
    prompt_tokens: float
    output_tokens: float

    def scaled(self, rate: float) -> Load:
        return Load(rate, self.prompt_tokens, self.output_tokens)


# A period counts only where both copies of the history it compares vary alike (the
# smaller standard deviation at least this share of the larger): a load that recurs
# varies in each period, while one step lined up with a noisy tick does not.
SEASON_MIN_STD_RATIO = 0.5


class Forecaster:
    def __init__(self, settings: PlannerSettings, prompt_tokens: float = 1024.0, output_tokens: float = 256.0) -> None:
        self.settings = settings
        self.level = 0.0  # requests/s
        self.trend = 0.0  # requests/s per second
        self.prompt_tokens = prompt_tokens  # priors until requests are seen
        self.output_tokens = output_tokens
        self.rates: list[float] = []  # one per observation, oldest first (the season's history)
        self._mix: deque[Arrivals] = deque()  # the mix window's observations
        self._seen = False

    def observe(self, arrivals: Arrivals) -> None:
        s, dt = self.settings, arrivals.dt_s
        if dt <= 0:
            return
        rate = max(arrivals.num_requests, 0.0) / dt
        if not self._seen:
            self.level, self._seen = rate, True
        else:
            before = self.level
            self.level = max(0.0, s.level_alpha * rate + (1 - s.level_alpha) * (self.level + self.trend * dt))
            self.trend = s.trend_beta * (self.level - before) / dt + (1 - s.trend_beta) * self.trend
        self._observe_mix(arrivals)
        self.rates.append(rate)
        keep = max(1, int(s.history_s / s.interval_s))
        if len(self.rates) > keep:
            del self.rates[: len(self.rates) - keep]

    def _observe_mix(self, arrivals: Arrivals) -> None:
        mix = self._mix
        mix.append(arrivals)
        span = sum(a.dt_s for a in mix)
        while len(mix) > 1 and span - mix[0].dt_s >= self.settings.mix_window_s:
            span -= mix.popleft().dt_s
        num_requests = sum(a.num_requests for a in mix)
        if num_requests > 0:
            self.prompt_tokens = sum(a.prompt_tokens for a in mix) / num_requests
        answering = sum(a.answering for a in mix)
        if answering > 0:
            self.output_tokens = max(1.0, sum(a.output_tokens for a in mix) / answering)

    def period_ticks(self) -> int | None:
        """The recurring load's period in ticks, or None (not recurring, or not seen long enough)."""
        s = self.settings
        x = np.asarray(self.rates, dtype=float)
        n = len(x)
        min_lag = max(3, math.ceil(s.horizon_s / s.interval_s) + 1)
        best: tuple[float, int] | None = None
        for lag in range(min_lag, n // 2 + 1):  # at least a whole period of pairs
            a, b = x[lag:], x[:-lag]
            low, high = sorted((float(a.std()), float(b.std())))
            if high == 0.0 or low < SEASON_MIN_STD_RATIO * high:
                continue  # flat, or one copy flat beside the other (a step against noise): nothing recurred
            corr = float(np.corrcoef(a, b)[0, 1])
            if best is None or corr > best[0] + 0.05:  # the shortest of near-equal lags (L, 2L, ...)
                best = (corr, lag)
        if best is None or best[0] < s.season_min_correlation:
            return None
        return best[1]

    def seasonal_peak(self, horizon_s: float) -> float:
        """The most rate seen one period ago over the next `horizon_s`; 0 when not recurring.
        Each tick is the median of it and its neighbours (one noisy tick is not a peak, a
        step of two is), the window reaching one tick past the horizon so that a step right
        at the horizon still counts."""
        lag = self.period_ticks()
        if lag is None:
            return 0.0
        ticks = math.ceil(horizon_s / self.settings.interval_s)
        start = len(self.rates) - lag
        window = np.asarray(self.rates[max(start - 1, 0): start + ticks + 2], dtype=float)
        if len(window) < 3:
            return float(window.max(initial=0.0))
        return float(np.median(np.lib.stride_tricks.sliding_window_view(window, 3), axis=1).max())

    def now(self) -> Load:
        return Load(self.level, self.prompt_tokens, self.output_tokens)

    def peak(self, horizon_s: float) -> Load:
        """The most load expected within `horizon_s` from now: the level, and the season's
        peak when the load recurs, else the trend's value at the horizon (a recurring step
        is better foretold by its last period than by a line through its first ticks)."""
        if self.period_ticks() is not None:
            rate = max(self.level, self.seasonal_peak(horizon_s))
        else:
            rate = max(self.level, self.level + self.trend * horizon_s)
        return Load(rate, self.prompt_tokens, self.output_tokens)
