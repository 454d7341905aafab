"""The virtual clock: a heap of timed callbacks, run in time order.

Ties run in scheduling order (a sequence number breaks them), so a run depends only on
what was scheduled, never on hash order or the wall clock: the simulator is
deterministic given its seed. Nothing here sleeps; `now` jumps to the next event.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class EventQueue:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.num_events = 0

    def __len__(self) -> int:
        return len(self._heap)

    def at(self, time_s: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) at virtual time `time_s` (never before now: the past is fixed)."""
        heapq.heappush(self._heap, (max(time_s, self.now), next(self._seq), fn, args))

    def after(self, delay_s: float, fn: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + delay_s, fn, *args)

    def run(self, until: float = float("inf"), stop: Callable[[], bool] | None = None) -> None:
        """Run events in time order until none is left, the next is after `until`, or
        `stop()` turns true (checked after each event)."""
        heap = self._heap
        pop = heapq.heappop
        while heap and heap[0][0] <= until:
            time_s, _, fn, args = pop(heap)
            self.now = time_s
            self.num_events += 1
            fn(*args)
            if stop is not None and stop():
                break
