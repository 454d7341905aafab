"""The ingress's gRPC API (protos/kvserve/v1/kvserve.proto), as a mixin of the ingress class.

    @serve.ingress(app)
    class Ingress(GrpcServicerMixin): ...          # router/ingress.py

Serve's gRPC proxy deserializes the request with the generated stubs, then calls the
ingress deployment's method named after the RPC (`Generate`, `GenerateStream`, ...),
passing Serve's `RayServegRPCContext` as the keyword argument `grpc_context`; a streaming
RPC is an async generator method. The methods here do what the HTTP handlers do, with
the same helpers: validate through the OpenAI request models (one set of rules and
messages for both APIs), tokenize here once (router/openai_convert.py), take a share of
the in-flight bound, and stream the engine request through the worker handle
(router/generation.py, so the KV-headroom router places it).

Errors. Each user-visible error is a router.errors.APIError, mapped to a gRPC status:
400 -> INVALID_ARGUMENT, 401 -> UNAUTHENTICATED, 404 -> NOT_FOUND, 413 (a request over
`max_body_bytes`, as grpc says for a message over its own limit) and 429 -> RESOURCE_EXHAUSTED,
503 -> UNAVAILABLE, 504 -> DEADLINE_EXCEEDED, 500 -> INTERNAL. The code travels back
through `grpc_context.set_code/set_details`; how it reaches the client differs:
- unary RPCs return an empty message after setting the code (Serve copies the context
  onto the real call with the reply; no error is logged for a user's mistake);
- a stream must raise: Serve copies the context only with a yielded message, and when
  the replica raises after `set_code` it wraps the exception in gRPCStatusError, which
  the proxy turns into that status (and logs the exception).

Cancellation (Ray Serve 2.60, read in serve/_private/proxy.py and
proxy_response_generator.py, measured in tests/integration/test_grpc_api.py): when the
client cancels, grpc cancels the proxy's handler task; ProxyResponseGenerator catches the
CancelledError and calls `.cancel()` on the response, which cancels the replica's call:
a CancelledError is raised in the method here, whose `finally` closes the
GenerationStream, which cancels the worker call, and the engine aborts the request (its
KV blocks are freed within a step). Serve alone misses one case (a client that stopped
reading, so the proxy was blocked in a write when the cancel came: the request ran on to
max_tokens); router/grpc_proxy.py's servicer function closes it.

Host contract: the class this is mixed into provides `settings` (IngressSettings),
`worker` (the worker DeploymentHandle), `_generate` (it with stream=True), `tokenizer`,
`texts` (openai_convert.TokenTexts), `metrics` (IngressMetrics), `limiter`
(InFlightLimiter), `async _info() -> dict` (the workers' model_info) and
`async _worker_stats() -> list[dict]` (every worker's stats); see `IngressHost`.
The mixin defines no `__init__` (a subclass of a @serve.ingress class must have the
wrapper's async one).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import grpc
from pydantic import BaseModel, ValidationError

from protos.kvserve.v1 import kvserve_pb2 as pb
from router import errors
from router import openai_convert as convert
from router import openai_protocol as p
from router.auth import ANONYMOUS, JointPermit, Principal, grpc_authorization
from router.generation import GenerationStream, InFlightLimiter, api_error_of
from router.metrics import IngressMetrics
from router.settings import IngressSettings
from worker.outputs import RequestOutput, TokenLogprob

if TYPE_CHECKING:
    from ray.serve.grpc_util import RayServegRPCContext

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

# Requests above this many bytes are tokenized off the event loop (as the HTTP path does).
_LARGE_REQUEST_BYTES = 64 * 1024
_HEALTH_TIMEOUT_S = 10.0
MAX_REQUEST_ID_CHARS = 128

STATUS_CODES: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}

FINISH_REASONS: dict[str | None, int] = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}

# GenerateRequest fields that are `optional` in the proto: sent only when set, so that
# the OpenAI models' defaults (temperature 1, top_p 1, ...) apply otherwise.
_OPTIONAL_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "skip_special_tokens",
)
_FLOAT_FIELDS = frozenset({"temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"})


class IngressHost(Protocol):
    """What GrpcServicerMixin needs from the ingress class it is mixed into."""

    settings: IngressSettings
    worker: Any
    _generate: Any
    tokenizer: Any
    texts: convert.TokenTexts
    metrics: IngressMetrics
    limiter: InFlightLimiter

    async def _info(self) -> dict[str, Any]: ...

    async def _worker_stats(self) -> list[dict[str, Any]]: ...


class GrpcStatusError(Exception):
    """An RPC's failure with its gRPC status (raised to Serve, which reports the code the
    method set on grpc_context)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    def __reduce__(self) -> tuple[type[GrpcStatusError], tuple[grpc.StatusCode, str]]:
        # Ray pickles the exception (inside Serve's gRPCStatusError) back to the proxy;
        # the default reduce would call __init__ with the message alone.
        return type(self), (self.code, self.details)


