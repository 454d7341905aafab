"""Issue 48, findings 1, 2, 7 and 10 (adapters): the operator endpoints take an admin key,
run-time adapter updates are off unless configured, adapter directories are confined to
the configured roots, /v1/models shows ordinary keys names only, and loads are bounded
and deduplicated. The ingress's handlers run as Serve calls them, over a worker handle
whose check is the engine's own (Engine.check_lora on a real tiny model's loader)."""
from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from router.errors import APIError
from router.frontend.auth import ApiKeys, hash_key
from router.frontend.ingress import Ingress
from router.frontend.key_limits import KeyLimits
from router.frontend.lora_policy import LoRAPolicy
from router.frontend.metrics import IngressMetrics
from router.frontend.pipeline import RequestPipeline
from router.frontend.settings import IngressSettings
from router.frontend.workers import Workers
from tests.conftest import TinyModels
from tests.unit.router.frontend.grpc_api.test_grpc_servicer import FakeTokenizer, _Returning
from worker.config import LoRAConfig
from worker.engine.core import Engine
from worker.lora.engine_lora import EngineLoRA
from worker.lora.model_lora import adapter_loader
from worker.model.llama import LlamaArch
from worker.model_config import load_hf_config

USER, ADMIN = "user-key", "admin-key"


class Req:
    """What the handlers read of a Starlette request."""

    def __init__(self, body: dict[str, Any] | None = None, key: str | None = None) -> None:
        self._body = json.dumps(body or {}).encode()
        self.headers = {"authorization": f"Bearer {key}"} if key else {}

    async def stream(self) -> AsyncIterator[bytes]:
        yield self._body


class Handle:
    """A worker pool handle: check_lora is Engine.check_lora on a real adapter loader."""

    def __init__(self, loader: Any, delay_s: float = 0.0) -> None:
        engine = SimpleNamespace(lora=EngineLoRA(LoRAConfig(enable=True), loader))
        self.checks: list[str] = []
        self.resets = 0
        self.unloads: list[str] = []
        outer = self

        class _Check:
            def remote(self, name: str, path: str, roots: tuple[str, ...]) -> Awaitable[tuple[str, str]]:
                async def run() -> tuple[str, str]:
                    outer.checks.append(name)
                    await asyncio.sleep(delay_s)
                    return Engine.check_lora(engine, name, path, roots)  # type: ignore[arg-type]
                return run()

        self.check_lora = _Check()
        self.model_info = _Returning({"max_model_len": 64, "vocab_size": 256, "block_size": 16})
        self.stats = _Returning({"total_blocks": 100})

    def broadcast(self, method: str, *args: Any) -> Any:
        outer = self

        class _Results:
            async def results_async(self, timeout_s: float, return_exceptions: bool) -> list[Any]:
                if method == "unload_lora":  # the replica's unload_lora(name)
                    outer.unloads.append(args[0])
                    return [True]
                assert method == "reset_prefix_cache"
                outer.resets += 1
                return [None]

        return _Results()


@pytest.fixture(scope="module")
def loader(tiny_model: TinyModels) -> Any:
    base = tiny_model("llama")
    return adapter_loader(LlamaArch.from_hf_config(load_hf_config(base)), 16)


