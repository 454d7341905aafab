"""The gRPC front end without Ray: a fake worker handle and tokenizer behind the real
request pipeline (router/frontend/pipeline.py: limits, GenerationStream), called through the
ingress's GrpcMethods the way Serve calls it (keyword grpc_context)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from protos.kvserve.v1 import kvserve_pb2 as pb
from router.frontend.auth import ApiKeys
from router.frontend.grpc_api.client import build_generate_request
from router.frontend.generation import InFlightLimiter
from router.frontend.grpc_api.convert import engine_inputs, replica_stats
from router.frontend.grpc_api.servicer import GrpcMethods, GrpcServicer, GrpcStatusError
from router.frontend.key_limits import KeyLimits
from router.frontend.metrics import IngressMetrics
from router.frontend.pipeline import RequestPipeline
from router.frontend.settings import IngressSettings
from router.frontend.workers import Workers
from worker.api import GenerateRequest, RequestOutput, TokenLogprob

MAX_MODEL_LEN = 64


class FakeTokenizer:
    """Characters as tokens: id = 10 + ord(c) % 200; BOS = 1."""

    chat_template = "fake"

    class _Encoding:
        def __init__(self, ids: list[int]) -> None:
            self.input_ids = ids

    def __len__(self) -> int:  # the vocabulary: ids 0..209
        return 210

    def __call__(self, text: str, add_special_tokens: bool = True) -> FakeTokenizer._Encoding:
        return self._Encoding(([1] if add_special_tokens else []) + [10 + ord(c) % 200 for c in text])

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool, add_generation_prompt: bool) -> str:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i - 10) if i >= 10 else "" for i in ids)


class EngineDeadError(RuntimeError):
    """Named like worker.engine.async_engine's: api_error_of maps it by name to 503."""


class FakeCall:
    """A worker `generate` stream: one token per output; `hold` keeps it open until cancelled."""

    def __init__(self, request: GenerateRequest, hold: bool, fail: BaseException | None) -> None:
        self.request = request
        self.hold = hold
        self.fail = fail
        self.cancelled = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        if self.fail is not None:
            raise self.fail
        params = self.request.params
        n = params.max_tokens
        for i in range(n):
            await asyncio.sleep(0)
            finished = i == n - 1 and not self.hold
            yield RequestOutput(
                request_id=self.request.request_id,
                new_token_ids=[40 + i],
                text_delta=chr(40 + i - 10 + 32),
                finished=finished,
                finish_reason="length" if finished else None,
                logprobs=[TokenLogprob(40 + i, -0.5, ((40 + i, -0.5), (41 + i, -1.5)))] if params.logprobs is not None else None,
                num_prompt_tokens=len(self.request.prompt_token_ids),
                num_output_tokens=i + 1,
            )
        if self.hold:
            await asyncio.Event().wait()  # until cancelled

    def cancel(self) -> None:
        self.cancelled = True


class FakeWorker:
    def __init__(self) -> None:
        self.calls: list[FakeCall] = []
        self.hold = False
        self.fail: BaseException | None = None
        self.healthy = True
        outer = self

        class _Generate:
            def remote(self, request: GenerateRequest) -> FakeCall:
                call = FakeCall(request, outer.hold, outer.fail)
                outer.calls.append(call)
                return call

        class _CheckHealth:
            def remote(self) -> Any:
                async def check() -> None:
                    if not outer.healthy:
                        raise RuntimeError("engine loop has stopped")

                return check()

        self.generate = _Generate()
        self.check_health = _CheckHealth()
        self.model_info = _Returning({"max_model_len": MAX_MODEL_LEN, "vocab_size": 256, "block_size": 16})
        self.stats = _Returning({"total_blocks": 100})

    def broadcast(self, method: str) -> Any:
        assert method == "stats"

        class _Results:
            async def results_async(self, timeout_s: float, return_exceptions: bool) -> list[Any]:
                return [
                    {"replica_id": "b", "free_blocks": 10, "total_blocks": 20, "block_size": 16, "num_running": 1,
                     "num_waiting": 2},
                    {"replica_id": "a", "free_blocks": 5, "total_blocks": 20, "block_size": 16, "num_running": 0,
                     "num_waiting": 1, "prefix_cache_queries": 4, "prefix_cache_hits": 1},
                    RuntimeError("a replica that failed is left out"),
                ]

        return _Results()


