"""The ingress's health verdict, as /health and gRPC Health answer it: a cached state, so
that an unauthenticated probe costs no worker call of its own.

- At most one worker health check runs at a time, and its answer stands for `max_age_s`:
  probes within that window (any number, HTTP and gRPC together) read the cached verdict;
  probes that come while a check runs wait for that check, never start another.
- What a probe shows is the public reason only (which pool, and "no healthy worker" or
  "no answer in time"); the worker's exception (actor ids, node addresses, messages) goes
  to this replica's log, once each time the verdict changes.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)

HEALTH_MAX_AGE_S = 1.0  # how stale a verdict a probe may be answered with


class HealthVerdict:
    def __init__(self, check: Callable[[], Awaitable[str | None]], max_age_s: float = HEALTH_MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._check = check  # None when healthy, else the public reason
        self.max_age_s = max_age_s
        self._clock = clock
        self._reason: str | None = None
        self._checked_at = -math.inf
        self._pending: asyncio.Future[str | None] | None = None
        self.num_checks = 0

    async def reason(self) -> str | None:
        """None when healthy, else why not (public text): the cached verdict while fresh."""
        if self._clock() - self._checked_at < self.max_age_s:
            return self._reason
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._refresh())
        # shield: a probe that goes away does not cancel the check the others wait on.
        return await asyncio.shield(self._pending)

    def expire(self) -> None:
        """The next probe checks again (a pool was added or replaced)."""
        self._checked_at = -math.inf

    async def _refresh(self) -> str | None:
        self.num_checks += 1
        try:
            reason = await self._check()
        except Exception:  # a bug in the check must read as unhealthy, not as a 500
            logger.exception("the worker health check failed")
            reason = "The health check failed."
        finally:
            self._pending = None
        if reason != self._reason:
            logger.warning("health: %s", "healthy again" if reason is None else reason)
        self._reason, self._checked_at = reason, self._clock()
        return reason
