"""Closed-loop turns: a request that arrives a pause after another one finishes (an agent
sends its next turn once it has the answer and its tool calls returned), instead of at a
fixed time.

A SimRequest with `after` set is held here until the request it names finishes (or
fails); it then arrives `pause_s` later, its arrival time set to that moment, so its TTFT
counts from when the client really sent it. A request whose predecessor never finishes
never arrives (the run then ends stalled, loudly).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.sim.clock import EventQueue
    from cluster.workload.sim_kinds import SimRequest

Arrive = Callable[[int, "SimRequest"], None]


class FollowUps:
    def __init__(self, clock: EventQueue, arrive: Arrive) -> None:
        self.clock = clock
        self.arrive = arrive
        self._held: dict[str, tuple[int, SimRequest, float]] = {}  # predecessor id -> follower

    def hold(self, index: int, request: SimRequest, latency: float) -> bool:
        """Keep `request` until its predecessor finishes; False when it has none."""
        if request.after is None:
            return False
        if request.after in self._held:
            raise ValueError(f"two requests follow {request.after!r}")
        self._held[request.after] = (index, request, latency)
        return True

    def finished(self, request_id: str, now: float) -> None:
        """`request_id` finished at `now`: its follower arrives a pause later."""
        held = self._held.pop(request_id, None)
        if held is None:
            return
        index, request, latency = held
        request = replace(request, arrival_s=now + request.pause_s, after=None)
        self.clock.at(request.arrival_s + latency, self.arrive, index, request)

    @property
    def num_held(self) -> int:
        return len(self._held)
