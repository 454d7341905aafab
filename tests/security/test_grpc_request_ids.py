"""gRPC request ids (issue 48, low): the client's `request_id` named the engine request as
sent, so another key reusing a victim's id while its request ran failed one of them ("request
id already in use", 400 or 500). Now each call's engine request runs under the client's id
plus a random suffix; the client still sees its own id in every response."""
from __future__ import annotations

import asyncio
import json

from router.frontend.auth import ApiKeys, hash_key
from router.frontend.grpc_api.servicer import engine_request_id
from tests.unit.router.frontend.grpc_api.test_grpc_servicer import FakeContext, FakeIngress, collect, request
from worker.api import SamplingParams
from worker.config import CacheConfig, EngineConfig, ModelConfig
from worker.default_model import default_model_path
from worker.engine.async_engine import AsyncEngine
from worker.engine.build import build_engine


def _context(key: str) -> FakeContext:
    return FakeContext([("authorization", f"Bearer {key}")])


async def test_two_keys_with_one_id_run_apart() -> None:
    ingress = FakeIngress(max_queued_requests=8, api_keys=ApiKeys([hash_key("victim"), hash_key("attacker")]))
    victim = await collect(ingress, request(max_tokens=2, request_id="job-1"), _context("victim"))
    attacker = await ingress.Generate(request(max_tokens=2, request_id="job-1"), grpc_context=_context("attacker"))
    assert {m.request_id for m in victim} == {"job-1"} and attacker.request_id == "job-1"
    engine_ids = [call.request.request_id for call in ingress.worker.calls]
    assert len(engine_ids) == 2 and len(set(engine_ids)) == 2
    assert all(i.startswith("job-1.") for i in engine_ids)


def test_the_engine_takes_both_at_once() -> None:
    """On one real engine, two in-flight requests from the same client id both finish."""
    config = EngineConfig(model=ModelConfig(model=str(default_model_path()), device="cpu", num_threads=1),
                          cache=CacheConfig(kv_cache_bytes=8 * 1024**2))
    engine = AsyncEngine(build_engine(config))

    async def one() -> str | None:
        last = None
        async for out in engine.generate([5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0),
                                         engine_request_id("job-1") + "-0"):
            last = out
        return last.finish_reason if last is not None else None

    async def both() -> list[str | None]:
        return list(await asyncio.gather(one(), one()))

    try:
        assert asyncio.run(both()) == ["length", "length"]
    finally:
        engine.shutdown()
    assert json.dumps(engine_request_id("")).startswith('"grpc-')