def status_code_of(error: errors.APIError) -> grpc.StatusCode:
    return STATUS_CODES.get(error.status, grpc.StatusCode.UNKNOWN)


def _fail(grpc_context: RayServegRPCContext | None, error: errors.APIError) -> GrpcStatusError:
    """Sets the error's status on the call; returns the exception for a stream to raise."""
    code = status_code_of(error)
    if error.status >= 500:
        logger.warning("gRPC request failed: %s %s", code.name, error.message)
    if grpc_context is not None:
        grpc_context.set_code(code)
        grpc_context.set_details(error.message)
    return GrpcStatusError(code, error.message)


def _parse(model: type[M], data: dict[str, Any]) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise errors.from_validation_error(e) from None


def _proto_float(value: float) -> float:
    """A proto `float` arrives as float32 (0.7 -> 0.699999988...): back to its decimal."""
    return float(f"{value:.7g}")


def _messages(messages: Any) -> list[dict[str, Any]]:
    return [{"role": m.role, "content": m.content} | ({"name": m.name} if m.name else {}) for m in messages]


def sampling_body(request: pb.GenerateRequest) -> dict[str, Any]:
    """The sampling fields of a GenerateRequest as an OpenAI request body's fields."""
    body: dict[str, Any] = {}
    for name in _OPTIONAL_SAMPLING_FIELDS:
        if request.HasField(name):
            value = getattr(request, name)
            body[name] = _proto_float(value) if name in _FLOAT_FIELDS else value
    if request.stop:
        body["stop"] = list(request.stop)
    if request.stop_token_ids:
        body["stop_token_ids"] = list(request.stop_token_ids)
    body["ignore_eos"] = request.ignore_eos
    body["min_tokens"] = request.min_tokens
    body["include_stop_str_in_output"] = request.include_stop_str_in_output
    return body


def engine_inputs(
    request: pb.GenerateRequest, model: str, tokenizer: Any, max_model_len: int
) -> list[convert.EngineInput]:
    """One EngineInput (token ids + SamplingParams) for a GenerateRequest, validated with the
    OpenAI request models, so that both APIs accept and reject the same values with the
    same messages. Raises APIError (400) for anything invalid or too long."""
    given = [name for name, present in (
        ("prompt", bool(request.prompt)),
        ("prompt_token_ids", len(request.prompt_token_ids) > 0),
        ("messages", len(request.messages) > 0),
    ) if present]
    if len(given) != 1:
        which = "none was" if not given else f"got {', '.join(given)}"
        raise errors.bad_request(f"Set exactly one of prompt, prompt_token_ids and messages ({which}).", "prompt")
    max_tokens = request.max_tokens if request.HasField("max_tokens") else None
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, **sampling_body(request)}
    logprobs = request.logprobs if request.HasField("logprobs") else None
    if request.messages:
        body["messages"] = _messages(request.messages)
        if logprobs is not None:
            body.update(logprobs=True, top_logprobs=logprobs)
        if request.HasField("add_generation_prompt"):
            body["add_generation_prompt"] = request.add_generation_prompt
        return convert.chat_inputs(_parse(p.ChatCompletionRequest, body), tokenizer, max_model_len, 1)
    body["prompt"] = request.prompt or list(request.prompt_token_ids)
    body["logprobs"] = logprobs
    return convert.completion_inputs(_parse(p.CompletionRequest, body), tokenizer, max_model_len, 1)