class _Returning:
    """A handle method whose `.remote()` returns `value` when awaited."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def remote(self) -> Any:
        async def call() -> Any:
            return self.value

        return call()


class FakeIngress(GrpcMethods):
    """The ingress's gRPC side as router/frontend/ingress.py builds it, over a fake worker."""

    def __init__(self, max_queued_requests: int = 2, api_keys: ApiKeys | None = None, key_limits: KeyLimits | None = None) -> None:
        settings = IngressSettings(
            served_model_name="tiny", tokenizer_path="/models/tiny", max_queued_requests=max_queued_requests, request_timeout_s=30.0
        )
        self.worker = FakeWorker()
        self.pipeline = RequestPipeline(
            settings, Workers(self.worker, self.worker, settings.stats_timeout_s), FakeTokenizer(), IngressMetrics("tiny"),
            api_keys or ApiKeys([]), key_limits or KeyLimits(),
        )
        self.grpc = GrpcServicer(self.pipeline)

    @property
    def settings(self) -> IngressSettings:
        return self.pipeline.settings

    @property
    def limiter(self) -> InFlightLimiter:
        return self.pipeline.limiter


class FakeContext:
    def __init__(self, metadata: list[tuple[str, str]] | None = None) -> None:
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self._metadata = metadata or []

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self._metadata

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str:
        return self._details


def request(**kwargs: Any) -> pb.GenerateRequest:
    kwargs.setdefault("prompt", "hi")
    return build_generate_request(**kwargs)


async def collect(ingress: FakeIngress, req: pb.GenerateRequest, context: FakeContext | None = None) -> list[pb.GenerateStreamResponse]:
    return [m async for m in ingress.GenerateStream(req, grpc_context=context)]


# -- conversion -------------------------------------------------------------------------------
def test_engine_inputs_use_openai_defaults_and_decimal_floats() -> None:
    [inp] = engine_inputs(request(prompt="abc", temperature=0.7, top_p=0.9, seed=5, stop=["x"]), "tiny", FakeTokenizer(), MAX_MODEL_LEN)
    assert inp.prompt_token_ids == [1, 10 + ord("a"), 10 + ord("b"), 10 + ord("c")]
    params = inp.params
    assert (params.temperature, params.top_p, params.seed, params.stop) == (0.7, 0.9, 5, ("x",))
    assert params.max_tokens == MAX_MODEL_LEN - 4  # unset: as many as the context allows
    [default] = engine_inputs(request(prompt=[5, 6], max_tokens=3), "tiny", FakeTokenizer(), MAX_MODEL_LEN)
    assert default.prompt_token_ids == [5, 6]
    assert (default.params.temperature, default.params.top_p, default.params.max_tokens) == (1.0, 1.0, 3)


def test_engine_inputs_chat_and_logprobs() -> None:
    [inp] = engine_inputs(
        request(prompt=None, messages=[("user", "hi")], logprobs=2, max_tokens=4), "tiny", FakeTokenizer(), MAX_MODEL_LEN
    )
    assert inp.prompt_token_ids == FakeTokenizer()("<user>hi<assistant>", add_special_tokens=False).input_ids
    assert inp.params.logprobs == 2


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"prompt": None}, "exactly one of prompt"),
        ({"prompt": "a", "messages": [("user", "b")]}, "got prompt, messages"),
        ({"temperature": 3.0}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 50}, "logprobs"),
        ({"prompt": "x" * 70}, "maximum context length is 64"),
        ({"max_tokens": 64}, "maximum context length is 64"),
        ({"messages": [("wizard", "hi")], "prompt": None}, "role"),
    ],
)
def test_engine_inputs_reject_bad_requests(kwargs: dict[str, Any], fragment: str) -> None:
    from router.errors import APIError

    with pytest.raises(APIError) as info:
        engine_inputs(request(**kwargs), "tiny", FakeTokenizer(), MAX_MODEL_LEN)
    assert info.value.status == 400
    assert fragment in info.value.message


