"""Per-tenant limits (issue 30, "Exposure and limits"): a key's token charge is refunded
whenever a request ends before the engine ran, its concurrency is counted in engine
requests, a request's prompts are capped, and tokenizing (/tokenize, gRPC Tokenize) sits
inside the limits."""
from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from router import errors
from router.frontend.auth import ApiKeys, Principal, hash_key, key_id_of
from router.frontend.ingress import Ingress
from router.frontend.key_limits import KeyLimits
from router.routing.admission import shed_error
from protos.kvserve.v1 import kvserve_pb2 as pb
from tests.unit.router.frontend.grpc_api.test_grpc_servicer import FakeContext, FakeIngress
from tests.unit.router.frontend.test_pipeline import inputs

KEY = Principal(key_id_of(hash_key("k1")))
TOKENS_PER_MINUTE = 1000


def limited(max_concurrent: int | None = None, max_queued_requests: int = 64) -> tuple[FakeIngress, KeyLimits]:
    limits = KeyLimits(max_concurrent, TOKENS_PER_MINUTE, clock=lambda: 0.0)  # a still clock: exact levels
    return FakeIngress(max_queued_requests=max_queued_requests, api_keys=ApiKeys([hash_key("k1")]), key_limits=limits), limits


def tokens_left(limits: KeyLimits) -> float:
    return limits.store.tokens_left(KEY.key_id, TOKENS_PER_MINUTE)  # type: ignore[attr-defined]


async def test_a_request_shed_by_admission_control_gets_its_tokens_back() -> None:
    # Finding: a request shed at admission (hold queue full or timed out) kept its
    # tokens-per-minute charge: the permit was released, never settled.
    fake, limits = limited()
    pipeline = fake.pipeline

    async def shed(key: str, profiles: Any, band: int = 0, on_hold: Any = None) -> Any:
        raise shed_error("The server's admission queue is full", 1)

    pipeline.admission.admit = shed  # type: ignore[method-assign]
    with pytest.raises(errors.APIError) as info:
        await pipeline.start(KEY, 1, 10, inputs(4, 300), "r", 0.0)
    assert info.value.status == 429
    assert tokens_left(limits) == TOKENS_PER_MINUTE and pipeline.limiter.in_flight == 0


async def test_a_keys_concurrency_counts_engine_requests() -> None:
    # Finding: a request with n x prompts engine requests used one per-key slot, so one
    # key could take the replica's whole in-flight share.
    fake, limits = limited(max_concurrent=4)
    pipeline = fake.pipeline
    stream = await pipeline.start(KEY, 3, 10, inputs(4, 1, n=3), "r", 0.0)
    with pytest.raises(errors.APIError) as info:  # 3 of the key's 4 engine requests are in flight
        await pipeline.start(KEY, 2, 10, inputs(4, 1, n=2), "r2", 0.0)
    assert info.value.status == 429 and pipeline.limiter.in_flight == 3
    [e async for e in stream]
    assert limits.store.in_flight(KEY.key_id) == 0  # type: ignore[attr-defined]
    second = await pipeline.start(KEY, 2, 10, inputs(4, 1, n=2), "r2", 0.0)
    assert limits.store.in_flight(KEY.key_id) == 2  # type: ignore[attr-defined]
    [e async for e in second]


class Body:
    def __init__(self, data: dict[str, Any], authorization: str = "Bearer k1") -> None:
        self._body = json.dumps(data).encode()
        self.headers = {"authorization": authorization}

    async def stream(self) -> AsyncIterator[bytes]:
        yield self._body


def ingress_over(fake: FakeIngress, **settings: Any) -> Any:
    ingress = object.__new__(Ingress)
    ingress.pipeline = fake.pipeline  # type: ignore[attr-defined]
    ingress.settings = dataclasses.replace(fake.pipeline.settings, **settings)  # type: ignore[attr-defined]
    return ingress


async def test_prompts_per_request_are_capped() -> None:
    # Finding: one completions request could carry up to 1,024 prompts.
    fake, _ = limited()
    ingress = ingress_over(fake, max_prompts_per_request=4)
    with pytest.raises(errors.APIError) as info:
        await ingress.completions(Body({"model": "tiny", "prompt": ["a"] * 5, "max_tokens": 1}))
    assert info.value.status == 400 and "prompts" in info.value.message
    assert fake.pipeline.limiter.in_flight == 0


async def test_tokenize_is_inside_the_keys_limits() -> None:
    # Finding: /tokenize rendered a chat template over up to the body cap outside every
    # limit (no key slot, no in-flight share).
    fake, limits = limited(max_concurrent=1)
    ingress = ingress_over(fake)
    held = await fake.pipeline.start(KEY, 1, 10, inputs(4, 1), "held", 0.0)  # the key's one slot
    with pytest.raises(errors.APIError) as info:
        await ingress.tokenize(Body({"model": "tiny", "prompt": "hello"}))
    assert info.value.status == 429
    [e async for e in held]
    ok = await ingress.tokenize(Body({"model": "tiny", "prompt": "hello"}))
    assert ok.status_code == 200 and json.loads(ok.body)["count"] > 0
    assert limits.store.in_flight(KEY.key_id) == 0 and fake.pipeline.limiter.in_flight == 0  # type: ignore[attr-defined]


async def test_grpc_tokenize_is_inside_the_keys_limits() -> None:
    # Finding: gRPC Tokenize skipped the limits HTTP /tokenize sits inside.
    import grpc

    fake, limits = limited(max_concurrent=1)
    held = await fake.pipeline.start(KEY, 1, 10, inputs(4, 1), "held", 0.0)  # the key's one slot
    context = FakeContext([("authorization", "Bearer k1")])
    refused = await fake.Tokenize(pb.TokenizeRequest(prompt="hello"), grpc_context=context)
    assert context.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and refused.count == 0
    [e async for e in held]
    ok = await fake.Tokenize(pb.TokenizeRequest(prompt="hello"), grpc_context=FakeContext([("authorization", "Bearer k1")]))
    assert ok.count > 0
    assert limits.store.in_flight(KEY.key_id) == 0 and fake.pipeline.limiter.in_flight == 0  # type: ignore[attr-defined]
