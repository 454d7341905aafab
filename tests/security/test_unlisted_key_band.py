"""A key not in `ingress.key_priorities` (issue 48, finding 8): before the fix it got band 0,
the best, so a newly added key preempted every listed tenant. Now it gets
`default_key_priority`, unset: the worst listed band, and may not ask for a better one."""
from __future__ import annotations

import dataclasses

import pytest

from cluster.config import ConfigError, KVServeConfig
from router import errors
from router.frontend.auth import ApiKeys, Principal, hash_key, key_id_of
from router.frontend.settings import IngressSettings
from tests.unit.router.frontend.grpc_api.test_grpc_servicer import FakeIngress
from tests.unit.router.frontend.test_pipeline import inputs

PREMIUM, BATCH, NEW = (Principal(key_id_of(hash_key(k))) for k in ("premium", "batch", "new"))


def fake(**settings: object) -> FakeIngress:
    ingress = FakeIngress(max_queued_requests=8, api_keys=ApiKeys([hash_key(k) for k in ("premium", "batch", "new")]))
    ingress.pipeline.settings = dataclasses.replace(ingress.pipeline.settings, **settings)
    return ingress


async def _band(ingress: FakeIngress, principal: Principal, asked: int | None = None) -> int:
    stream = await ingress.pipeline.start(principal, 1, 10, inputs(4, 1), "r", 0.0, priority=asked)
    [e async for e in stream]
    return ingress.worker.calls[-1].request.params.priority


async def test_an_unlisted_key_gets_the_worst_listed_band() -> None:
    ingress = fake(key_priorities={PREMIUM.key_id: 0, BATCH.key_id: 10})
    assert await _band(ingress, NEW) == 10
    assert await _band(ingress, NEW, 20) == 20
    with pytest.raises(errors.APIError) as info:  # nor may it ask for a better one
        await _band(ingress, NEW, 0)
    assert info.value.status == 400 and ingress.pipeline.limiter.in_flight == 0


async def test_the_unlisted_band_is_configurable() -> None:
    ingress = fake(key_priorities={PREMIUM.key_id: 0, BATCH.key_id: 10}, default_key_priority=50)
    assert await _band(ingress, NEW) == 50 and await _band(ingress, PREMIUM) == 0
    assert await _band(fake(), NEW) == 0  # nothing listed: every key is band 0


def test_the_config_carries_default_key_priority() -> None:
    config = KVServeConfig.model_validate({"ingress": {"key_priorities": {"abc": 3}, "default_key_priority": 7}})
    settings = config.ingress_settings()
    assert isinstance(settings, IngressSettings) and settings.unlisted_key_priority == 7
    assert KVServeConfig.model_validate({"ingress": {"key_priorities": {"abc": 3}}}).ingress_settings().unlisted_key_priority == 3
    with pytest.raises((ConfigError, ValueError)):
        KVServeConfig.model_validate({"ingress": {"default_key_priority": 10**9}})
