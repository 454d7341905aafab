"""Many models behind one ingress (router/frontend/models/): a request's `model` picks its
model's pipeline (an adapter its base model's), a key limited to some models is told the
others do not exist, and gRPC routes the same way; each model over its own fake worker."""
from __future__ import annotations

import asyncio

import pytest

from protos.kvserve.v1 import kvserve_pb2 as pb
from router import errors
from router.frontend.auth import ANONYMOUS, ApiKeys, Principal, hash_key, key_id_of
from router.frontend.grpc_api.servicer import GrpcStatusError
from router.frontend.key_limits import KeyLimits
from router.frontend.metrics import IngressMetrics
from router.frontend.models.directory import ModelDirectory
from router.frontend.models.grpc_models import ModelsGrpc
from router.frontend.models.metrics_merge import render_models
from router.frontend.models.serving import ModelServing, serving_of
from router.frontend.pipeline import RequestPipeline
from router.frontend.settings import IngressSettings
from router.frontend.workers import Workers
from tests.unit.router.frontend.grpc_api.test_grpc_servicer import FakeContext, FakeTokenizer, FakeWorker, request

KEYS = {"all": "key-all", "chat-only": "key-chat"}
CHAT_ONLY = key_id_of(hash_key(KEYS["chat-only"]))


def serving(name: str, api_keys: ApiKeys, adapters: tuple[tuple[str, str], ...] = ()) -> tuple[ModelServing, FakeWorker]:
    settings = IngressSettings(served_model_name=name, tokenizer_path=f"/models/{name}", request_timeout_s=30.0,
                               lora_modules=adapters, lora_enabled=bool(adapters))
    worker = FakeWorker()
    pipeline = RequestPipeline(settings, Workers(worker, worker, settings.stats_timeout_s), FakeTokenizer(),
                               IngressMetrics(name), api_keys, KeyLimits())
    return serving_of(pipeline), worker


@pytest.fixture
def two() -> tuple[ModelDirectory, FakeWorker, FakeWorker]:
    keys = ApiKeys([hash_key(k) for k in KEYS.values()])
    chat, chat_worker = serving("chat", keys, adapters=(("sql", "/adapters/sql"),))
    coder, coder_worker = serving("org/coder", keys)
    return ModelDirectory([chat, coder], {CHAT_ONLY: ["chat"]}), chat_worker, coder_worker


def find(directory: ModelDirectory, model: str | None, principal: Principal = ANONYMOUS) -> str:
    return asyncio.run(directory.find(model, principal)).name


def test_a_request_goes_to_the_model_it_names(two: tuple[ModelDirectory, FakeWorker, FakeWorker]) -> None:
    directory, _, _ = two
    assert find(directory, "chat") == "chat"
    assert find(directory, "org/coder") == "org/coder"
    assert find(directory, "sql") == "chat"  # an adapter: its base model's pools
    assert find(directory, None) == "chat"  # no model: the first one


def test_an_unknown_model_is_404_model_not_found_listing_the_known_ones(two: tuple[ModelDirectory, FakeWorker, FakeWorker]) -> None:
    directory, _, _ = two
    with pytest.raises(errors.APIError) as e:
        find(directory, "gpt-4")
    assert (e.value.status, e.value.body()["error"]["code"]) == (404, "model_not_found")
    assert "`chat`, `sql`, `org/coder`" in e.value.message


def test_a_key_limited_to_a_model_is_told_the_others_do_not_exist(two: tuple[ModelDirectory, FakeWorker, FakeWorker]) -> None:
    directory, _, _ = two
    limited, unlimited = Principal(CHAT_ONLY), Principal(key_id_of(hash_key(KEYS["all"])))
    assert find(directory, "sql", limited) == "chat"
    with pytest.raises(errors.APIError) as refused:
        find(directory, "org/coder", limited)
    with pytest.raises(errors.APIError) as unknown:
        find(directory, "no-such-model", limited)
    # The same answer as for a model that does not exist, naming only what the key may use.
    assert refused.value.body()["error"]["code"] == unknown.value.body()["error"]["code"] == "model_not_found"
    assert refused.value.message.endswith("Known: `chat`, `sql`.")
    assert [s.name for s in directory.allowed(limited)] == ["chat"]
    assert [s.name for s in directory.allowed(unlimited)] == ["chat", "org/coder"]
    assert find(directory, "org/coder", unlimited) == "org/coder"
    coder_only = ModelDirectory(list(directory.servings.values()), {CHAT_ONLY: ["org/coder"]})
    assert find(coder_only, None, limited) == "org/coder"  # no model: the first one the key may use


def test_grpc_routes_by_the_request_model_with_the_same_key_limits(two: tuple[ModelDirectory, FakeWorker, FakeWorker]) -> None:
    directory, chat_worker, coder_worker = two
    grpc_models = ModelsGrpc(directory)
    everyone, limited = FakeContext([("authorization", f"Bearer {KEYS['all']}")]), FakeContext(
        [("authorization", f"Bearer {KEYS['chat-only']}")])

    async def run() -> None:
        answer = await grpc_models.Generate(request(model="org/coder", max_tokens=2), grpc_context=everyone)
        assert answer.model == "org/coder" and len(coder_worker.calls) == 1 and not chat_worker.calls
        streamed = [m async for m in grpc_models.GenerateStream(request(model="sql", max_tokens=2), grpc_context=everyone)]
        assert streamed and len(chat_worker.calls) == 1 and chat_worker.calls[0].request.lora_name == "sql"
        with pytest.raises(GrpcStatusError):
            await grpc_models.Generate(request(model="org/coder", max_tokens=2))  # no key at all
        refused = FakeContext(limited.invocation_metadata())
        await grpc_models.Generate(request(model="org/coder", max_tokens=2), grpc_context=refused)
        assert refused._code is not None and refused._code.name == "NOT_FOUND" and len(coder_worker.calls) == 1
        listed = await grpc_models.ListModels(pb.ListModelsRequest(), grpc_context=limited)
        assert [m.id for m in listed.models] == ["chat", "sql"]
        listed = await grpc_models.ListModels(pb.ListModelsRequest(), grpc_context=everyone)
        assert [m.id for m in listed.models] == ["chat", "sql", "org/coder"]
        stats = await grpc_models.Stats(pb.StatsRequest(), grpc_context=everyone)
        assert {r.pool for r in stats.replicas} == {"chat", "org/coder"} and stats.total_blocks == 80
        health = await grpc_models.Health(pb.HealthRequest(), grpc_context=everyone)
        assert health.status == pb.HealthResponse.STATUS_SERVING

    asyncio.run(run())


def test_metrics_of_several_models_are_one_exposition_labelled_by_model(two: tuple[ModelDirectory, FakeWorker, FakeWorker]) -> None:
    directory, _, _ = two
    metrics = [s.pipeline.metrics for s in directory.servings.values()]
    for m in metrics:
        m.observe_finished(0.5, 3, 4, "stop")
    text = render_models(metrics, [[], []]).decode()
    assert text.count("# TYPE kvserve:e2e_request_latency_seconds histogram") == 1
    assert 'kvserve:generation_tokens_total{model_name="chat"} 4.0' in text
    assert 'kvserve:generation_tokens_total{model_name="org/coder"} 4.0' in text
