"""Each key's share of an engine's running slots (issue 30): the ingress stamps every
engine request with its key and the key's weight (ingress.key_weights), which the
scheduler shares its slots by (tests/unit/worker/scheduling/test_scheduler_bands.py); a client cannot
set either."""
from __future__ import annotations

import dataclasses

import pytest

from router.frontend.auth import ApiKeys, Principal, hash_key, key_id_of
from tests.unit.router.frontend.grpc_api.test_grpc_servicer import FakeIngress
from tests.unit.router.frontend.test_pipeline import inputs
from worker.api import SamplingParams, SamplingParamsError

HEAVY, LIGHT = Principal(key_id_of(hash_key("heavy"))), Principal(key_id_of(hash_key("light")))


async def test_engine_requests_carry_their_key_and_its_weight() -> None:
    ingress = FakeIngress(api_keys=ApiKeys([hash_key("heavy"), hash_key("light")]))
    ingress.pipeline.settings = dataclasses.replace(ingress.pipeline.settings, key_weights={HEAVY.key_id: 3})
    for principal, weight in ((HEAVY, 3), (LIGHT, 1)):
        stream = await ingress.pipeline.start(principal, 1, 10, inputs(4, 1), "r", 0.0)
        [e async for e in stream]
        params = ingress.worker.calls[-1].request.params
        assert (params.tenant, params.tenant_weight) == (principal.key_id, weight)


async def test_a_client_cannot_choose_its_key_for_the_engine() -> None:
    ingress = FakeIngress(api_keys=ApiKeys([hash_key("light")]))
    own = inputs(4, 1)

    def forged(max_model_len: int) -> list:
        return [dataclasses.replace(i, params=dataclasses.replace(i.params, tenant=HEAVY.key_id, tenant_weight=9))
                for i in own(max_model_len)]

    stream = await ingress.pipeline.start(LIGHT, 1, 10, forged, "r", 0.0)
    [e async for e in stream]
    params = ingress.worker.calls[-1].request.params
    assert (params.tenant, params.tenant_weight) == (LIGHT.key_id, 1)


def test_weights_are_positive_integers() -> None:
    for bad in (0, -1, 1.5):
        with pytest.raises(SamplingParamsError):
            SamplingParams(tenant_weight=bad)  # type: ignore[arg-type]
    with pytest.raises(SamplingParamsError):
        SamplingParams(tenant="k" * 65)
