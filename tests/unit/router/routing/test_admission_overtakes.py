"""A better band overtakes worse bands' work at admission (router/routing/admission.py
`_overtakes`): replicas full of worse-band work do not hold a better band's request at
the ingress, since each engine admits it first; bounded by the replicas' room."""
from __future__ import annotations

import asyncio
import dataclasses

from router.routing.admission import REASON_FULL, REASON_IDLE, REASON_OVERTAKES, AdmissionController
from tests.unit.router.routing.test_admission import NOW, Source, profile, report, snapshot

# One replica, its waiting room (4) full; 2 running slots: room for 2 + 4 requests.
FULL = snapshot(dataclasses.replace(report(waiting=4), max_num_seqs=2, num_running=2))


def controller() -> AdmissionController:
    return AdmissionController(Source(FULL), 8, 60.0, 4, None, poll_interval_s=3600.0, clock=lambda: NOW)


async def test_a_better_band_goes_past_worse_work_in_flight() -> None:
    c = controller()
    batch = await c.admit("batch", [profile()], 10)
    assert batch.verdict.reason == REASON_IDLE  # nothing in flight: it goes
    premium = await c.admit("premium", [profile()], 0)
    assert premium.verdict.reason == REASON_OVERTAKES
    standard = await c.admit("standard", [profile()], 5)
    assert standard.verdict.reason == REASON_OVERTAKES  # band 5 overtakes band 10 too
    assert c._in_flight_by_band == {10: 1, 0: 1, 5: 1}


async def test_the_same_band_is_held() -> None:
    c = controller()
    await c.admit("batch-1", [profile()], 10)
    held = asyncio.create_task(c.admit("batch-2", [profile()], 10))
    await asyncio.sleep(0)
    assert not held.done() and len(c.queue) == 1
    held.cancel()
    await asyncio.gather(held, return_exceptions=True)


async def test_overtaking_is_bounded_by_the_replicas_room() -> None:
    c = controller()
    await c.admit("batch", [profile()], 10)
    tickets = [await c.admit("premium", [profile()], 0) for _ in range(6)]  # 2 slots + 4 waiting
    assert all(t.verdict.reason == REASON_OVERTAKES for t in tickets)
    seventh = asyncio.create_task(c.admit("premium", [profile()], 0))
    await asyncio.sleep(0)
    assert not seventh.done()  # its band fills the room: held like any other
    assert c._judge([profile()], 0).reason == REASON_FULL
    tickets[0].release()  # one premium done: the held one goes, overtaking again
    assert (await asyncio.wait_for(seventh, 1)).verdict.reason == REASON_OVERTAKES


async def test_nothing_to_overtake_once_the_worse_work_is_done() -> None:
    c = controller()
    batch = await c.admit("batch", [profile()], 10)
    first = await c.admit("premium", [profile()], 0)
    batch.release()
    assert c._in_flight_by_band[10] == 0
    held = asyncio.create_task(c.admit("premium", [profile()], 0))
    await asyncio.sleep(0)
    assert not held.done()  # only its own band in flight: the replicas' headroom decides
    first.release()  # nothing in flight: it goes
    assert (await asyncio.wait_for(held, 1)).verdict.reason == REASON_IDLE