def tokenize(request: pb.TokenizeRequest, model: str, tokenizer: Any) -> list[int]:
    """A TokenizeRequest's token ids, as generation would compute them."""
    if bool(request.prompt) == bool(request.messages):
        raise errors.bad_request("Set exactly one of prompt and messages.", "prompt")
    if request.messages:
        body: dict[str, Any] = {"model": model, "messages": _messages(request.messages)}
        if request.HasField("add_generation_prompt"):
            body["add_generation_prompt"] = request.add_generation_prompt
        return list(convert.encode_chat(tokenizer, _parse(p.ChatCompletionRequest, body)))
    add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
    return list(tokenizer(request.prompt, add_special_tokens=add_special).input_ids)


def token_logprobs(entries: list[TokenLogprob] | None, texts: Callable[[int], str]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=e.token_id,
            token=texts(e.token_id),
            logprob=e.logprob,
            top_logprobs=[pb.TopLogprob(token_id=t, token=texts(t), logprob=lp) for t, lp in e.top],
        )
        for e in entries or ()
    ]


def _set_finish(message: pb.GenerateResponse | pb.GenerateStreamResponse, out: RequestOutput) -> None:
    message.finish_reason = FINISH_REASONS.get(out.finish_reason, pb.FINISH_REASON_UNSPECIFIED)  # type: ignore[assignment]
    if isinstance(out.stop_reason, str):
        message.stop_string = out.stop_reason
    elif isinstance(out.stop_reason, int):
        message.stop_token_id = out.stop_reason
    message.usage.CopyFrom(
        pb.Usage(
            prompt_tokens=out.num_prompt_tokens,
            completion_tokens=out.num_output_tokens,
            cached_prompt_tokens=out.num_cached_tokens,
        )
    )


class _Clock:
    """Latencies of one request at the ingress."""

    def __init__(self) -> None:
        self.arrival = time.monotonic()
        self.arrival_unix = time.time()
        self.first_token_s = 0.0

    def observe(self, out: RequestOutput) -> None:
        if out.new_token_ids and not self.first_token_s:
            self.first_token_s = time.monotonic() - self.arrival

    def timing(self) -> pb.Timing:
        return pb.Timing(
            arrival_time=self.arrival_unix,
            time_to_first_token_s=self.first_token_s,
            elapsed_s=time.monotonic() - self.arrival,
        )


async def _off_loop_if_large(num_bytes: int, fn: Callable[..., T], *args: Any) -> T:
    if num_bytes > _LARGE_REQUEST_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


