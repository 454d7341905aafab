"""Health probes (issue 48, low): /health and gRPC Health need no key, yet each call cost a
worker health check (a probe flood was a worker-call flood), and a 503's body showed the
worker's exception (its type and message: actor ids, addresses). Now both read one cached
verdict, refreshed at most once per HEALTH_MAX_AGE_S by a single check, and show a public
reason only; the exception goes to the log."""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest

from protos.kvserve.v1 import kvserve_pb2 as pb
from router.frontend.auth import ApiKeys, hash_key
from router.frontend.ingress import Ingress
from tests.unit.router.frontend.grpc_api.test_grpc_servicer import FakeIngress

SECRET = "ActorDiedError: actor 9f3c at 10.0.3.7:41235 died, see /tmp/ray/session_latest/logs"


class CountingCheck:
    """The fake worker's health check, counted, failing with internals when told to."""

    def __init__(self) -> None:
        self.calls = 0
        self.healthy = True

    def remote(self) -> Any:
        self.calls += 1

        async def check() -> None:
            await asyncio.sleep(0.01)
            if not self.healthy:
                raise RuntimeError(SECRET)

        return check()


def _ingress() -> tuple[Ingress, FakeIngress, CountingCheck]:
    fake = FakeIngress(api_keys=ApiKeys([hash_key("k1")]))
    check = CountingCheck()
    fake.worker.check_health = check
    ingress = object.__new__(Ingress)
    ingress.pipeline = fake.pipeline  # type: ignore[attr-defined]
    return ingress, fake, check


async def test_probes_share_one_cached_check() -> None:
    ingress, fake, check = _ingress()
    answers = await asyncio.gather(*(ingress.health() for _ in range(50)),
                                   *(fake.Health(pb.HealthRequest()) for _ in range(50)))
    for _ in range(50):  # and after, within the verdict's age
        answers.append(await ingress.health())
    assert check.calls == 1
    assert all(getattr(a, "status_code", None) == 200 or getattr(a, "status", None) == pb.HealthResponse.STATUS_SERVING
               for a in answers)


async def test_an_unhealthy_verdict_shows_no_internals(caplog: pytest.LogCaptureFixture) -> None:
    ingress, fake, check = _ingress()
    check.healthy = False
    with caplog.at_level(logging.WARNING):
        response = await ingress.health()
        grpc_health = await fake.Health(pb.HealthRequest())
    body = json.loads(response.body)
    assert response.status_code == 503 and body["error"]["message"] == "No healthy worker."
    assert grpc_health.status == pb.HealthResponse.STATUS_NOT_SERVING and grpc_health.message == "No healthy worker."
    assert "10.0.3.7" not in response.body.decode() and "ActorDied" not in grpc_health.message
    assert any("10.0.3.7" in r.getMessage() for r in caplog.records)  # the operator still sees it
    assert check.calls == 1


async def test_the_verdict_follows_the_workers_after_its_age() -> None:
    ingress, _, check = _ingress()
    ingress.pipeline.workers.health.max_age_s = 0.05
    assert (await ingress.health()).status_code == 200
    check.healthy = False
    assert (await ingress.health()).status_code == 200  # cached
    await asyncio.sleep(0.06)
    assert (await ingress.health()).status_code == 503 and check.calls == 2
