"""Intake: a burst of requests reaches the workers in arrival order, not in lockstep.

An ingress replica's requests share one event loop, and every await on the way to the
worker (reading the body, admission, the engine call's task, each of Serve's routing
steps) sends a request to the back of the loop's queue. When a burst arrives, every
request takes its first step before any takes its second, so the first engine call leaves
only once the whole burst has been parsed, and the worker's device idles meanwhile:

    no window    parse r1 r2 ... rN | admit r1 r2 ... rN | route r1 ... rN | send r1 ...
    window K     parse r1..rK | admit r1..rK | route | send r1 ... (rK+1 takes r1's slot)

The window lets at most K requests between arrival and the moment their engine call is
sent; the others wait their turn in arrival order (FIFO) before any of their work starts.
A slot is given back when the request's engine call has been sent (`release_when_sent`:
router/frontend/output_hub.py, and a disaggregated request's prefill call in
router/frontend/disagg.py), when it starts waiting for admission (capacity, not work: it
must not hold up requests behind it), when its handler ends (an error before any call), or
after SLOT_HOLD_S whatever happened: a send that waits for a full worker (Serve's router
backs off) must not stall the intake. And when more requests wait for a slot than the
replica may hold at all (`max_waiting`: max_queued_requests), a request goes in at once,
without one, so that an overload is still answered 429 at once by the in-flight bound
behind the window, not queued here.

The handler enters `IntakeWindow.slot()`; code further down finds the slot through a
context variable (tasks it creates copy it), so the hub and the pipeline give it back
without it being passed through every call.
"""
from __future__ import annotations

import asyncio
import collections
import contextvars
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from router.serve_internals import when_sent

# A slot passes on after this long even if its request has not been sent yet: well past
# one request's intake while a burst of hundreds shares the loop, short enough that sends
# stuck behind full workers still let the intake move.
SLOT_HOLD_S = 0.25

_current: contextvars.ContextVar[IntakeSlot | None] = contextvars.ContextVar("kvserve_intake_slot", default=None)


class IntakeSlot:
    """One request's place in the window; `release` is idempotent."""

    def __init__(self, window: IntakeWindow) -> None:
        self._window: IntakeWindow | None = window
        self._timer = asyncio.get_running_loop().call_later(window.hold_s, self.release)

    def release(self) -> None:
        window, self._window = self._window, None
        if window is None:
            return
        self._timer.cancel()
        window._pass_on()

    @property
    def held(self) -> bool:
        return self._window is not None


class IntakeWindow:
    """At most `size` requests between arrival and their engine call sent (0: no bound)."""

    def __init__(self, size: int, max_waiting: int, hold_s: float = SLOT_HOLD_S) -> None:
        self.size = size
        self.max_waiting = max_waiting
        self.hold_s = hold_s
        self.num_held = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def num_waiting(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[IntakeSlot | None]:
        """Wait for a slot (FIFO) and hold it for the block, or until given back earlier.
        Yields None, at once, when there is no window or its queue is full."""
        if self.size <= 0 or len(self._waiters) >= self.max_waiting:
            yield None
            return
        await self._acquire()
        slot = IntakeSlot(self)
        token = _current.set(slot)
        try:
            yield slot
        finally:
            _current.reset(token)
            slot.release()

    async def _acquire(self) -> None:
        if self.num_held < self.size and not self._waiters:
            self.num_held += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._pass_on()  # the slot was handed over as the request went: pass it on
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            raise

    def _pass_on(self) -> None:
        """A slot is free: to the longest waiter (num_held unchanged), else back."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.num_held -= 1


def release_current() -> None:
    """Give back the calling request's slot, if it holds one."""
    slot = _current.get()
    if slot is not None:
        slot.release()


def current_slot() -> IntakeSlot | None:
    return _current.get()


def release_when_sent(response: Any) -> None:
    """Give back the calling request's slot once Serve has sent `response`'s call."""
    slot = _current.get()
    if slot is not None and slot.held:
        when_sent(response, slot.release)
