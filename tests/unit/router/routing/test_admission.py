"""router/routing/admission.py and router/routing/fair_queue.py: when a request may go to the workers, how
held requests are served (round robin between keys), and how they are shed (429 with a
Retry-After hint). Reports are fakes built here; the clock is explicit."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from kv.block_hash import hash_full_blocks
from router import errors
from router.routing.admission import (
    REASON_FITS,
    REASON_FULL,
    REASON_IDLE,
    REASON_NO_ROUTER,
    REASON_OFF,
    REASON_STALE,
    REASON_TOO_LARGE,
    AdmissionController,
    RoutingSnapshot,
    _Pending,
    judge,
)
from router.routing.fair_queue import FairQueue
from router.routing.types import RoutingParams, ReplicaReport, RequestProfile
from router.frontend.metrics import IngressMetrics
from router.routing.reservations import NOTHING, Unreflected

NOW = 1000.0
BS = 16
PARAMS = RoutingParams(expected_output_tokens=32, stats_period_s=1.0, stale_after_periods=3.0, report_lag_s=0.05)


def report(free: int = 100, waiting: int = 0, reserved: int = 0, hashes: frozenset[int] = frozenset(),
           timestamp: float = NOW, healthy: bool = True) -> ReplicaReport:
    return ReplicaReport(free_blocks=free, total_blocks=200, block_size=BS, num_running=0, num_waiting=waiting,
                         num_waiting_prompt_tokens=0, reserved_blocks=reserved, prefix_hashes=hashes,
                         timestamp=timestamp, healthy=healthy)


def profile(prompt_len: int = 64, max_tokens: int = 32, first: int = 1) -> RequestProfile:
    # 64 prompt tokens + 32 decode = 96 tokens = 6 blocks
    return RequestProfile(list(range(first, first + prompt_len)), max_tokens)


def snapshot(*reports: ReplicaReport | None, now: float = NOW, unreflected: tuple[Unreflected, ...] = (),
             routed_total: int | None = None) -> RoutingSnapshot:
    return RoutingSnapshot(tuple(reports), PARAMS, now, unreflected, routed_total)


# -- the fair queue ------------------------------------------------------------------------------
def test_fair_queue_serves_keys_round_robin_and_is_bounded() -> None:
    q = FairQueue(capacity=4)
    assert q.push("a", "a1") and q.push("a", "a2") and q.push("a", "a3") and q.push("b", "b1")
    assert not q.push("c", "c1") and len(q) == 4  # full: nothing added
    assert [q.pop() for _ in range(4)] == ["a1", "b1", "a2", "a3"]
    assert len(q) == 0 and q.peek() is None


def test_fair_queue_removes_a_held_item() -> None:
    q = FairQueue(capacity=4)
    q.push("a", "a1"), q.push("b", "b1"), q.push("a", "a2")
    assert q.remove("a", "a1") and not q.remove("a", "a1") and q.depth("a") == 1
    assert [q.pop(), q.pop()] == ["a2", "b1"] and len(q) == 0


# -- judge: can some replica take it -------------------------------------------------------------
def test_no_kvserve_router_or_stale_stats_never_hold() -> None:
    full = report(waiting=99)
    assert judge([profile()], None, [], 4) == judge([profile()], None, [], 4)
    assert judge([profile()], None, [], 4).reason == REASON_NO_ROUTER
    # One replica never reported, or its report is older than 3 periods: the router ranks
    # by power of two there, so admission lets the request go.
    for other in (None, report(timestamp=NOW - 3.5)):
        verdict = judge([profile()], snapshot(full, other), [], 4)
        assert verdict.admit and verdict.reason == REASON_STALE


def test_a_request_goes_when_a_replica_has_headroom_and_queue_room() -> None:
    verdict = judge([profile()], snapshot(report(waiting=4), report(waiting=3)), [], 4)
    assert verdict.admit and verdict.reason == REASON_FITS and verdict.need_blocks == 6


def test_a_request_is_held_when_every_queue_is_at_the_bound() -> None:
    verdict = judge([profile()], snapshot(report(waiting=4), report(waiting=5)), [], 4)
    assert not verdict.admit and verdict.reason == REASON_FULL


def test_a_request_is_held_when_no_replica_has_the_blocks() -> None:
    # 6 blocks needed; 10 free less 5 reserved by the replica's own waiting requests = 5.
    verdict = judge([profile()], snapshot(report(free=10, reserved=5)), [], 4)
    assert not verdict.admit
    assert judge([profile()], snapshot(report(free=11, reserved=5)), [], 4).admit


def test_the_growth_of_requests_already_there_is_not_available() -> None:
    # 16 free, 5 reserved, 6 that running requests will still grow into: 5 left < 6 needed.
    grown = replace(report(free=16, reserved=5), decode_growth_blocks=6)
    assert not judge([profile()], snapshot(grown), [], 4).admit
    assert judge([profile()], snapshot(replace(grown, decode_growth_blocks=5)), [], 4).admit
    # The replica's observed mean output length replaces the parameter: 64 + min(32, 8)
    # tokens = 5 blocks fit in the 5 left.
    assert judge([profile()], snapshot(replace(grown, mean_output_tokens=8.0)), [], 4).admit


def test_a_request_larger_than_any_replica_is_never_held() -> None:
    # 6 blocks needed, pools of 5: the engine refuses it (400); holding it would only delay that.
    small = replace(report(free=0, waiting=9), total_blocks=5)
    assert judge([profile()], snapshot(small), [], 4).reason == REASON_TOO_LARGE


def test_cached_prefix_blocks_are_not_needed_again_and_are_predicted() -> None:
    p = profile()
    cached = frozenset(hash_full_blocks(p.prompt_token_ids, BS)[:3])  # 3 of the 4 prompt blocks
    verdict = judge([p], snapshot(report(free=3, hashes=cached), report(free=0)), [], 4)
    assert verdict.admit and verdict.need_blocks == 3 and verdict.predicted_cached_tokens == 3 * BS


def test_this_ingress_pending_admissions_use_up_slots_and_blocks() -> None:
    reports = snapshot(report(free=20, waiting=2))  # 2 slots, 20 blocks
    assert judge([profile()], reports, [_Pending(NOW, 1, 6)], 4).admit
    assert not judge([profile()], reports, [_Pending(NOW, 2, 6)], 4).admit  # no slot left
    assert not judge([profile()], reports, [_Pending(NOW, 1, 15)], 4).admit  # 5 blocks left < 6


def test_work_sent_since_the_report_is_not_available() -> None:
    room = report(free=20)  # 6 blocks needed
    for view in ((), (NOTHING,)):  # no view, or nothing sent since the report
        assert judge([profile()], snapshot(room, unreflected=view), [], 4).admit
    assert judge([profile()], snapshot(room, unreflected=(Unreflected(14, 1),)), [], 4).admit  # 6 left
    verdict = judge([profile()], snapshot(room, unreflected=(Unreflected(15, 1),)), [], 4)  # 5 left
    assert not verdict.admit and verdict.reason == REASON_FULL
    # A reservation's blocks are its need, decode included: its decode_blocks are not taken twice.
    assert judge([profile()], snapshot(room, unreflected=(Unreflected(14, 1, 64, 2),)), [], 4).admit
    # Nothing fits: one replica's room is promised away, the other's report shows none.
    both = snapshot(room, report(free=5), unreflected=(Unreflected(15, 1), NOTHING))
    assert judge([profile()], both, [], 4).reason == REASON_FULL
    # What is left after the sent work is what this ingress's pending admissions share.
    sent = snapshot(room, unreflected=(Unreflected(8, 1),))  # 12 left
    assert judge([profile()], sent, [_Pending(NOW, 1, 6)], 4).admit
    assert not judge([profile()], sent, [_Pending(NOW, 1, 7)], 4).admit


def test_requests_sent_since_the_report_use_up_slots() -> None:
    waiting = report(waiting=2)  # 2 slots by the report
    assert judge([profile()], snapshot(waiting, unreflected=(Unreflected(6, 1),)), [], 4).admit
    assert not judge([profile()], snapshot(waiting, unreflected=(Unreflected(6, 2),)), [], 4).admit
    assert not judge([profile(), profile()], snapshot(waiting, unreflected=(Unreflected(6, 1),)), [], 4).admit
    # The slots of a replica whose blocks are promised away do not count either.
    two = snapshot(waiting, report(waiting=3), unreflected=(Unreflected(95, 0), NOTHING))
    assert judge([profile()], two, [], 4).admit
    assert not judge([profile(), profile()], two, [], 4).admit


def test_a_burst_takes_the_free_running_slots_before_it_waits() -> None:
    """A replica that runs up to 16 sequences and runs 10 starts 6 more at once; then 4 may
    wait there: a burst is not let through max_waiting requests per report."""
    roomy = replace(report(free=1000, waiting=0), max_num_seqs=16, num_running=10)
    assert roomy.free_seqs == 6
    assert judge([profile()], snapshot(roomy, unreflected=(Unreflected(60, 9),)), [], 4).admit
    assert not judge([profile()], snapshot(roomy, unreflected=(Unreflected(60, 10),)), [], 4).admit
    # Not said by the replica: only the waiting room counts.
    assert not judge([profile()], snapshot(report(free=1000), unreflected=(Unreflected(24, 4),)), [], 4).admit
    assert ReplicaReport.from_stats({**roomy_stats(), "max_num_seqs": 16}).max_num_seqs == 16


def roomy_stats() -> dict[str, object]:
    return {"free_blocks": 10, "total_blocks": 20, "block_size": BS, "timestamp": NOW}


def test_an_unhealthy_replica_is_not_counted() -> None:
    verdict = judge([profile()], snapshot(report(healthy=False), report(waiting=4)), [], 4)
    assert not verdict.admit


# -- the controller -------------------------------------------------------------------------------
class Source:
    def __init__(self, snap: RoutingSnapshot | None) -> None:
        self.snap = snap

    def snapshot(self) -> RoutingSnapshot | None:
        return self.snap


FULL = snapshot(report(waiting=4))
ROOM = snapshot(report(waiting=0))


def controller(source: Source | None, queue_size: int = 8, max_wait_s: float = 60.0,
               metrics: IngressMetrics | None = None) -> AdmissionController:
    # A poll interval far beyond the test: held requests go only when the test pumps or a
    # ticket is released.
    return AdmissionController(source, queue_size, max_wait_s, 4, metrics, poll_interval_s=3600.0, clock=lambda: NOW)


async def test_off_without_a_source_or_a_queue() -> None:
    for c in (controller(None), controller(Source(FULL), queue_size=0)):
        ticket = await c.admit("k", [profile()])
        assert ticket.verdict.reason == REASON_OFF and c.num_in_flight == 1
        ticket.release()
        ticket.release()  # idempotent
        assert c.num_in_flight == 0


async def test_nothing_in_flight_here_means_the_request_goes_even_when_full() -> None:
    c = controller(Source(FULL))
    ticket = await c.admit("k", [profile()])
    assert ticket.verdict.reason == REASON_IDLE and len(c.queue) == 0


async def test_a_held_request_goes_when_a_request_here_completes() -> None:
    c = controller(Source(FULL))
    first = await c.admit("k", [profile()])
    held = asyncio.create_task(c.admit("k", [profile()]))
    await asyncio.sleep(0)  # let it reach the queue
    assert len(c.queue) == 1 and not held.done()
    first.release()  # nothing in flight here any more: the held one goes
    second = await held
    assert second.verdict.reason == REASON_IDLE and len(c.queue) == 0 and c.num_in_flight == 1


async def test_a_held_request_goes_when_a_report_shows_room() -> None:
    source = Source(FULL)
    c = controller(source)
    await c.admit("k", [profile()])
    held = asyncio.create_task(c.admit("k", [profile()]))
    await asyncio.sleep(0)
    c.pump()
    assert not held.done()
    source.snap = snapshot(report(waiting=0, timestamp=NOW + 1.0), now=NOW + 1.0)
    c.pump()
    assert (await held).verdict.reason == REASON_FITS


async def test_held_requests_go_round_robin_between_keys() -> None:
    source = Source(FULL)
    c = controller(source)
    await c.admit("busy", [profile()])
    order: list[str] = []

    async def client(key: str) -> None:
        await c.admit(key, [profile()])
        order.append(key)

    tasks = [asyncio.create_task(client(k)) for k in ("busy", "busy", "busy", "quiet")]
    await asyncio.sleep(0)
    assert len(c.queue) == 4
    # Room for everyone (a later report, so this ingress's own admissions are reflected).
    source.snap = snapshot(report(waiting=0, timestamp=NOW + 1.0), now=NOW + 1.0)
    c.pump()
    await asyncio.gather(*tasks)
    assert order == ["busy", "quiet", "busy", "busy"]


async def test_a_full_queue_sheds_with_429_and_retry_after() -> None:
    metrics = IngressMetrics("m")
    c = controller(Source(FULL), queue_size=1, metrics=metrics)
    await c.admit("k", [profile()])
    held = asyncio.create_task(c.admit("k", [profile()]))
    await asyncio.sleep(0)
    with pytest.raises(errors.APIError) as e:  # its key holds a place: over its share
        await c.admit("k", [profile()])
    assert e.value.status == 429 and e.value.retry_after_s == 1 and "queue is full" in e.value.message
    with pytest.raises(errors.APIError) as e:  # a key with no place: the cluster is out of room (503)
        await c.admit("other", [profile()])
    assert e.value.status == 503 and e.value.retry_after_s == 1
    assert metrics.rejected.labels("m", "admission_queue_full")._value.get() == 2
    held.cancel()


async def test_a_request_held_too_long_is_shed() -> None:
    c = controller(Source(FULL), max_wait_s=0.01)
    await c.admit("k", [profile()])
    with pytest.raises(errors.APIError) as e:
        await c.admit("k", [profile()])
    # The cluster could not take it in time: 503 (not the tenant's share).
    assert e.value.status == 503 and "within 0.01 s" in e.value.message and len(c.queue) == 0


async def test_a_cancelled_waiter_leaves_the_queue() -> None:
    c = controller(Source(FULL))
    await c.admit("k", [profile()])
    held = asyncio.create_task(c.admit("k", [profile()]))
    await asyncio.sleep(0)
    held.cancel()
    with pytest.raises(asyncio.CancelledError):
        await held
    assert len(c.queue) == 0 and c.num_in_flight == 1


async def test_own_admissions_count_until_every_replica_reported_after_them() -> None:
    source = Source(snapshot(report(waiting=2)))  # 2 slots
    c = controller(source)
    await c.admit("k", [profile()])  # idle: goes, and is pending
    second = await c.admit("k", [profile()])  # 2 slots - 1 pending: goes
    assert second.verdict.reason == REASON_FITS
    held = asyncio.create_task(c.admit("k", [profile()]))  # 2 slots - 2 pending: held
    await asyncio.sleep(0)
    assert len(c.queue) == 1
    # A report taken after both admissions (plus the report lag) shows them: they stop
    # counting as pending, and the report's own queue (now 3 waiting) is what counts.
    source.snap = snapshot(report(waiting=3, timestamp=NOW + 0.1), now=NOW + 0.1)
    c.pump()
    assert (await held).verdict.reason == REASON_FITS


def pending_requests(c: AdmissionController) -> list[int]:
    return [p.num_requests for p in c._pending]


@pytest.mark.parametrize("view", [True, False])
async def test_pending_admissions_stop_counting_in_order_once_the_router_sent_them(view: bool) -> None:
    source = Source(snapshot(report(waiting=0), routed_total=0 if view else None))  # 4 slots
    c = controller(source)

    def sent(total: int) -> None:  # the router's send count (no view: it keeps none)
        if view:
            source.snap = replace(source.snap, routed_total=total)  # type: ignore[arg-type]
        c.pump()

    await c.admit("k", [profile()])  # idle
    await c.admit("k", [profile(), profile()])  # n=2: two engine requests
    await c.admit("k", [profile()])
    held = asyncio.create_task(c.admit("k", [profile()]))  # 4 slots - 4 pending: held
    await asyncio.sleep(0)
    assert pending_requests(c) == [1, 2, 1] and len(c.queue) == 1
    sent(1)  # the oldest admission was sent: the view counts it now
    if not view:  # nothing tells the controller: all stay pending until a report shows them
        assert pending_requests(c) == [1, 2, 1] and not held.done()
        held.cancel()
        return
    assert len(c.queue) == 0  # granted by that pump
    assert (await held).verdict.reason == REASON_FITS and pending_requests(c) == [2, 1, 1]
    held = asyncio.create_task(c.admit("k", [profile()]))
    await asyncio.sleep(0)
    sent(2)  # one of the n=2 admission's two: it still counts whole
    assert pending_requests(c) == [2, 1, 1] and not held.done()
    sent(3)
    assert len(c.queue) == 0
    assert (await held).verdict.reason == REASON_FITS and pending_requests(c) == [1, 1, 1]


async def test_a_first_view_sets_the_baseline_and_sends_beyond_the_grants_are_not_banked() -> None:
    source = Source(snapshot(report(waiting=0)))  # no view yet
    c = controller(source)
    await c.admit("k", [profile()])
    await c.admit("k", [profile()])
    # A view appears with 5 sends behind it: whose they were is unknown, so nothing is dropped.
    source.snap = replace(source.snap, routed_total=5)
    await c.admit("k", [profile()])
    assert pending_requests(c) == [1, 1, 1]
    source.snap = replace(source.snap, routed_total=6)  # one more: the oldest goes
    await c.admit("k", [profile()])
    assert pending_requests(c) == [1, 1, 1]
    # Far more sends than grants here (another caller of the router): every pending
    # admission was sent, but a later one is not taken as sent in advance.
    source.snap = replace(source.snap, routed_total=100)
    await c.admit("k", [profile()])
    assert pending_requests(c) == [1]
    await c.admit("k", [profile()])
    assert pending_requests(c) == [1, 1]


@pytest.mark.parametrize("view", [True, False])
async def test_nothing_in_flight_means_every_grant_was_sent_or_given_up(view: bool) -> None:
    c = controller(Source(snapshot(report(waiting=0), routed_total=0 if view else None)))
    tickets = [await c.admit("k", [profile()]) for _ in range(3)]  # no send counted
    for ticket in tickets:
        ticket.release()
    await c.admit("k", [profile()])
    # With a view the count is exact again; without one they wait for a report to show them.
    assert pending_requests(c) == ([1] if view else [1, 1, 1, 1])


async def test_metrics_show_queue_time_decisions_and_predicted_prefix_hits() -> None:
    metrics = IngressMetrics("m")
    p = profile()
    cached = frozenset(hash_full_blocks(p.prompt_token_ids, BS))
    c = controller(Source(snapshot(report(hashes=cached))), metrics=metrics)
    await c.admit("k", [p])
    await c.admit("k", [p])
    text = metrics.render([]).decode()
    assert 'kvserve:admission_decisions_total{model_name="m",reason="fits"} 2.0' in text
    # 63 cacheable prompt tokens -> 3 full blocks, on both requests.
    assert 'kvserve:router_prefix_hit_tokens_predicted_total{model_name="m"} 96.0' in text
    assert 'kvserve:ingress_queue_time_seconds_count{model_name="m"} 2.0' in text
    assert 'kvserve:ingress_queue_length{model_name="m"} 0.0' in text


def test_router_metrics_read_the_router_at_scrape_time() -> None:
    class FakeRouter:
        def __init__(self) -> None:
            self.num_decisions_by_mode = {"headroom": 5, "pow2": 1}

        def routing_view(self) -> dict:
            return {"r1": {"stats": {"timestamp": NOW - 0.5}, "outstanding": 3, "unreflected_requests": 2}}

    metrics = IngressMetrics("m")
    assert "kvserve:router_decisions" not in metrics.render([]).decode()  # no router yet
    metrics.router.source = FakeRouter
    metrics.router._clock = lambda: NOW
    text = metrics.render([]).decode()
    assert 'kvserve:router_decisions_total{mode="headroom",model_name="m"} 5.0' in text
    assert 'kvserve:router_requests_outstanding{model_name="m",replica="r1"} 3.0' in text
    assert 'kvserve:router_reservations_unreflected{model_name="m",replica="r1"} 2.0' in text
    assert 'kvserve:router_stats_age_seconds{model_name="m",replica="r1"} 0.5' in text


def test_realised_prefix_hits_come_from_first_outputs() -> None:
    metrics = IngressMetrics("m")
    metrics.observe_first_token(0.1, num_cached_tokens=48)
    assert 'kvserve:router_prefix_hit_tokens_realised_total{model_name="m"} 48.0' in metrics.render([]).decode()


async def test_the_http_error_carries_retry_after() -> None:
    from router.routing.admission import shed_error
    from router.frontend.ingress import _api_error

    response = await _api_error(None, shed_error("full; retry after 3 s.", 3))  # type: ignore[arg-type]
    assert response.status_code == 429 and response.headers["retry-after"] == "3"
    plain = await _api_error(None, errors.bad_request("no"))  # type: ignore[arg-type]
    assert "retry-after" not in plain.headers


async def test_a_shed_request_holds_nothing_in_the_pipeline() -> None:
    from tests.unit.router.frontend.test_pipeline import KEY, holds_nothing, inputs, pipeline

    p, worker, limits = pipeline()
    p.admission = controller(Source(FULL), max_wait_s=0.01)
    busy = await p.admission.admit("other", [profile()])  # work ahead: the next one is judged
    with pytest.raises(errors.APIError) as e:
        await p.start(KEY, 1, 10, inputs(4, 3), "r", 0.0)
    assert e.value.status == 503 and holds_nothing(p, limits) and not worker.calls
    busy.release()
    stream = await p.start(KEY, 1, 10, inputs(4, 3), "r2", 0.0)  # idle again: it goes
    assert p.admission.num_in_flight == 1
    [e async for e in stream]
    assert p.admission.num_in_flight == 0 and holds_nothing(p, limits)


async def test_on_hold_is_called_only_when_the_request_waits() -> None:
    c = controller(Source(FULL))
    calls: list[str] = []
    first = await c.admit("k", [profile()], on_hold=lambda: calls.append("first"))
    assert calls == []  # admitted at once: it never waited
    held = asyncio.create_task(c.admit("k", [profile()], on_hold=lambda: calls.append("second")))
    await asyncio.sleep(0)  # let it reach the queue
    assert calls == ["second"] and not held.done()
    first.release()
    await held
    assert calls == ["second"]
