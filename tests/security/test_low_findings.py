"""Issue 48, low findings: a request without a valid key never takes an intake slot
(a stranger's flood cannot stall the intake of keyed requests); a flood of /metrics or
gRPC Stats calls costs the workers one stats broadcast at a time, not one per call;
the hold queue removes a waiter by identity (two equal waiters are two places, and no
comparison walks their token lists)."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import pytest

from router.errors import APIError
from router.frontend.auth import ApiKeys, hash_key
from router.frontend.ingress import Ingress
from router.frontend.key_limits import KeyLimits
from router.frontend.metrics import IngressMetrics
from router.frontend.pipeline import RequestPipeline
from router.frontend.settings import IngressSettings
from router.frontend.workers import Workers
from router.routing.fair_queue import FairQueue
from tests.security.test_lora_admin import Req
from tests.unit.router.frontend.grpc_api.test_grpc_servicer import FakeTokenizer


class _StatsHandle:
    """A worker handle whose stats broadcast takes a while and counts its calls."""

    def __init__(self) -> None:
        self.broadcasts = 0

    def broadcast(self, method: str, *args: Any) -> Any:
        assert method == "stats"
        outer = self

        class _Results:
            async def results_async(self, timeout_s: float, return_exceptions: bool) -> list[Any]:
                outer.broadcasts += 1
                await asyncio.sleep(0.05)
                return [{"total_blocks": 100, "replica": outer.broadcasts}]

        return _Results()


def test_concurrent_stats_calls_share_one_broadcast() -> None:
    handle = _StatsHandle()
    workers = Workers(handle, handle, stats_timeout_s=5.0)

    async def run() -> None:
        answers = await asyncio.gather(*(workers.stats() for _ in range(50)))
        assert handle.broadcasts == 1
        assert all(a == [{"total_blocks": 100, "replica": 1}] for a in answers)
        answers[0][0]["total_blocks"] = -1  # a caller's copy is its own
        assert answers[1][0]["total_blocks"] == 100
        assert await workers.stats() == [{"total_blocks": 100, "replica": 2}]  # the next call asks again

    asyncio.run(run())


def test_a_request_without_a_key_takes_no_intake_slot() -> None:
    settings = IngressSettings(served_model_name="tiny", tokenizer_path="/models/tiny", intake_window=1)
    handle = _StatsHandle()
    ingress = object.__new__(Ingress)
    ingress.settings = settings
    ingress.pipeline = RequestPipeline(settings, Workers(handle, handle, 5.0), FakeTokenizer(),
                                       IngressMetrics("tiny"), ApiKeys([hash_key("k")]), KeyLimits())
    intake = ingress.pipeline.intake

    async def run() -> None:
        async with intake.slot():  # the window's one slot is busy: a keyed request would queue
            for handler in (ingress.completions, ingress.chat_completions):
                with pytest.raises(APIError) as e:
                    await asyncio.wait_for(handler(Req({"model": "tiny", "prompt": "x"}, "wrong")), 1.0)  # type: ignore[arg-type]
                assert e.value.status == 401
            assert intake.num_waiting == 0 and intake.num_held == 1

    asyncio.run(run())


@dataclass
class _Waiter:
    prompt: list[int]


def test_hold_queue_removes_the_waiter_itself() -> None:
    queue = FairQueue(capacity=4)
    first, second = _Waiter([1, 2, 3]), _Waiter([1, 2, 3])
    assert first == second
    queue.push("k", first)
    queue.push("k", second)
    assert queue.remove("k", second)
    assert queue.pop() is first  # the equal one that stayed is the first
    assert not queue.remove("k", second)


def test_hold_queue_remove_compares_no_fields() -> None:
    class Loud:
        def __eq__(self, other: object) -> bool:
            raise AssertionError("remove compared items by value")

        __hash__ = object.__hash__

    queue = FairQueue(capacity=4)
    a, b = Loud(), Loud()
    queue.push("k", a)
    queue.push("k", b)
    assert queue.remove("k", b) and json.dumps(len(queue)) == "1"


def test_an_unauthenticated_or_plaintext_redis_is_named_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    from cluster.state_store import RedisStoreSpec, exposure_warning

    monkeypatch.delenv("KV_TEST_REDIS_PW", raising=False)
    remote = RedisStoreSpec(url="redis://redis.kv.svc:6379/0", key_prefix="p", password_env="KV_TEST_REDIS_PW")
    warning = exposure_warning(remote)
    assert warning is not None and "no password" in warning and "rediss://" in warning
    monkeypatch.setenv("KV_TEST_REDIS_PW", "s3cret")
    warning = exposure_warning(remote)
    assert warning is not None and "no password" not in warning and "s3cret" not in warning
    assert exposure_warning(RedisStoreSpec(url="rediss://redis.kv.svc:6380/0", key_prefix="p",
                                           password_env="KV_TEST_REDIS_PW")) is None
    assert exposure_warning(RedisStoreSpec(url="redis://127.0.0.1:6379/0", key_prefix="p",
                                           password_env="KV_TEST_REDIS_PW")) is None
