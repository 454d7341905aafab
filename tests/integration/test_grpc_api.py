"""kvserve's gRPC API end to end: a real grpcio client -> Ray Serve's gRPC proxy -> the
ingress (router.frontend.grpc_api.servicer: GrpcMethods -> GrpcServicer) -> a worker replica running a tiny model.

The app is cluster.app.build_app's, deployed on the session's Serve instance, whose
proxy registers the KVServe service through router.frontend.grpc_api.proxy (tests/integration/conftest.py
via cluster.app.grpc_servicer).

Waits poll worker stats through a DeploymentHandle with a deadline; nothing sleeps to
synchronise.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import ray
import grpc
from ray import serve  # noqa: E402

from cluster import grpc_cli  # noqa: E402
from cluster.app import INGRESS_DEPLOYMENT, WORKER_DEPLOYMENT, build_app, ingress_options, ingress_settings  # noqa: E402
from cluster.config import KVServeConfig  # noqa: E402
from protos.kvserve.v1 import kvserve_pb2 as pb  # noqa: E402
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc  # noqa: E402
from router.frontend.grpc_api.client import KVServeClient, KVServeError  # noqa: E402
from router.frontend.grpc_api.proxy import GRPC_SERVICER  # noqa: E402
from router.frontend.grpc_api.servicer import GrpcMethods  # noqa: E402
from router.serve_internals import grpc_servicer_functions  # noqa: E402
from router.frontend.ingress import Ingress  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402
from worker.engine.async_engine import EngineDeadError  # noqa: E402
from worker.api import GenerateRequest  # noqa: E402

pytestmark = pytest.mark.integration

APP = "grpc-api"
DEAD_APP = "grpc-dead"
MODEL = "tiny-grpc"
DEAD_MODEL = "tiny-dead"  # another name, so that a call the proxy misroutes is NOT_FOUND
MAX_MODEL_LEN = 1024
NUM_BLOCKS = 128
BLOCK_SIZE = 16
MAX_IN_FLIGHT = 2  # the ingress bound (max_queued_requests); small, to test overload
RPC_TIMEOUT_S = 60.0
WAIT_S = 60.0  # every wait below (tests/integration/waiting.py), polled every 0.05 s


@dataclass
class GrpcApp:
    target: str
    channel: Any  # grpc.Channel
    stub: Any  # KVServeStub
    worker: Any  # DeploymentHandle of the worker deployment
    tokenizer: Any
    model_dir: Path

    metadata: tuple[tuple[str, str], ...] = (("application", APP),)

    def call(self, method: str, request: Any, **kwargs: Any) -> Any:
        return getattr(self.stub, method)(request, metadata=self.metadata, timeout=RPC_TIMEOUT_S, **kwargs)

    def stream(self, request: Any) -> Any:
        return self.stub.GenerateStream(request, metadata=self.metadata, timeout=RPC_TIMEOUT_S)

    def worker_stats(self) -> dict[str, Any]:
        return self.worker.stats.remote().result(timeout_s=30)

    def wait_idle(self) -> dict[str, Any]:
        """Until the worker holds no request and every KV block is free again."""

        def idle() -> dict[str, Any] | None:
            s = self.worker_stats()
            done = s["num_running"] == 0 and s["num_waiting"] == 0 and s["free_blocks"] == s["total_blocks"]
            return s if done else None

        return wait_until(idle, WAIT_S, message="the worker to be idle with all KV blocks free")

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text).input_ids)


def tiny_config(model_dir: Path) -> KVServeConfig:
    return KVServeConfig.from_dict(
        {
            "app_name": APP,
            "route_prefix": f"/{APP}",
            "model": {"path": str(model_dir), "served_model_name": MODEL},
            "engine": {
                "num_blocks": NUM_BLOCKS,
                "block_size": BLOCK_SIZE,
                "max_model_len": MAX_MODEL_LEN,
                "max_num_seqs": 8,
                "device": "cpu",
                "num_threads": 1,
            },
            "workers": {"num_replicas": 1, "num_cpus": 1},
            "ingress": {"max_queued_requests": MAX_IN_FLIGHT, "num_cpus": 0.5, "request_timeout_s": 120},
        }
    )


@pytest.fixture(scope="module")
def served_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.tiny_served_model import make_served_model

    return make_served_model(tmp_path_factory.mktemp("grpc-model") / MODEL)


@pytest.fixture(scope="module")
def app(serve_cluster: Any, served_model_dir: Path) -> Iterator[GrpcApp]:
    from transformers import AutoTokenizer

    serve.run(build_app(tiny_config(served_model_dir)), name=APP, route_prefix=f"/{APP}")
    target = f"127.0.0.1:{serve_cluster.grpc_port}"
    channel = grpc.insecure_channel(target)
    grpc_app = GrpcApp(
        target=target,
        channel=channel,
        stub=pb_grpc.KVServeStub(channel),
        worker=serve.get_deployment_handle(WORKER_DEPLOYMENT, app_name=APP),
        tokenizer=AutoTokenizer.from_pretrained(served_model_dir),
        model_dir=served_model_dir,
    )

    def routed() -> bool:
        # The proxy learns of new applications asynchronously; while it knows a single
        # other one, it sends every call there whatever the "application" metadata says.
        try:
            return [m.id for m in grpc_app.call("ListModels", pb.ListModelsRequest()).models] == [MODEL]
        except grpc.RpcError:
            return False

    wait_until(routed, WAIT_S, message="the gRPC proxy to route to the application")
    try:
        yield grpc_app
    finally:
        channel.close()
        serve.delete(APP)


def greedy(prompt: str | None = None, max_tokens: int = 12, **kwargs: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        model=MODEL, prompt=prompt or "", max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs
    )


def long_request(app: GrpcApp, **kwargs: Any) -> pb.GenerateRequest:
    """A request that would run for many seconds: ~900 tokens, EOS ignored."""
    prompt = "Paged attention stores keys and values in fixed-size blocks. " * 6
    max_tokens = MAX_MODEL_LEN - len(app.ids(prompt)) - 1
    return greedy(prompt, max_tokens=max_tokens, **kwargs)


def rpc_error(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if not isinstance(result, pb.GenerateResponse | pb.TokenizeResponse):
            list(result)  # a stream: errors arrive while iterating
    return info.value


# -- the happy paths ----------------------------------------------------------------------------
def test_list_models_health_and_tokenize(app: GrpcApp) -> None:
    assert issubclass(Ingress, GrpcMethods)  # without it, the proxy finds no method
    [model] = app.call("ListModels", pb.ListModelsRequest()).models
    assert model.id == MODEL and model.max_model_len == MAX_MODEL_LEN
    assert model.vocab_size == len(app.tokenizer) and model.block_size == BLOCK_SIZE
    health = app.call("Health", pb.HealthRequest())
    assert health.status == pb.HealthResponse.STATUS_SERVING

    text = "Hello world! The quick brown fox."
    tokens = app.call("Tokenize", pb.TokenizeRequest(prompt=text, return_token_strings=True))
    assert list(tokens.token_ids) == app.ids(text) and tokens.count == len(app.ids(text))
    assert tokens.max_model_len == MAX_MODEL_LEN
    assert "".join(tokens.tokens[1:]) == text  # after BOS, the per-token texts add up
    messages = [pb.ChatMessage(role="user", content="What is the capital of France?")]
    chat = app.call("Tokenize", pb.TokenizeRequest(messages=messages))
    rendered = app.tokenizer.apply_chat_template(
        [{"role": "user", "content": messages[0].content}], tokenize=False, add_generation_prompt=True
    )
    assert list(chat.token_ids) == list(app.tokenizer(rendered, add_special_tokens=False).input_ids)


def test_generate_and_stream_agree(app: GrpcApp) -> None:
    prompt = "Once upon a time there was"
    before = time.time()
    unary = app.call("Generate", greedy(prompt, max_tokens=12, logprobs=2, request_id="unary-1"))
    after = time.time()
    assert unary.request_id == "unary-1" and unary.model == MODEL
    assert len(unary.token_ids) == 12 and unary.finish_reason == pb.FINISH_REASON_LENGTH
    assert unary.usage.prompt_tokens == len(app.ids(prompt)) and unary.usage.completion_tokens == 12
    assert unary.text == app.tokenizer.decode(list(unary.token_ids), skip_special_tokens=True)
    assert [lp.token_id for lp in unary.logprobs] == list(unary.token_ids)
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0.0 for lp in unary.logprobs)
    assert before <= unary.timing.arrival_time <= after
    assert 0 < unary.timing.time_to_first_token_s <= unary.timing.elapsed_s

    messages = list(app.stream(greedy(prompt, max_tokens=12, logprobs=2, request_id="stream-1")))
    assert {m.request_id for m in messages} == {"stream-1"}
    assert [t for m in messages for t in m.token_ids] == list(unary.token_ids)
    assert "".join(m.text for m in messages) == unary.text
    assert [lp.token_id for m in messages for lp in m.logprobs] == list(unary.token_ids)
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED and not m.HasField("usage") for m in messages[:-1])
    last = messages[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.usage.completion_tokens == 12
    assert 0 < last.timing.time_to_first_token_s <= last.timing.elapsed_s
    app.wait_idle()


def test_token_ids_chat_stop_and_seed(app: GrpcApp) -> None:
    prompt = "The capital of France is"
    by_text = app.call("Generate", greedy(prompt, max_tokens=8))
    by_ids = app.call("Generate", greedy(max_tokens=8, prompt_token_ids=app.ids(prompt)))
    assert list(by_ids.token_ids) == list(by_text.token_ids)
    assert by_ids.usage.cached_prompt_tokens >= BLOCK_SIZE or len(app.ids(prompt)) < BLOCK_SIZE

    stop_id = by_text.token_ids[3]
    cut = list(by_text.token_ids).index(stop_id) + 1
    stopped = app.call("Generate", greedy(prompt, max_tokens=8, stop_token_ids=[stop_id]))
    assert list(stopped.token_ids) == list(by_text.token_ids)[:cut]
    assert stopped.finish_reason == pb.FINISH_REASON_STOP
    assert stopped.WhichOneof("stop_reason") == "stop_token_id" and stopped.stop_token_id == stop_id

    chat = app.call(
        "Generate",
        pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="Hello")], max_tokens=6, temperature=0.0, ignore_eos=True),
    )
    assert chat.model == MODEL and len(chat.token_ids) == 6

    seeded = pb.GenerateRequest(prompt=prompt, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    assert list(app.call("Generate", seeded).token_ids) == list(app.call("Generate", seeded).token_ids)


def test_echo_and_prompt_logprobs(app: GrpcApp) -> None:
    """echo puts the prompt before the text; prompt_logprobs (or echo with logprobs) give
    one entry per prompt token, the first without a logprob; the stream carries them in
    each choice's first message. Values are HF-exact in tests/unit/worker/sampling/test_prompt_logprobs_vs_hf.py."""
    prompt = "Echo this prompt back"
    ids = app.ids(prompt)
    plain = app.call("Generate", greedy(prompt, max_tokens=5))
    unary = app.call("Generate", greedy(prompt, max_tokens=5, echo=True, logprobs=2))
    assert unary.text == prompt + plain.text and list(unary.token_ids) == list(plain.token_ids)
    entries = unary.prompt_logprobs
    assert [e.token_id for e in entries] == ids
    assert not entries[0].HasField("logprob") and entries[0].rank == 0
    assert all(e.HasField("logprob") and e.logprob <= 0 and e.rank >= 1 and len(e.top_logprobs) == 2 for e in entries[1:])
    assert unary.usage.cached_prompt_tokens == 0  # prompt logprobs never read the prefix cache
    messages = list(app.stream(greedy(prompt, max_tokens=5, echo=True, logprobs=2)))
    assert "".join(m.text for m in messages) == unary.text and messages[0].text.startswith(prompt)
    assert [e.logprob for e in messages[0].prompt_logprobs[1:]] == pytest.approx([e.logprob for e in entries[1:]], abs=1e-6)
    assert all(not m.prompt_logprobs for m in messages[1:])
    chat = app.call("Generate", pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content="Hi")], max_tokens=2, temperature=0.0, prompt_logprobs=1, n=2,
    ))
    assert len(chat.prompt_logprobs) == chat.usage.prompt_tokens
    assert all(len(c.prompt_logprobs) == chat.usage.prompt_tokens for c in chat.choices)
    assert all(len(e.top_logprobs) == 1 for e in chat.prompt_logprobs[1:])
    error = rpc_error(lambda: app.call("Generate", pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="Hi")], echo=True)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "echo" in error.details()
    app.wait_idle()