def test_build_generate_request_rejects_unknown_options() -> None:
    with pytest.raises(TypeError, match="bogus"):
        build_generate_request("hi", bogus=1)  # type: ignore[call-arg]
    req = build_generate_request([3, 4], stop="end", temperature=0.0)
    assert list(req.prompt_token_ids) == [3, 4] and list(req.stop) == ["end"]
    assert req.HasField("temperature") and not req.HasField("top_p")


def test_replica_stats_hit_rate() -> None:
    stats = replica_stats({"replica_id": "r", "free_blocks": 3, "prefix_cache_queries": 8, "prefix_cache_hits": 2})
    assert (stats.replica_id, stats.free_blocks, stats.prefix_cache_hit_rate) == ("r", 3, 0.25)


# -- the RPCs ---------------------------------------------------------------------------------
async def test_generate_and_stream_agree() -> None:
    ingress = FakeIngress()
    context = FakeContext()
    unary = await ingress.Generate(request(max_tokens=3, logprobs=1, request_id="r1"), grpc_context=context)
    assert context.code() is None
    assert unary.request_id == "r1" and unary.model == "tiny"
    assert list(unary.token_ids) == [40, 41, 42]
    assert unary.finish_reason == pb.FINISH_REASON_LENGTH
    assert (unary.usage.prompt_tokens, unary.usage.completion_tokens) == (3, 3)
    assert [lp.token_id for lp in unary.logprobs] == [40, 41, 42]
    assert len(unary.logprobs[0].top_logprobs) == 2
    assert unary.timing.arrival_time > 0 and unary.timing.elapsed_s >= unary.timing.time_to_first_token_s > 0
    messages = await collect(ingress, request(max_tokens=3, logprobs=1))
    assert [t for m in messages for t in m.token_ids] == list(unary.token_ids)
    assert "".join(m.text for m in messages) == unary.text
    assert [m.finish_reason for m in messages] == [0, 0, pb.FINISH_REASON_LENGTH]
    assert not messages[0].HasField("usage") and messages[-1].usage.completion_tokens == 3
    assert ingress.limiter.in_flight == 0


@pytest.mark.parametrize(
    ("kwargs", "code"),
    [
        ({"temperature": 5.0}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"prompt": "y" * 100}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"model": "other"}, grpc.StatusCode.NOT_FOUND),
    ],
)
async def test_errors_set_the_status(kwargs: dict[str, Any], code: grpc.StatusCode) -> None:
    ingress = FakeIngress()
    context = FakeContext()
    assert await ingress.Generate(request(**kwargs), grpc_context=context) == pb.GenerateResponse()
    assert context.code() == code and context.details()
    context = FakeContext()
    with pytest.raises(GrpcStatusError) as info:
        await collect(ingress, request(**kwargs), context)
    assert info.value.code == code and context.code() == code
    assert ingress.limiter.in_flight == 0 and not ingress.worker.calls


async def test_overload_is_resource_exhausted() -> None:
    ingress = FakeIngress(max_queued_requests=1)
    ingress.worker.hold = True
    stream = ingress.GenerateStream(request(max_tokens=2))
    await stream.__anext__()  # holds the only permit
    context = FakeContext()
    await ingress.Generate(request(), grpc_context=context)
    assert context.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit of 1 requests" in context.details()
    await stream.aclose()
    assert ingress.limiter.in_flight == 0


async def test_cancelling_the_stream_cancels_the_worker_call() -> None:
    """What Serve does when the client cancels: cancel the task iterating the generator."""
    ingress = FakeIngress()
    ingress.worker.hold = True
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in ingress.GenerateStream(request(max_tokens=2)):
            first.set()

    task = asyncio.create_task(consume())
    await first.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)  # the feed task's finally runs on its cancellation
    [call] = ingress.worker.calls
    assert call.cancelled
    assert ingress.limiter.in_flight == 0


async def test_unary_cancel_cancels_the_worker_call() -> None:
    ingress = FakeIngress()
    ingress.worker.hold = True
    task = asyncio.create_task(ingress.Generate(request(max_tokens=2)))
    while not ingress.worker.calls:
        await asyncio.sleep(0)
    for _ in range(10):
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)
    assert ingress.worker.calls[0].cancelled and ingress.limiter.in_flight == 0


