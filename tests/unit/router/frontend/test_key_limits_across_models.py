"""A key's limits are one budget across every model of the ingress: the servings an ingress
replica builds (router/frontend/models/serving.py's build_servings, as Ingress.__init__ calls
it) share the per-key counts, and cluster/app.py counts them under the app's Redis prefix,
not a model's namespace."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cluster.app import app_builder
from router import errors
from router.frontend.auth import ApiKeys, Principal
from router.frontend.models.pools import ModelPools
from router.frontend.models.serving import build_servings
from router.frontend.settings import IngressSettings
from tests.unit.cluster.test_models_config import TWO
from tests.unit.router.frontend.grpc_api.test_grpc_servicer import FakeWorker
from worker.default_model import default_model_path


class Handle(FakeWorker):
    """The worker stand-in as a DeploymentHandle: options() gives itself."""

    def options(self, **_: Any) -> Handle:
        return self


def settings_of(name: str) -> IngressSettings:
    return IngressSettings(served_model_name=name, tokenizer_path=str(default_model_path()),
                           max_concurrent_requests_per_key=2, tokens_per_minute_per_key=1000)


def test_a_keys_concurrency_and_tokens_are_one_budget_across_models() -> None:
    chat, coder = build_servings([ModelPools(settings_of("chat"), Handle()), ModelPools(settings_of("coder"), Handle())],
                                 ApiKeys([]), "ingress-0")
    assert chat.pipeline.key_limits is coder.pipeline.key_limits
    key = Principal("0123456789ab")

    async def scenario() -> None:
        on_chat = await chat.pipeline.admit(key, 1)
        on_coder = await coder.pipeline.admit(key, 1)
        with pytest.raises(errors.APIError) as third:  # the key's 2 slots are taken, one per model
            await chat.pipeline.admit(key, 1)
        assert third.value.code == "concurrency_limit_exceeded"
        await on_chat.lease.charge(600)
        with pytest.raises(errors.APIError) as tokens:  # 600 of 1000 went to chat
            await on_coder.lease.charge(600)
        assert tokens.value.code == "tokens_per_minute_exceeded"
        on_chat.settle(100)  # chat used 100: 500 come back, for either model
        on_chat.release()
        await on_coder.lease.charge(600)
        on_coder.release()
        again = await coder.pipeline.admit(key, 2)  # both slots free again
        again.release()

    asyncio.run(scenario())


def test_the_app_counts_key_limits_under_its_own_prefix_not_a_models() -> None:
    app = app_builder(TWO)
    settings = app._bound_deployment.init_args[1]
    [coder] = app._bound_deployment.init_kwargs["other_models"]
    assert settings.key_limits_store.key_prefix == "kvserve:kvserve"
    # Each model's own store (its run-time adapters) stays in its namespace.
    assert settings.state_store.key_prefix == "kvserve:kvserve:model:chat"
    assert coder.settings.state_store.key_prefix == "kvserve:kvserve:model:org-coder"
