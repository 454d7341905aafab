"""The intake window (router/frontend/intake.py): FIFO slots, given back when sent, on
hold, at the block's end or after the hold time, and a burst sent in arrival order."""
from __future__ import annotations

import asyncio
import concurrent.futures

from router.frontend.intake import IntakeWindow, current_slot, release_current
from router.serve_internals import when_sent


async def test_slots_go_in_arrival_order_and_are_bounded() -> None:
    window = IntakeWindow(2, max_waiting=100)
    inside: list[int] = []
    go = {i: asyncio.Event() for i in range(5)}

    async def request(i: int) -> None:
        async with window.slot():
            inside.append(i)
            await go[i].wait()

    tasks = [asyncio.create_task(request(i)) for i in range(5)]
    await asyncio.sleep(0)
    assert inside == [0, 1] and window.num_held == 2 and window.num_waiting == 3
    go[1].set()  # the second leaves first: its slot goes to the longest waiter
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert inside == [0, 1, 2]
    for event in go.values():
        event.set()
    await asyncio.gather(*tasks)
    assert inside == [0, 1, 2, 3, 4] and window.num_held == 0 and window.num_waiting == 0


async def test_a_slot_given_back_early_lets_the_next_in_and_is_not_given_back_twice() -> None:
    window = IntakeWindow(1, max_waiting=100)
    second_in = asyncio.Event()
    done = asyncio.Event()

    async def first() -> None:
        async with window.slot() as slot:
            assert current_slot() is slot and slot is not None and slot.held
            release_current()  # e.g. its engine call was sent
            assert not slot.held
            await done.wait()  # still in the handler: the slot is not held twice
            slot.release()

    async def second() -> None:
        async with window.slot():
            second_in.set()
            await done.wait()

    tasks = [asyncio.create_task(first()), asyncio.create_task(second())]
    await asyncio.wait_for(second_in.wait(), 5.0)
    assert window.num_held == 1
    done.set()
    await asyncio.gather(*tasks)
    assert window.num_held == 0


async def test_a_task_made_inside_the_block_sees_the_slot() -> None:
    window = IntakeWindow(1, max_waiting=100)
    async with window.slot() as slot:
        seen = await asyncio.create_task(_current())
    assert seen is slot
    assert current_slot() is None


async def _current() -> object:
    return current_slot()


async def test_a_slot_passes_on_after_the_hold_time() -> None:
    window = IntakeWindow(1, max_waiting=100, hold_s=0.01)
    stuck = asyncio.Event()
    second_in = asyncio.Event()

    async def stuck_request() -> None:
        async with window.slot():
            await stuck.wait()  # its send waits for a full worker

    async def second() -> None:
        async with window.slot():
            second_in.set()

    tasks = [asyncio.create_task(stuck_request()), asyncio.create_task(second())]
    await asyncio.wait_for(second_in.wait(), 5.0)  # the timer, not the first, let it in
    stuck.set()
    await asyncio.gather(*tasks)
    assert window.num_held == 0


async def test_a_waiter_that_goes_away_leaves_no_slot_behind() -> None:
    window = IntakeWindow(1, max_waiting=100)
    release = asyncio.Event()

    async def holder() -> None:
        async with window.slot():
            await release.wait()

    async def waiter() -> None:
        async with window.slot():
            raise AssertionError("cancelled while waiting: never inside")

    first = asyncio.create_task(holder())
    await asyncio.sleep(0)
    gone = asyncio.create_task(waiter())
    await asyncio.sleep(0)
    assert window.num_waiting == 1
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    assert window.num_waiting == 0
    release.set()
    await first
    assert window.num_held == 0
    async with window.slot() as slot:
        assert slot is not None


async def test_no_window_or_a_full_queue_goes_in_at_once_without_a_slot() -> None:
    async with IntakeWindow(0, max_waiting=100).slot() as slot:
        assert slot is None and current_slot() is None
    window = IntakeWindow(1, max_waiting=1)
    release = asyncio.Event()

    async def holder() -> None:
        async with window.slot():
            await release.wait()

    tasks = [asyncio.create_task(holder()), asyncio.create_task(holder())]
    await asyncio.sleep(0)
    assert window.num_held == 1 and window.num_waiting == 1
    async with window.slot() as slot:  # the queue is full: in at once, to meet the 429 bound
        assert slot is None
    release.set()
    await asyncio.gather(*tasks)


async def test_a_burst_sends_its_first_request_before_the_last_is_read() -> None:
    """Each request takes several awaits (read, admit, route) before its call is sent;
    without a window the whole burst is read before anything is sent."""
    async def burst(window: IntakeWindow) -> list[str]:
        events: list[str] = []

        async def request(i: int) -> None:
            async with window.slot():
                events.append(f"read {i}")
                for _ in range(3):  # admission, the engine call's task, routing
                    await asyncio.sleep(0)
                events.append(f"sent {i}")
                release_current()

        await asyncio.gather(*(request(i) for i in range(32)))
        return events

    lockstep = await burst(IntakeWindow(0, max_waiting=1024))
    assert lockstep.index("sent 0") > lockstep.index("read 31")
    ordered = await burst(IntakeWindow(4, max_waiting=1024))
    assert ordered.index("sent 0") < ordered.index("read 4")
    assert [e for e in ordered if e.startswith("sent")] == [f"sent {i}" for i in range(32)]


class _Response:
    def __init__(self, future: object) -> None:
        self._replica_result_future = future


async def test_when_sent_calls_back_once_serve_has_sent_the_call() -> None:
    calls: list[str] = []
    task_future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    when_sent(_Response(task_future), lambda: calls.append("task"))
    thread_future: concurrent.futures.Future[None] = concurrent.futures.Future()
    when_sent(_Response(thread_future), lambda: calls.append("thread"))  # the router on its own loop
    when_sent(object(), lambda: calls.append("never"))  # no such future: never called
    await asyncio.sleep(0)
    assert calls == []
    task_future.set_result(None)
    thread_future.set_result(None)
    for _ in range(3):
        await asyncio.sleep(0)
    assert sorted(calls) == ["task", "thread"]