async def test_dead_engine_is_unavailable_and_not_serving() -> None:
    ingress = FakeIngress()
    ingress.worker.fail = EngineDeadError("the engine loop has stopped")
    ingress.worker.healthy = False
    context = FakeContext()
    await ingress.Generate(request(), grpc_context=context)
    assert context.code() == grpc.StatusCode.UNAVAILABLE and "EngineDeadError" in context.details()
    health = await ingress.Health(pb.HealthRequest())
    # Public text only: the engine's error goes to the log (tests/security/test_health_probe.py).
    assert health.status == pb.HealthResponse.STATUS_NOT_SERVING and health.message == "No healthy worker."


async def test_tokenize_models_health_stats() -> None:
    ingress = FakeIngress()
    tokens = await ingress.Tokenize(pb.TokenizeRequest(prompt="ab", return_token_strings=True))
    assert list(tokens.token_ids) == [1, 10 + ord("a"), 10 + ord("b")] and tokens.count == 3
    assert list(tokens.tokens) == ["", "a", "b"] and tokens.max_model_len == MAX_MODEL_LEN
    bare = await ingress.Tokenize(pb.TokenizeRequest(prompt="ab", add_special_tokens=False))
    assert list(bare.token_ids) == [10 + ord("a"), 10 + ord("b")]
    context = FakeContext()
    await ingress.Tokenize(pb.TokenizeRequest(), grpc_context=context)
    assert context.code() == grpc.StatusCode.INVALID_ARGUMENT
    [model] = (await ingress.ListModels(pb.ListModelsRequest())).models
    # root: the model's directory for admin keys only (docs/security.md); auth off, the name
    assert (model.id, model.root, model.max_model_len, model.vocab_size) == ("tiny", "tiny", MAX_MODEL_LEN, 256)
    assert (await ingress.Health(pb.HealthRequest())).status == pb.HealthResponse.STATUS_SERVING
    stats = await ingress.Stats(pb.StatsRequest())
    assert [r.replica_id for r in stats.replicas] == ["a", "b"]
    assert (stats.free_blocks, stats.total_blocks, stats.free_tokens) == (15, 40, 15 * 16)
    assert (stats.num_running, stats.num_waiting, stats.ingress_max_in_flight) == (1, 3, 2)


def test_status_error_survives_pickling() -> None:
    """Ray pickles it (inside Serve's gRPCStatusError) from the replica to the proxy."""
    import pickle

    error = pickle.loads(pickle.dumps(GrpcStatusError(grpc.StatusCode.NOT_FOUND, "gone")))
    assert (error.code, error.details, str(error)) == (grpc.StatusCode.NOT_FOUND, "gone", "NOT_FOUND: gone")


def test_engine_inputs_n_and_logit_bias() -> None:
    inputs = engine_inputs(request(n=3, seed=4, logit_bias={7: 100.0, 9: -0.7}), "tiny", FakeTokenizer(), MAX_MODEL_LEN, max_n=4)
    assert [inp.index for inp in inputs] == [0, 1, 2]
    assert [inp.params.seed for inp in inputs] == [4, 5, 6]  # seed + choice, as over HTTP
    assert dict(inputs[0].params.logit_bias) == {7: 100.0, 9: -0.7}  # the float32 back to its decimal


@pytest.mark.parametrize(("kwargs", "fragment"), [({"n": 5}, "n must be at most 4"), ({"logit_bias": {7: 150.0}}, "[-100, 100]")])
def test_engine_inputs_reject_bad_n_and_logit_bias(kwargs: dict[str, Any], fragment: str) -> None:
    from router.errors import APIError

    with pytest.raises(APIError) as info:
        engine_inputs(request(**kwargs), "tiny", FakeTokenizer(), MAX_MODEL_LEN, max_n=4)
    assert info.value.status == 400 and fragment in info.value.message


async def test_the_session_comes_from_the_x_session_id_metadata() -> None:
    ingress = FakeIngress()
    await collect(ingress, request(max_tokens=1), FakeContext([("x-session-id", "agent-7")]))
    await collect(ingress, request(max_tokens=1), FakeContext())
    assert [call.request.session_id for call in ingress.worker.calls] == ["agent-7", None]
