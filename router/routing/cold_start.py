"""How long a request may wait for a worker replica to take it: the bound of scale to zero.

A pool at zero replicas starts one when requests queue at its handle (Serve's handle
reports them to the controller, which the autoscaler or the SLO planner reads), so a
request for an idle model is sent on and held there, not refused, while a replica starts.
The wait is bounded here, per engine call:

    sent ──> queued at the handle (the pool starts a replica) ──> a replica takes it
             │ not taken within max_wait_s
             v
    cancelled at the handle (nothing left queued or running) -> 503 + Retry-After

A replica "takes" a request when its call yields its first item (the replica's id, for
the batched output streams: router/frontend/output_hub.py) or, for a unary call, answers.
Retry-After is the pool's start-up time: when a replica that started for earlier demand
should be ready.
"""
from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from router import errors

T = TypeVar("T")

CODE = "no_worker_replica"
# Retry-After when the pool's start-up time is not configured: the SLO planner's default
# start-up time (cluster/planner/targets.py).
DEFAULT_RETRY_AFTER_S = 60.0


@dataclass(frozen=True)
class ColdStartBound:
    """`max_wait_s`: the longest a request waits for a replica to take it (None: no bound,
    until the request's own timeout). `retry_after_s`: the Retry-After of the 503."""

    max_wait_s: float | None
    retry_after_s: float

    def __post_init__(self) -> None:
        if self.max_wait_s is not None and self.max_wait_s <= 0:
            raise ValueError("cold_start_max_wait_s must be > 0 (or unset: no bound)")
        if self.retry_after_s < 0:
            raise ValueError("cold_start_retry_after_s must be >= 0")

    @property
    def bounded(self) -> bool:
        return self.max_wait_s is not None

    def error(self) -> errors.APIError:
        """The 503 a request gets when no replica took it in time: the client's cue to come
        back once the pool has started (Retry-After in whole seconds, at least 1)."""
        retry = max(math.ceil(self.retry_after_s), 1)
        message = (f"No worker replica of this model took the request within {self.max_wait_s:g} s: "
                   f"its pool is starting (or cannot start); retry after {retry} s.")
        error = errors.APIError(503, message, "server_error", None, CODE)
        error.retry_after_s = retry  # type: ignore[attr-defined]
        return error

    async def answer(self, response: Any) -> Any:
        """A unary handle call's result, or the 503 past the bound with the call cancelled
        (so nothing stays queued at the handle)."""
        if self.max_wait_s is None:
            return await response
        try:
            return await asyncio.wait_for(_awaited(response), self.max_wait_s)
        except asyncio.TimeoutError:
            response.cancel()
            raise self.error() from None


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable


NO_BOUND = ColdStartBound(None, 0.0)