class GrpcServicerMixin:
    """The KVServe service's methods, for the ingress deployment class (see the module doc)."""

    # -- RPCs ------------------------------------------------------------------------------
    async def Generate(
        self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext | None = None
    ) -> pb.GenerateResponse:
        clock = _Clock()
        try:
            stream = await self._grpc_start(request, clock, self._grpc_authenticate(grpc_context))
            response = pb.GenerateResponse(request_id=stream.request_id, model=self._grpc_host.settings.served_model_name)
            texts = self._grpc_host.texts
            try:
                async for event in stream:
                    out = event.output
                    clock.observe(out)
                    response.text += out.text_delta
                    response.token_ids.extend(out.new_token_ids)
                    response.logprobs.extend(token_logprobs(out.logprobs, texts))
                    if out.finished:
                        _set_finish(response, out)
            finally:
                stream.close()  # also when the client cancels (CancelledError here)
                _settle(stream, response.usage.prompt_tokens + response.usage.completion_tokens)
        except errors.APIError as e:
            error = _fail(grpc_context, e)
            if grpc_context is None:
                raise error from None
            return pb.GenerateResponse()
        response.timing.CopyFrom(clock.timing())
        return response

    async def GenerateStream(
        self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext | None = None
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        clock = _Clock()
        try:
            stream = await self._grpc_start(request, clock, self._grpc_authenticate(grpc_context))
        except errors.APIError as e:
            raise _fail(grpc_context, e) from None
        texts = self._grpc_host.texts
        used = 0  # prompt + completion tokens so far, for the key's budget
        num_prompt = 0
        try:
            async for event in stream:
                out = event.output
                if not (out.new_token_ids or out.text_delta or out.finished):
                    continue
                clock.observe(out)
                message = pb.GenerateStreamResponse(
                    request_id=stream.request_id,
                    token_ids=out.new_token_ids,
                    text=out.text_delta,
                    logprobs=token_logprobs(out.logprobs, texts),
                )
                num_prompt = max(num_prompt, out.num_prompt_tokens)
                used = num_prompt + out.num_output_tokens
                if out.finished:
                    _set_finish(message, out)
                message.timing.CopyFrom(clock.timing())
                yield message
        except errors.APIError as e:  # after the first token: a worker died, a timeout
            raise _fail(grpc_context, e) from None
        finally:
            # Runs on client cancellation too: Serve cancels this generator, and closing
            # the stream cancels the worker call, which aborts the engine request.
            stream.close()
            _settle(stream, used)

    async def Tokenize(
        self, request: pb.TokenizeRequest, grpc_context: RayServegRPCContext | None = None
    ) -> pb.TokenizeResponse:
        host = self._grpc_host
        try:
            self._grpc_authenticate(grpc_context)
            model = self._grpc_model(request.model)
            _check_size(request, host.settings.max_body_bytes)
            ids = await _off_loop_if_large(request.ByteSize(), tokenize, request, model, host.tokenizer)
            info = await self._grpc_info()
        except errors.APIError as e:
            error = _fail(grpc_context, e)
            if grpc_context is None:
                raise error from None
            return pb.TokenizeResponse()
        response = pb.TokenizeResponse(token_ids=ids, count=len(ids), max_model_len=info["max_model_len"])
        if request.return_token_strings:
            response.tokens.extend(host.texts(t) for t in ids)
        return response

    async def ListModels(
        self, request: pb.ListModelsRequest, grpc_context: RayServegRPCContext | None = None
    ) -> pb.ListModelsResponse:
        host = self._grpc_host
        try:
            self._grpc_authenticate(grpc_context)
            info = await self._grpc_info()
        except errors.APIError as e:
            error = _fail(grpc_context, e)
            if grpc_context is None:
                raise error from None
            return pb.ListModelsResponse()
        model = pb.ModelInfo(
            id=host.settings.served_model_name,
            root=host.settings.tokenizer_path,
            max_model_len=info["max_model_len"],
            vocab_size=info.get("vocab_size", 0),
            block_size=info.get("block_size", 0),
        )
        return pb.ListModelsResponse(models=[model])

    async def Health(
        self, request: pb.HealthRequest, grpc_context: RayServegRPCContext | None = None
    ) -> pb.HealthResponse:
        """SERVING when a worker answers its health check in time (as GET /health), else
        NOT_SERVING with the reason; the call itself succeeds either way, as in
        grpc.health.v1."""
        response = self._grpc_host.worker.check_health.remote()
        try:
            await asyncio.wait_for(_awaited(response), _HEALTH_TIMEOUT_S)
        except asyncio.TimeoutError:
            response.cancel()
            return pb.HealthResponse(
                status=pb.HealthResponse.STATUS_NOT_SERVING,
                message=f"No worker answered its health check within {_HEALTH_TIMEOUT_S:g} s.",
            )
        except Exception as e:
            cause = getattr(e, "cause", None) or e
            return pb.HealthResponse(
                status=pb.HealthResponse.STATUS_NOT_SERVING,
                message=f"No healthy worker: {type(cause).__name__}: {cause}"[:1000],
            )
        return pb.HealthResponse(status=pb.HealthResponse.STATUS_SERVING)

    async def Stats(
        self, request: pb.StatsRequest, grpc_context: RayServegRPCContext | None = None
    ) -> pb.StatsResponse:
        host = self._grpc_host
        try:
            self._grpc_authenticate(grpc_context)
        except errors.APIError as e:
            error = _fail(grpc_context, e)
            if grpc_context is None:
                raise error from None
            return pb.StatsResponse()
        response = pb.StatsResponse(
            ingress_in_flight=host.limiter.in_flight,
            ingress_max_in_flight=host.limiter.limit,
            timestamp=time.time(),
        )
        for stats in await host._worker_stats():
            replica = replica_stats(stats)
            response.replicas.append(replica)
            response.free_blocks += replica.free_blocks
            response.total_blocks += replica.total_blocks
            response.free_tokens += replica.free_blocks * replica.block_size
            response.num_running += replica.num_running
            response.num_waiting += replica.num_waiting
        response.replicas.sort(key=lambda r: r.replica_id)
        return response

    # -- plumbing --------------------------------------------------------------------------
    @property
    def _grpc_host(self) -> IngressHost:
        return cast(IngressHost, self)

    def _grpc_authenticate(self, grpc_context: RayServegRPCContext | None) -> Principal:
        """The caller, from the `authorization: Bearer KEY` metadata; APIError 401 (->
        UNAUTHENTICATED) when keys are configured and it is missing or wrong."""
        api_keys = getattr(self, "api_keys", None)
        if api_keys is None or not api_keys.enabled:
            return ANONYMOUS
        metadata = grpc_context.invocation_metadata() if grpc_context is not None else None
        return api_keys.authenticate(grpc_authorization(metadata))

    def _grpc_model(self, model: str) -> str:
        """The served model's name; empty means it. Another name: NOT_FOUND."""
        served = self._grpc_host.settings.served_model_name
        if model and model != served:
            raise errors.model_not_found(model)
        return served

    async def _grpc_info(self) -> dict[str, Any]:
        try:
            return await self._grpc_host._info()
        except errors.APIError:
            raise
        except Exception as e:  # no worker, a dead worker: the worker call failed
            raise api_error_of(e) from None

    async def _grpc_start(
        self, request: pb.GenerateRequest, clock: _Clock, principal: Principal = ANONYMOUS
    ) -> GenerationStream:
        """Validates, takes a share of the in-flight bound, sends the engine request and
        waits for its first output (so that errors before any token have their status)."""
        host = self._grpc_host
        model = self._grpc_model(request.model)
        _check_size(request, host.settings.max_body_bytes)
        # The client's id names the engine request and appears in logs: short and printable.
        if len(request.request_id) > MAX_REQUEST_ID_CHARS or not request.request_id.isprintable():
            raise errors.bad_request(
                f"request_id must be at most {MAX_REQUEST_ID_CHARS} printable characters.", "request_id", "invalid_value"
            )
        admit = getattr(self, "admit", None)  # the ingress's: the key's limits + in-flight share
        permit = admit(principal, 1) if admit is not None else host.limiter.acquire(1)
        try:
            info = await self._grpc_info()
            inputs = await _off_loop_if_large(
                request.ByteSize(), engine_inputs, request, model, host.tokenizer, info["max_model_len"]
            )
            if isinstance(permit, JointPermit):
                self.charge(permit, inputs)  # type: ignore[attr-defined]
        except BaseException:
            permit.release()
            raise
        request_id = request.request_id or f"grpc-{uuid.uuid4().hex}"
        stream = GenerationStream(
            host._generate, inputs, request_id, permit, host.settings.request_timeout_s, host.metrics, clock.arrival,
            max_migrations=host.settings.max_migrations,
        )
        try:
            await stream.start()
        except BaseException:
            if isinstance(permit, JointPermit):
                permit.settle(0)
            raise
        return stream


def _check_size(request: Any, limit: int) -> None:
    """The HTTP body cap for gRPC messages too (Serve's proxy accepts up to 2 GiB)."""
    if request.ByteSize() > limit:
        raise errors.APIError(
            413, f"The request message is larger than {limit} bytes.", "invalid_request_error", None, "request_too_large"
        )


def _settle(stream: GenerationStream, used_tokens: int) -> None:
    """Refunds the unused part of the request's token charge (router/auth.py)."""
    permit = getattr(stream, "_permit", None)
    if isinstance(permit, JointPermit):
        permit.settle(used_tokens)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def replica_stats(stats: Mapping[str, Any]) -> pb.ReplicaStats:
    """A worker's `stats()` dict (engine + KV stats) as a ReplicaStats message."""
    queries = float(stats.get("prefix_cache_queries", 0) or 0)
    hits = float(stats.get("prefix_cache_hits", 0) or 0)
    return pb.ReplicaStats(
        replica_id=str(stats.get("replica_id", "")),
        free_blocks=int(stats.get("free_blocks", 0)),
        total_blocks=int(stats.get("total_blocks", 0)),
        block_size=int(stats.get("block_size", 0)),
        kv_usage=float(stats.get("kv_usage", 0.0)),
        num_running=int(stats.get("num_running", 0)),
        num_waiting=int(stats.get("num_waiting", 0)),
        num_waiting_prompt_tokens=int(stats.get("num_waiting_prompt_tokens", 0)),
        num_preemptions=int(stats.get("num_preemptions", 0)),
        num_generated_tokens=int(stats.get("num_generated_tokens", 0)),
        tokens_per_s=float(stats.get("tokens_per_s", 0.0)),
        prefix_cache_hit_rate=hits / queries if queries else 0.0,
        num_cached_blocks=int(stats.get("num_cached_blocks", 0)),
    )