@pytest.fixture(scope="module")
def adapters(tiny_model: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """<root>/allowed/{a,b} (adapters), <root>/outside/c, and a symlink allowed/link -> outside/c."""
    from tests.support.tiny_lora import make_tiny_adapter

    root = tmp_path_factory.mktemp("lora-admin")
    base = tiny_model("llama")
    for sub, name, seed in (("allowed", "a", 0), ("allowed", "b", 1), ("outside", "c", 2)):
        make_tiny_adapter(base, root / sub / name, 4, targets=("q_proj",), seed=seed)
    os.symlink(root / "outside" / "c", root / "allowed" / "link")
    return root


def make_ingress(handle: Handle, policy: LoRAPolicy, keys: bool = True, modules: tuple = ()) -> Ingress:
    settings = IngressSettings(served_model_name="tiny", tokenizer_path="/models/tiny", lora_enabled=True,
                               lora_modules=modules, lora_policy=policy)
    api_keys = ApiKeys([hash_key(USER)], [hash_key(ADMIN)]) if keys else ApiKeys([])
    ingress = object.__new__(Ingress)
    ingress.settings = settings
    ingress.pipeline = RequestPipeline(settings, Workers(handle, handle, settings.stats_timeout_s), FakeTokenizer(),
                                       IngressMetrics("tiny"), api_keys, KeyLimits())
    return ingress


def call(coro: Awaitable[Any]) -> tuple[int, str]:
    """(status, body text) of a handler call: its response, or the APIError it raised."""
    async def run() -> Any:
        return await coro

    try:
        response = asyncio.run(run())
    except APIError as e:
        return e.status, json.dumps(e.body())
    return response.status_code, response.body.decode()


def load(ingress: Ingress, name: str, path: Path | str, key: str | None = ADMIN) -> tuple[int, str]:
    return call(ingress.load_lora_adapter(Req({"lora_name": name, "lora_path": str(path)}, key)))  # type: ignore[arg-type]


def open_policy(adapters: Path, **kw: Any) -> LoRAPolicy:
    return LoRAPolicy(runtime_updates=True, adapter_roots=(str(adapters / "allowed"),), **kw)


def test_operator_endpoints_need_an_admin_key(loader: Any, adapters: Path) -> None:
    """Finding 1 and 7: an ordinary key is 403 on load, unload and /reset_prefix_cache, no
    key 401; an admin key is served (and still serves requests as any key does)."""
    handle = Handle(loader)
    ingress = make_ingress(handle, open_policy(adapters))
    assert load(ingress, "a", adapters / "allowed" / "a", key=None)[0] == 401
    assert load(ingress, "a", adapters / "allowed" / "a", key=USER)[0] == 403
    assert handle.checks == []  # refused before any worker work
    assert load(ingress, "a", adapters / "allowed" / "a")[0] == 200
    unload = {"lora_name": "a"}
    assert call(ingress.unload_lora_adapter(Req(unload, USER)))[0] == 403  # type: ignore[arg-type]
    assert ingress.pipeline.lora.resolve("a") is not None  # tenant A's adapter is still there
    assert call(ingress.reset_prefix_cache(Req({}, USER)))[0] == 403  # type: ignore[arg-type]
    assert call(ingress.reset_prefix_cache(Req({}, None)))[0] == 401  # type: ignore[arg-type]
    assert handle.resets == 0
    assert call(ingress.reset_prefix_cache(Req({}, ADMIN)))[0] == 200  # type: ignore[arg-type]
    assert handle.unloads == []
    assert call(ingress.unload_lora_adapter(Req(unload, ADMIN)))[0] == 200  # type: ignore[arg-type]
    assert handle.unloads == ["a"]  # finding 3b: the unload reaches every worker replica
    assert call(ingress.version(Req({}, ADMIN)))[0] == 200  # type: ignore[arg-type]


def test_operator_endpoints_closed_without_keys(loader: Any, adapters: Path) -> None:
    """Auth off (no keys: the local default) opens the request paths, never the operator ones."""
    handle = Handle(loader)
    ingress = make_ingress(handle, open_policy(adapters), keys=False)
    assert call(ingress.reset_prefix_cache(Req({})))[0] == 403  # type: ignore[arg-type]
    assert load(ingress, "a", adapters / "allowed" / "a", key=None)[0] == 403
    assert handle.resets == 0 and handle.checks == []


def test_runtime_updates_off_by_default_even_with_lora_on(loader: Any, adapters: Path) -> None:
    """Finding 1: LoRA on (a configured adapter served) and an admin key, but no
    allow_runtime_updates: loads and unloads are refused, the configured adapter stays."""
    handle = Handle(loader)
    ingress = make_ingress(handle, LoRAPolicy(), modules=(("a", str(adapters / "allowed" / "a")),))
    status, body = load(ingress, "b", adapters / "allowed" / "b")
    assert status == 403 and "allow_runtime_updates" in body
    assert call(ingress.unload_lora_adapter(Req({"lora_name": "a"}, ADMIN)))[0] == 403  # type: ignore[arg-type]
    assert ingress.pipeline.lora.resolve("a") is not None and handle.checks == []


@pytest.mark.parametrize("path", ["allowed/../outside/c", "allowed/link", "outside/c", "relative"])
def test_adapter_paths_confined_to_roots(loader: Any, adapters: Path, path: str) -> None:
    """Finding 1: `..`, a symlink out of the root, a directory elsewhere and a relative path
    are 400s whose message names no path."""
    ingress = make_ingress(Handle(loader), open_policy(adapters))
    target = path if path == "relative" else str(adapters) + "/" + path
    status, body = load(ingress, "x", target)
    assert status == 400, body
    assert str(adapters) not in body
    assert ingress.pipeline.lora.adapters == {}


def test_models_shows_paths_to_admin_keys_only(loader: Any, adapters: Path) -> None:
    """Finding 1: /v1/models lists adapter names to every key, directories to admin keys only."""
    ingress = make_ingress(Handle(loader), open_policy(adapters))
    assert load(ingress, "a", adapters / "allowed" / "a")[0] == 200
    status, body = call(ingress.models(Req({}, USER)))  # type: ignore[arg-type]
    assert status == 200 and '"a"' in body
    assert str(adapters) not in body and "/models/tiny" not in body
    status, body = call(ingress.models(Req({}, ADMIN)))  # type: ignore[arg-type]
    assert str(adapters / "allowed" / "a") in body


def test_load_bounds_name_count_concurrency_timeout(loader: Any, adapters: Path) -> None:
    """Finding 2: a long name, one adapter too many, one concurrent load too many (429) and
    a check that takes too long (504) are refused; none is checked by a worker."""
    a, b = adapters / "allowed" / "a", adapters / "allowed" / "b"
    ingress = make_ingress(Handle(loader), open_policy(adapters, max_adapters=1))
    status, body = load(ingress, "n" * 10_000, a)
    assert status == 400 and "n" * 200 not in body
    assert load(ingress, "a", a)[0] == 200
    assert load(ingress, "b", b)[0] == 400  # max_adapters

    slow = Handle(loader, delay_s=0.3)
    ingress = make_ingress(slow, open_policy(adapters, max_concurrent_loads=1))

    async def two_names() -> list[Any]:
        return await asyncio.gather(ingress.load_lora_adapter(Req({"lora_name": "a", "lora_path": str(a)}, ADMIN)),
                                    ingress.load_lora_adapter(Req({"lora_name": "b", "lora_path": str(b)}, ADMIN)),
                                    return_exceptions=True)

    first, second = asyncio.run(two_names())
    assert first.status_code == 200 and isinstance(second, APIError) and second.status == 429
    assert slow.checks == ["a"]

    ingress = make_ingress(Handle(loader, delay_s=5), open_policy(adapters, load_timeout_s=0.1))
    assert load(ingress, "a", a)[0] == 504
    assert ingress.pipeline.lora.adapters == {}


def test_concurrent_loads_of_one_name_are_one_check(loader: Any, adapters: Path) -> None:
    """Finding 2: loads of one name at once pass no "already loaded" check twice: one worker
    check, every caller sees its result."""
    handle = Handle(loader, delay_s=0.2)
    ingress = make_ingress(handle, open_policy(adapters, max_concurrent_loads=1))
    body = {"lora_name": "a", "lora_path": str(adapters / "allowed" / "a")}

    async def burst() -> list[Any]:
        return await asyncio.gather(*(ingress.load_lora_adapter(Req(body, ADMIN)) for _ in range(5)))

    assert [r.status_code for r in asyncio.run(burst())] == [200] * 5
    assert handle.checks == ["a"]
    assert load(ingress, "a", adapters / "allowed" / "a")[0] == 400  # now it is loaded


def test_operator_check_helpers_fail_closed() -> None:
    """The scope itself: a key in the admin list is admin, one in the ordinary list is not,
    and a key in both lists counts once."""
    keys = ApiKeys([hash_key(USER), hash_key(ADMIN)], [hash_key(ADMIN)])
    assert len(keys) == 2
    assert keys.authenticate(f"Bearer {ADMIN}").admin
    assert not keys.authenticate(f"Bearer {USER}").admin
    assert not ApiKeys([]).authenticate(None).admin


def test_grpc_list_models_shows_paths_to_admin_keys_only(loader: Any, adapters: Path) -> None:
    """Finding 1 on gRPC: ListModels gives an ordinary key names, an admin key directories."""
    from router.frontend.grpc_api.servicer import GrpcServicer
    from tests.unit.router.frontend.grpc_api.test_grpc_servicer import FakeContext

    ingress = make_ingress(Handle(loader), LoRAPolicy(), modules=(("a", str(adapters / "allowed" / "a")),))
    servicer = GrpcServicer(ingress.pipeline)

    def listed(key: str) -> str:
        context = FakeContext([("authorization", f"Bearer {key}")])
        return str(asyncio.run(servicer.ListModels(None, context)))  # type: ignore[arg-type]

    assert str(adapters) not in listed(USER) and "/models/tiny" not in listed(USER)
    assert str(adapters / "allowed" / "a") in listed(ADMIN)


def test_config_defaults_are_closed() -> None:
    """As a new user starts the server: LoRA on, no runtime-update setting -> updates off;
    turning them on without roots is refused; the admin keys come from their own variable."""
    from cluster.config import KVServeConfig

    config = KVServeConfig.from_dict({"model": {"path": "/m"}, "lora": {"enable": True}})
    settings = config.ingress_settings()
    assert settings.lora_policy.runtime_updates is False and settings.lora_policy.adapter_roots == ()
    assert settings.admin_api_keys_env == "KVSERVE_ADMIN_API_KEYS" != settings.api_keys_env
    with pytest.raises(ValueError, match="adapter_roots"):
        KVServeConfig.from_dict({"model": {"path": "/m"}, "lora": {"allow_runtime_updates": True}})
    on = KVServeConfig.from_dict({"model": {"path": "/m"},
                                  "lora": {"allow_runtime_updates": True, "adapter_roots": ["/adapters"]}})
    assert on.ingress_settings().lora_policy == LoRAPolicy(runtime_updates=True, adapter_roots=("/adapters",))
