"""Request priority at the ingress (issue 30, "Priorities and fairness under overload"):
vLLM's `priority` body field and its gRPC twin, a per-key default band that is also the
best a key may ask for, held requests offered best band first, the worst band shed first,
and 429 (a tenant over its share) kept apart from 503 (no capacity for the band)."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from router import errors
from router.frontend.auth import ApiKeys, Principal, hash_key, key_id_of
from router.routing.admission import AdmissionController
from tests.unit.router.frontend.grpc_api.test_grpc_servicer import FakeIngress, collect, request
from tests.unit.router.frontend.test_pipeline import inputs
from tests.unit.router.routing.test_admission import NOW, Source, profile, report, snapshot

PREMIUM, BATCH = Principal(key_id_of(hash_key("premium"))), Principal(key_id_of(hash_key("batch")))
FULL = snapshot(report(waiting=4))


def fake(**settings: object) -> FakeIngress:
    ingress = FakeIngress(max_queued_requests=8, api_keys=ApiKeys([hash_key("premium"), hash_key("batch")]))
    ingress.pipeline.settings = dataclasses.replace(ingress.pipeline.settings, **settings)
    return ingress


async def test_a_keys_band_is_its_default_and_its_best() -> None:
    ingress = fake(key_priorities={PREMIUM.key_id: 0, BATCH.key_id: 10})
    pipeline = ingress.pipeline
    for principal, asked, band in ((BATCH, None, 10), (BATCH, 20, 20), (PREMIUM, None, 0), (PREMIUM, 5, 5)):
        stream = await pipeline.start(principal, 1, 10, inputs(4, 1), "r", 0.0, priority=asked)
        [e async for e in stream]
        assert ingress.worker.calls[-1].request.params.priority == band
    with pytest.raises(errors.APIError) as info:  # a batch key cannot jump the queue
        await pipeline.start(BATCH, 1, 10, inputs(4, 1), "r", 0.0, priority=0)
    assert info.value.status == 400 and pipeline.limiter.in_flight == 0


async def test_grpc_carries_priority() -> None:
    ingress = FakeIngress()  # keys off: any band
    await collect(ingress, request(prompt="hi", max_tokens=1, priority=3))
    assert ingress.worker.calls[-1].request.params.priority == 3


def controller(source: Source, queue_size: int = 4) -> AdmissionController:
    return AdmissionController(source, queue_size, 60.0, 4, None, poll_interval_s=3600.0, clock=lambda: NOW)


async def test_held_requests_go_best_band_first() -> None:
    source = Source(FULL)
    c = controller(source)
    await c.admit("k", [profile()])
    order: list[str] = []

    async def client(key: str, band: int) -> None:
        await c.admit(key, [profile()], band)
        order.append(key)

    tasks = [asyncio.create_task(client("batch", 10))]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(client("premium", 0)))
    await asyncio.sleep(0)
    # Blocks for one more beside the request in flight here (its pending admission counts).
    source.snap = snapshot(report(free=14, waiting=0))
    c.pump()
    await asyncio.wait(tasks, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    assert order == ["premium"] and c.queue.depth("batch") == 1
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_full_queue_sheds_the_worst_band_first_with_503() -> None:
    c = controller(Source(FULL), queue_size=2)
    await c.admit("k", [profile()])
    batch = [asyncio.create_task(c.admit(f"batch-{i}", [profile()], 10)) for i in range(2)]
    await asyncio.sleep(0)
    premium = asyncio.create_task(c.admit("premium", [profile()], 0))
    done, _ = await asyncio.wait(batch, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    (shed,) = done
    assert shed is batch[-1] and c.queue.depth("premium") == 1
    with pytest.raises(errors.APIError) as info:
        shed.result()
    assert info.value.status == 503 and info.value.retry_after_s >= 1  # not the tenant's fault
    with pytest.raises(errors.APIError) as info:  # a batch newcomer meets a queue of better work
        await c.admit("batch-2", [profile()], 10)
    assert info.value.status == 503
    for t in [*batch, premium]:
        t.cancel()
    await asyncio.gather(*batch, premium, return_exceptions=True)
