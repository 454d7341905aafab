"""The admission hold queue is fair between keys (issue 30, "Exposure and limits"): one
key cannot take every place, and a held request that does not fit does not block other
keys' requests that do."""
from __future__ import annotations

import asyncio

import pytest

from router import errors
from router.routing.admission import AdmissionController
from tests.unit.router.routing.test_admission import NOW, Source, profile, report, snapshot

FULL = snapshot(report(waiting=4))


def controller(source: Source, queue_size: int = 4, max_wait_s: float = 60.0) -> AdmissionController:
    return AdmissionController(source, queue_size, max_wait_s, 4, None, poll_interval_s=3600.0, clock=lambda: NOW)


async def test_one_key_cannot_fill_every_place() -> None:
    # Finding: the hold queue was shared first-come; one key could fill all its places and
    # every other key got 429 at once.
    c = controller(Source(FULL), queue_size=4)
    await c.admit("flood", [profile()])  # in flight: later ones are held
    flood = [asyncio.create_task(c.admit("flood", [profile()])) for _ in range(4)]
    await asyncio.sleep(0)
    assert len(c.queue) == 4
    quiet = asyncio.create_task(c.admit("quiet", [profile()]))
    await asyncio.sleep(0)
    # The quiet key got a place: the flooding key's newest held request was shed for it.
    assert c.queue.depth("quiet") == 1 and c.queue.depth("flood") == 3
    done, _ = await asyncio.wait(flood, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    shed = list(done)
    assert len(shed) == 1 and shed[0] is flood[-1]
    with pytest.raises(errors.APIError) as info:
        shed[0].result()
    assert info.value.status == 429 and info.value.retry_after_s >= 1
    # A key at its fair share is refused itself rather than shedding an equal one.
    c2 = controller(Source(FULL), queue_size=2)
    await c2.admit("a", [profile()])
    held = [asyncio.create_task(c2.admit(k, [profile()])) for k in ("a", "b")]
    await asyncio.sleep(0)
    with pytest.raises(errors.APIError):
        await c2.admit("b", [profile()])
    for t in [*flood, quiet, *held]:
        t.cancel()
    await asyncio.gather(*flood, quiet, *held, return_exceptions=True)


async def test_a_head_that_does_not_fit_does_not_block_other_keys() -> None:
    # Finding: the queue was served strictly in turn: a head too big for the free blocks
    # held back every request behind it, small ones of other keys included.
    source = Source(FULL)
    c = controller(source)
    await c.admit("k", [profile()])
    big = asyncio.create_task(c.admit("big", [profile(prompt_len=16 * 60, max_tokens=32)]))  # 62 blocks
    await asyncio.sleep(0)
    small = asyncio.create_task(c.admit("small", [profile()]))  # 6 blocks
    await asyncio.sleep(0)
    assert len(c.queue) == 2
    # A report with room for the small request only (and free queue slots).
    source.snap = snapshot(report(free=20, waiting=0, timestamp=NOW + 1.0), now=NOW + 1.0)
    c.pump()
    assert (await asyncio.wait_for(small, 10)).verdict.admit
    assert not big.done() and c.queue.depth("big") == 1
    big.cancel()
    await asyncio.gather(big, return_exceptions=True)
