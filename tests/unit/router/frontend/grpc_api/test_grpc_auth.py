"""The gRPC servicer's API-key check (router/frontend/grpc_api/servicer.py + router/frontend/auth.py), on the
unit tests' fake ingress: UNAUTHENTICATED without the metadata, Health open."""
from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import grpc

from protos.kvserve.v1 import kvserve_pb2 as pb
from router.frontend.auth import ApiKeys
from router.frontend.key_limits import KeyLimits
from tests.unit.router.frontend.grpc_api.test_grpc_servicer import FakeContext, FakeIngress

KEY = "unit-key-1"


class Context(FakeContext):
    def __init__(self, metadata: list[tuple[str, str]]) -> None:
        super().__init__()
        self._metadata = metadata

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self._metadata


def ingress() -> FakeIngress:
    return FakeIngress(api_keys=ApiKeys([hashlib.sha256(KEY.encode()).digest()]), key_limits=KeyLimits())


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_unary_rpcs_need_the_key() -> None:
    host = ingress()
    for metadata in ([], [("authorization", "Bearer nope")], [("authorization", KEY)]):
        for call in (
            lambda c: host.Tokenize(pb.TokenizeRequest(prompt="hi"), grpc_context=c),
            lambda c: host.ListModels(pb.ListModelsRequest(), grpc_context=c),
            lambda c: host.Stats(pb.StatsRequest(), grpc_context=c),
            lambda c: host.Generate(pb.GenerateRequest(prompt="hi", max_tokens=2), grpc_context=c),
        ):
            context = Context(metadata)
            run(call(context))
            assert context.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
    context = Context([("authorization", f"Bearer {KEY}")])
    assert run(host.ListModels(pb.ListModelsRequest(), grpc_context=context)).models[0].id == "tiny"
    assert context.code() is None


def test_health_is_open() -> None:
    host = ingress()
    context = Context([])
    assert run(host.Health(pb.HealthRequest(), grpc_context=context)).status == pb.HealthResponse.STATUS_SERVING
    assert context.code() is None


def test_no_keys_no_check() -> None:
    host = FakeIngress()  # no keys configured: auth off
    context = Context([])
    assert run(host.ListModels(pb.ListModelsRequest(), grpc_context=context)).models
    assert context.code() is None
