"""Issue 48, finding 10: run-time adapters are the cluster's. Two ingress replicas share
one real Redis (cluster/lora_registry.py): a load through one is served by the other, a
name cannot be loaded twice across them, the adapter bound counts the cluster, an unload
through one stops the other, a replica started afterwards serves what was loaded, and
with Redis down loads answer 503 while requests keep resolving the list read last."""
from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest

from cluster.state_store import RedisStoreSpec
from router.errors import APIError
from router.frontend import lora_modules
from router.frontend.auth import ApiKeys, hash_key
from router.frontend.ingress import Ingress
from router.frontend.key_limits import KeyLimits
from router.frontend.lora_policy import LoRAPolicy
from router.frontend.metrics import IngressMetrics
from router.frontend.pipeline import RequestPipeline
from router.frontend.settings import IngressSettings
from router.frontend.workers import Workers
from tests.security.test_lora_admin import ADMIN, Handle, Req, adapters, loader  # noqa: F401 -- fixtures
from tests.support.redis_server import RedisServer
from tests.unit.router.frontend.grpc_api.test_grpc_servicer import FakeTokenizer


def _ingress(loader: Any, spec: RedisStoreSpec, policy: LoRAPolicy, modules: tuple = ()) -> Ingress:
    settings = IngressSettings(served_model_name="tiny", tokenizer_path="/models/tiny", lora_enabled=True,
                               lora_policy=policy, lora_modules=modules, state_store=spec)
    handle = Handle(loader)
    ingress = object.__new__(Ingress)
    ingress.settings = settings
    ingress.pipeline = RequestPipeline(settings, Workers(handle, handle, settings.stats_timeout_s), FakeTokenizer(),
                                       IngressMetrics("tiny"), ApiKeys([], [hash_key(ADMIN)]), KeyLimits())
    return ingress


async def _status(coro: Coroutine[Any, Any, Any]) -> tuple[int, str]:
    try:
        response = await coro
    except APIError as e:
        return e.status, json.dumps(e.body())
    return response.status_code, response.body.decode()


def _load(ingress: Ingress, name: str, path: Path) -> Coroutine[Any, Any, Any]:
    return _status(ingress.load_lora_adapter(Req({"lora_name": name, "lora_path": str(path)}, ADMIN)))  # type: ignore[arg-type]


def _unload(ingress: Ingress, name: str) -> Coroutine[Any, Any, Any]:
    return _status(ingress.unload_lora_adapter(Req({"lora_name": name}, ADMIN)))  # type: ignore[arg-type]


async def _served(ingress: Ingress, name: str) -> bool:
    """What a request naming `name` meets: the refresh every POST endpoint does, then resolve."""
    await ingress.pipeline.lora.refresh(name)
    try:
        return ingress.pipeline.lora.resolve(name) is not None
    except APIError as e:
        assert e.status == 404
        return False


@pytest.fixture
def spec(redis_server: RedisServer) -> RedisStoreSpec:
    return RedisStoreSpec(url=redis_server.url, key_prefix=f"kvtest-{uuid.uuid4().hex[:8]}", password_env=None)


def test_adapters_are_shared_across_ingress_replicas(
    loader: Any, adapters: Path, spec: RedisStoreSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lora_modules, "REFRESH_S", 0.0)  # every request re-reads the version
    policy = LoRAPolicy(runtime_updates=True, adapter_roots=(str(adapters / "allowed"),), max_adapters=2)
    allowed = adapters / "allowed"

    async def run() -> None:
        a, b = _ingress(loader, spec, policy), _ingress(loader, spec, policy)
        assert (await _load(a, "x", allowed / "a"))[0] == 200
        assert await _served(b, "x")  # loaded through A, served by B
        status, body = await _load(b, "x", allowed / "b")  # B cannot replace A's adapter under its name
        assert status == 400 and "already been loaded" in body
        assert b.pipeline.lora.resolve("x") == a.pipeline.lora.resolve("x")
        assert (await _load(b, "y", allowed / "b"))[0] == 200
        status, body = await _load(a, "z", allowed / "a")  # the bound counts the cluster's adapters
        assert status == 400 and "at most 2" in body
        assert (await _unload(b, "x"))[0] == 200
        assert not await _served(a, "x")  # unloaded through B: gone from A too
        assert (await _unload(a, "x"))[0] == 404
        restarted = _ingress(loader, spec, policy)  # a replica started later serves what was loaded
        assert await _served(restarted, "y") and not await _served(restarted, "x")
        status, body = await _status(restarted.models(Req({}, ADMIN)))  # type: ignore[arg-type]
        assert status == 200 and '"y"' in body and '"x"' not in body

    asyncio.run(run())


def test_configured_adapters_cannot_be_unloaded_through_the_registry(
    loader: Any, adapters: Path, spec: RedisStoreSpec
) -> None:
    policy = LoRAPolicy(runtime_updates=True, adapter_roots=(str(adapters / "allowed"),))

    async def run() -> None:
        a = _ingress(loader, spec, policy, modules=(("conf", str(adapters / "allowed" / "a")),))
        status, body = await _unload(a, "conf")
        assert status == 400 and "lora.modules" in body
        assert await _served(a, "conf")

    asyncio.run(run())


def test_redis_down_refuses_changes_and_keeps_serving(
    loader: Any, adapters: Path, spec: RedisStoreSpec, redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(lora_modules, "REFRESH_S", 0.0)
    policy = LoRAPolicy(runtime_updates=True, adapter_roots=(str(adapters / "allowed"),))

    async def run() -> None:
        a = _ingress(loader, spec, policy)
        assert (await _load(a, "x", adapters / "allowed" / "a"))[0] == 200
        with redis_server.stopped():
            status, body = await _load(a, "y", adapters / "allowed" / "b")
            assert status == 503 and "adapter_registry_unavailable" in body
            assert (await _unload(a, "x"))[0] == 503
            assert await _served(a, "x")  # the list read last
        assert (await _load(a, "y", adapters / "allowed" / "b"))[0] == 200

    asyncio.run(run())
