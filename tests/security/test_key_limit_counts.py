"""Per-key limits (issue 48, finding 9). Before the fix a key limited to 4 engine requests in
flight could send one request of n=16 (`min(weight, limit)` took 4 slots for it), and a
slow or unreachable Redis silently fell back to per-replica counting (N x the limits with N
ingress replicas). Now a request is counted by its engine requests and refused beyond the
limit; an outage either refuses limited requests (503, `state.when_down: refuse`) or is
counted on this replica visibly: kvserve:limit_store_up 0, one decision counted per local
answer, and a warning."""
from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from cluster.config import KVServeConfig
from cluster.state_store import RedisStoreSpec
from router.errors import APIError
from router.frontend.key_limits import KeyLimits
from router.frontend.metrics import IngressMetrics

KEY = "0123456789ab"


async def test_a_request_is_counted_by_its_engine_requests() -> None:
    limits = KeyLimits(max_concurrent_requests=4)
    with pytest.raises(APIError) as info:
        await limits.acquire(KEY, weight=16)  # n=16 against a limit of 4
    assert info.value.status == 429 and "16 engine requests" in str(info.value)
    assert limits.store.in_flight(KEY) == 0  # type: ignore[attr-defined]
    lease = await limits.acquire(KEY, weight=4)
    assert len(lease.slots) == 4
    with pytest.raises(APIError):
        await limits.acquire(KEY, weight=1)
    lease.release()


@pytest.fixture
def hung_redis() -> Iterator[str]:
    """A server that accepts connections and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"


def _sample(metrics: IngressMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"model_name": "m", **labels})


def test_an_outage_is_counted_locally_and_shows(hung_redis: str, caplog: pytest.LogCaptureFixture) -> None:
    metrics = IngressMetrics("m")

    async def scenario() -> None:
        store = RedisStoreSpec(url=hung_redis, key_prefix="t", socket_timeout_s=0.1).build()
        store.observer = metrics
        metrics.limit_store_up(True)
        limits = KeyLimits(max_concurrent_requests=2, tokens_per_minute=600, store=store)
        lease = await limits.acquire(KEY)
        await lease.charge(10)
        assert not store.up
        lease.release()
        await store.aclose()

    with caplog.at_level(logging.WARNING, logger="cluster.state_store"):
        asyncio.run(scenario())
    assert _sample(metrics, "kvserve:limit_store_up") == 0
    assert _sample(metrics, "kvserve:limit_store_local_decisions_total", kind="concurrency") == 1
    assert _sample(metrics, "kvserve:limit_store_local_decisions_total", kind="tokens") == 1
    assert any("unreachable" in r.getMessage() for r in caplog.records)


def test_an_outage_can_refuse_limited_requests(hung_redis: str) -> None:
    async def scenario() -> list[Any]:
        store = RedisStoreSpec(url=hung_redis, key_prefix="t", socket_timeout_s=0.1, when_down="refuse").build()
        limits = KeyLimits(max_concurrent_requests=2, tokens_per_minute=600, store=store)
        errors = []
        for _ in range(2):  # the call that finds it down, and one after
            with pytest.raises(APIError) as info:
                await limits.acquire(KEY, weight=2)
            errors.append(info.value)
        assert store.local.in_flight(KEY) == 0
        await store.aclose()
        return errors

    for error in asyncio.run(scenario()):
        assert error.status == 503 and "redis" not in str(error).lower()


def test_the_config_carries_when_down() -> None:
    config = KVServeConfig.model_validate({"state": {"redis_url": "redis://r:6379/0", "when_down": "refuse"}})
    spec = config.redis_store_spec()
    assert spec is not None and spec.when_down == "refuse"
    with pytest.raises(ValueError):
        KVServeConfig.model_validate({"state": {"redis_url": "redis://r:6379/0", "when_down": "open"}})
