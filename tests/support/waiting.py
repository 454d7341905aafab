"""Bounded polling for tests: wait for a condition that another process (a Serve
replica, the proxy, the router thread, a redis-server starting) makes true, instead of sleeping for a
guessed time. The poll interval only spaces out the checks; the deadline bounds the wait.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T],
    timeout_s: float,
    interval_s: float = 0.05,
    message: str | Callable[[], str] = "the condition",
    retry_on: tuple[type[BaseException], ...] = (),
) -> T:
    """Calls `condition` until it returns something truthy, and returns that value.

    After `timeout_s` raises AssertionError naming `message` (a callable is called then,
    for details only known at the time, e.g. serve.status()) and the last value the
    condition returned, or the last exception it raised. An exception of a type in
    `retry_on` counts as "not yet"; any other propagates at once.
    """
    deadline = time.monotonic() + timeout_s
    last: str = "no value yet"
    while True:
        try:
            value = condition()
        except retry_on as e:
            last = f"last exception: {type(e).__name__}: {e}"
        else:
            if value:
                return value
            last = f"last value: {value!r}"
        if time.monotonic() > deadline:
            what = message() if callable(message) else message
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what} ({last})")
        time.sleep(interval_s)