def test_structured_outputs(app: GrpcApp) -> None:
    import json
    import re

    def constrained(max_tokens: int = 40, **constraint: Any) -> str:
        return app.call("Generate", pb.GenerateRequest(prompt="Answer:", max_tokens=max_tokens, temperature=0.0, **constraint)).text

    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", constrained(regex=r"[0-9]{3}-[a-z]{2}"))
    assert constrained(choice=pb.Choices(choices=["yes", "no", "maybe"])) in {"yes", "no", "maybe"}
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    value = json.loads(constrained(json_schema=json.dumps(schema)))
    assert set(value) == {"n"} and 3 <= value["n"] <= 9
    assert isinstance(json.loads(constrained(json_object=True, max_tokens=200)), dict)
    for bad in ({"regex": "("}, {"json_schema": "{not json"}):
        error = rpc_error(lambda bad=bad: app.call("Generate", pb.GenerateRequest(prompt="x", **bad)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    app.wait_idle()


def test_stats(app: GrpcApp) -> None:
    stats = app.call("Stats", pb.StatsRequest())
    [replica] = stats.replicas
    worker = app.worker_stats()
    assert replica.replica_id == worker["replica_id"]
    assert replica.total_blocks == NUM_BLOCKS and replica.block_size == BLOCK_SIZE
    assert stats.total_blocks == NUM_BLOCKS and stats.free_tokens == stats.free_blocks * BLOCK_SIZE
    assert stats.ingress_max_in_flight == MAX_IN_FLIGHT and stats.timestamp > 0


# -- errors -------------------------------------------------------------------------------------
INVALID = [
    pytest.param({"temperature": 3.0}, "temperature", id="temperature"),
    pytest.param({"prompt": ""}, "exactly one of prompt", id="no-input"),
    pytest.param({"prompt_token_ids": [5, 6]}, "got prompt, prompt_token_ids", id="two-inputs"),
    pytest.param({"logprobs": 50}, "logprobs", id="logprobs"),
    pytest.param({"max_tokens": MAX_MODEL_LEN}, f"maximum context length is {MAX_MODEL_LEN}", id="too-long"),
    # Checked by the engine on the worker: the error crosses the worker -> ingress hop.
    pytest.param({"prompt": "", "prompt_token_ids": [1, 99_999]}, "prompt token ids must be in", id="token-id"),
]


@pytest.mark.parametrize(("fields", "fragment"), INVALID)
@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
def test_invalid_argument(app: GrpcApp, method: str, fields: dict[str, Any], fragment: str) -> None:
    request = greedy("Hello", max_tokens=4)
    for name, value in fields.items():
        if isinstance(value, list):
            getattr(request, name).extend(value)
        else:
            setattr(request, name, value)
    error = rpc_error(lambda: app.call(method, request))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert fragment in error.details()


@pytest.mark.parametrize("method", ["Generate", "GenerateStream", "Tokenize"])
def test_unknown_model_is_not_found(app: GrpcApp, method: str) -> None:
    request = pb.TokenizeRequest(model="nope", prompt="hi") if method == "Tokenize" else pb.GenerateRequest(model="nope", prompt="hi")
    error = rpc_error(lambda: app.call(method, request))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error.details() == "The model `nope` does not exist. Known: `tiny-grpc`."  # the names it serves


def test_overload_is_resource_exhausted(app: GrpcApp) -> None:
    """Past the ingress's in-flight bound: RESOURCE_EXHAUSTED at once; Stats still answers."""
    streams = [app.stream(long_request(app)) for _ in range(MAX_IN_FLIGHT)]
    try:
        for stream in streams:
            next(stream)  # each holds its share of the bound now
        error = rpc_error(lambda: app.call("Generate", greedy("Hello", max_tokens=4)))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"limit of {MAX_IN_FLIGHT} requests in flight" in error.details()
        assert app.call("Stats", pb.StatsRequest()).ingress_in_flight == MAX_IN_FLIGHT
    finally:
        for stream in streams:
            stream.cancel()
    app.wait_idle()


# -- cancellation -------------------------------------------------------------------------------
@pytest.mark.parametrize("num_messages", [0, 1, 8])
def test_cancelling_a_stream_aborts_it_and_frees_its_kv_blocks(app: GrpcApp, num_messages: int) -> None:
    """Client cancel -> Serve's proxy cancels the ingress generator -> the worker call is
    cancelled -> the engine aborts the request: blocks back to free long before it could
    have finished."""
    idle = app.wait_idle()
    request = long_request(app)
    stream = app.stream(request)
    for _ in range(num_messages):
        message = next(stream)
        assert message.token_ids
    busy = wait_until(
        lambda: (s := app.worker_stats())["num_running"] == 1 and s["free_blocks"] < s["total_blocks"] and s,
        WAIT_S,
        message="the request to run on the worker",
    )
    assert busy["num_generated_tokens"] - idle["num_generated_tokens"] < request.max_tokens
    stream.cancel()
    with pytest.raises(grpc.RpcError) as info:
        list(stream)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    after = app.wait_idle()
    assert after["num_generated_tokens"] - idle["num_generated_tokens"] < request.max_tokens, "it ran to completion"
    assert app.call("Stats", pb.StatsRequest()).ingress_in_flight == 0


def test_cancelling_a_unary_call_aborts_it(app: GrpcApp) -> None:
    idle = app.wait_idle()
    request = long_request(app)
    future = app.stub.Generate.future(request, metadata=app.metadata, timeout=RPC_TIMEOUT_S)
    wait_until(lambda: app.worker_stats()["num_running"] == 1, WAIT_S, message="the request to run on the worker")
    assert future.cancel()
    after = app.wait_idle()
    assert after["num_generated_tokens"] - idle["num_generated_tokens"] < request.max_tokens, "it ran to completion"


def proxy_servicer_functions() -> list[str]:
    """The servicer functions the session's Serve gRPC proxy was started with."""
    return grpc_servicer_functions()


def test_cancelling_a_stream_the_client_stopped_reading_aborts_it(app: GrpcApp) -> None:
    """The client stops reading; HTTP/2 flow control then holds the proxy in its write to
    the client, where the cancellation lands. Serve 2.60's proxy alone leaks the request
    then (it ran to max_tokens); router.frontend.grpc_api.proxy's servicer function fixes it."""
    registered = proxy_servicer_functions()
    assert GRPC_SERVICER in registered, f"the proxy registers {registered}, without the fix in {GRPC_SERVICER}"
    idle = app.wait_idle()
    # No BDP probing and a 1 KiB stream window: the proxy's writes wait once ~1 KiB is unread.
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    with grpc.insecure_channel(app.target, options=options) as channel:
        request = long_request(app)
        stream = pb_grpc.KVServeStub(channel).GenerateStream(request, metadata=app.metadata, timeout=RPC_TIMEOUT_S)
        next(stream)
        wait_until(
            lambda: app.worker_stats()["num_generated_tokens"] - idle["num_generated_tokens"] > 200,
            WAIT_S,
            message="far more output than the window holds",
        )
        stream.cancel()
        after = app.wait_idle()
    assert after["num_generated_tokens"] - idle["num_generated_tokens"] < request.max_tokens, "it ran to completion"


# -- the Python client and the CLI --------------------------------------------------------------
def test_python_client(app: GrpcApp) -> None:
    with KVServeClient(app.target, api_key="test-key", application=APP, timeout=RPC_TIMEOUT_S) as client:
        reference = app.call("Generate", greedy("Hello world", max_tokens=8))
        result = client.generate("Hello world", model=MODEL, max_tokens=8, temperature=0.0, ignore_eos=True)
        assert list(result.token_ids) == list(reference.token_ids)
        with client.generate_stream("Hello world", max_tokens=8, temperature=0.0, ignore_eos=True) as stream:
            assert "".join(m.text for m in stream) == reference.text
        assert list(client.tokenize("Hello world").token_ids) == app.ids("Hello world")
        assert [m.id for m in client.list_models()] == [MODEL]
        assert client.is_serving()
        assert client.stats().total_blocks == NUM_BLOCKS
        with pytest.raises(KVServeError) as info:
            client.generate("Hello", model="nope")
        assert info.value.code == grpc.StatusCode.NOT_FOUND
        with pytest.raises(KVServeError) as info:
            list(client.generate_stream("Hello", temperature=9.0))
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_cli_complete_streams_text(app: GrpcApp, capsys: pytest.CaptureFixture[str]) -> None:
    reference = app.call("Generate", greedy("Hello world", max_tokens=8))
    argv = ["complete", "--grpc", app.target, "--application", APP, "--max-tokens", "8",
            "--temperature", "0", "--ignore-eos", "--usage", "Hello world"]
    assert grpc_cli.main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out == reference.text + "\n"
    assert "8 completion tokens" in captured.err
    assert grpc_cli.main(["complete", "--grpc", app.target, "--application", APP, "--model", "nope", "Hi"]) == 1
    assert "NOT_FOUND: The model `nope` does not exist." in capsys.readouterr().err


# -- a dead engine ------------------------------------------------------------------------------
class DeadWorker:
    """A worker whose engine loop has stopped: generate fails as WorkerReplica's does then;
    its health check fails once `die()` was called (Serve's own first check must pass)."""

    def __init__(self) -> None:
        self.dead = False

    async def generate(self, request: GenerateRequest) -> Any:
        raise EngineDeadError("the engine loop has stopped: test")
        yield  # an async generator, like WorkerReplica.generate

    async def model_info(self) -> dict[str, int]:
        return {"max_model_len": MAX_MODEL_LEN, "vocab_size": 384, "block_size": BLOCK_SIZE}

    async def stats(self) -> dict[str, Any]:
        return {"replica_id": "dead", "free_blocks": NUM_BLOCKS, "total_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE}

    def die(self) -> None:
        self.dead = True

    def check_health(self) -> None:
        if self.dead:
            raise RuntimeError("engine loop has stopped")


def test_dead_engine_is_unavailable(serve_cluster: Any, served_model_dir: Path) -> None:
    config = tiny_config(served_model_dir).with_overrides({"model.served_model_name": DEAD_MODEL})
    worker = serve.deployment(DeadWorker, name=WORKER_DEPLOYMENT).options(
        num_replicas=1, ray_actor_options={"num_cpus": 0.1}, health_check_period_s=600.0
    )
    ingress = serve.deployment(Ingress, name=INGRESS_DEPLOYMENT).options(**ingress_options(config))
    serve.run(ingress.bind(worker.bind(), ingress_settings(config)), name=DEAD_APP, route_prefix=f"/{DEAD_APP}")
    channel = grpc.insecure_channel(f"127.0.0.1:{serve_cluster.grpc_port}")
    stub = pb_grpc.KVServeStub(channel)
    metadata = (("application", DEAD_APP),)
    try:
        def generate(method: str) -> grpc.RpcError | None:
            try:
                request = greedy("Hello", max_tokens=4)
                request.model = DEAD_MODEL
                result = getattr(stub, method)(request, metadata=metadata, timeout=RPC_TIMEOUT_S)
                list(result) if method == "GenerateStream" else None
            except grpc.RpcError as e:
                return None if e.code() == grpc.StatusCode.NOT_FOUND else e  # not routed here yet
            raise AssertionError("a dead engine generated")

        for method in ("Generate", "GenerateStream"):
            error = wait_until(lambda: generate(method), WAIT_S, message="the gRPC proxy to route to the application")
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
            assert "No worker is available: EngineDeadError." in error.details()
        if len(serve.status().applications) > 1:
            # With several applications Serve's proxy needs the right "application"
            # metadata (with one, it routes every call to it whatever the metadata says).
            with pytest.raises(grpc.RpcError) as info:
                stub.ListModels(pb.ListModelsRequest(), metadata=(("application", "nope"),), timeout=RPC_TIMEOUT_S)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            assert "Application 'nope' not found" in info.value.details()
        serve.get_deployment_handle(WORKER_DEPLOYMENT, app_name=DEAD_APP).die.remote().result(timeout_s=30)
        health = stub.Health(pb.HealthRequest(), metadata=metadata, timeout=RPC_TIMEOUT_S)
        assert health.status == pb.HealthResponse.STATUS_NOT_SERVING
        # Unauthenticated: the reason is public text, the engine's error stays in the log.
        assert health.message == "No healthy worker." and "engine loop" not in health.message
    finally:
        channel.close()
        serve.delete(DEAD_APP)
