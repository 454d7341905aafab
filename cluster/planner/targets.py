"""What a model is held to (its SLO) and how the planner plans for it.

TTFT and ITL targets are each met at a percentile: `ttft_s` at `ttft_percentile` of the
requests, `itl_s` at `itl_percentile` of the token gaps. `priority` orders models when
the shared GPU budget binds (higher first). The planner sizes for `headroom` times each
target (a margin for what its models leave out: dispatch, report lag, uneven batches).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SLOTargets:
    ttft_s: float = 2.0
    itl_s: float = 0.05
    ttft_percentile: float = 90.0
    itl_percentile: float = 90.0
    priority: int = 0

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.itl_s <= 0:
            raise ValueError(f"ttft_s and itl_s must be > 0, got {self.ttft_s}, {self.itl_s}")
        for name in ("ttft_percentile", "itl_percentile"):
            value = getattr(self, name)
            if not 0.0 < value < 100.0:
                raise ValueError(f"{name} must lie in (0, 100), got {value}")


@dataclass(frozen=True)
class PlannerSettings:
    """How the planner looks ahead. `startup_s`: a new replica's start-up (model load) time;
    the planner sizes each pool for the most load it forecasts until a replica it starts now
    would be ready (startup_s + interval_s). `downscale_delay_s`: a smaller size must have
    been wanted this long before a pool shrinks (a forecast that dips for one tick does not
    tear down replicas)."""

    startup_s: float = 60.0
    interval_s: float = 10.0
    headroom: float = 0.85
    downscale_delay_s: float = 30.0
    # Forecast: Holt's smoothing of the arrival rate (level, trend); the token mix's window.
    level_alpha: float = 0.5
    trend_beta: float = 0.3
    mix_window_s: float = 600.0
    # Recurring load: the rate history kept, and the autocorrelation a period must reach
    # before the forecast uses what happened one period ago.
    history_s: float = 7200.0
    season_min_correlation: float = 0.6

    def __post_init__(self) -> None:
        if self.startup_s < 0 or self.interval_s <= 0 or self.downscale_delay_s < 0:
            raise ValueError("startup_s and downscale_delay_s must be >= 0, interval_s > 0")
        if not 0.0 < self.headroom <= 1.0:
            raise ValueError(f"headroom must lie in (0, 1], got {self.headroom}")
        for name in ("level_alpha", "trend_beta"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must lie in (0, 1]")

    @property
    def horizon_s(self) -> float:
        """How far ahead a decision must hold: until a replica started now is ready."""
        return self.startup_s + self.interval_s
