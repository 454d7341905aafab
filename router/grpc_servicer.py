"""The ingress's gRPC API (protos/kvserve/v1/kvserve.proto), as a mixin of the ingress class.

    @serve.ingress(app)
    class Ingress(GrpcServicerMixin): ...          # router/ingress.py

Serve's gRPC proxy deserializes the request with the generated stubs, then calls the
ingress deployment's method named after the RPC (`Generate`, `GenerateStream`, ...),
passing Serve's `RayServegRPCContext` as the keyword argument `grpc_context`; a streaming
RPC is an async generator method. The methods here do what the HTTP handlers do, with
the same helpers: validate through the OpenAI request models (one set of rules and
messages for both APIs; the message conversions are router/grpc_convert.py), tokenize
here once (router/openai_convert.py), take a share of the in-flight bound, and stream
the engine request through the worker handle (router/generation.py, so the KV-headroom
router places it).

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
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import grpc

from protos.kvserve.v1 import kvserve_pb2 as pb
from router import errors
from router import openai_convert as convert
from router.auth import ANONYMOUS, JointPermit, Principal, grpc_authorization
from router.generation import GenerationStream, InFlightLimiter, api_error_of
from router.grpc_convert import Clock, engine_inputs, replica_stats, set_finish, status_code_of, token_logprobs, tokenize
from router.metrics import IngressMetrics
from router.settings import IngressSettings

if TYPE_CHECKING:
    from ray.serve.grpc_util import RayServegRPCContext

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Requests above this many bytes are tokenized off the event loop (as the HTTP path does).
_LARGE_REQUEST_BYTES = 64 * 1024
_HEALTH_TIMEOUT_S = 10.0
MAX_REQUEST_ID_CHARS = 128


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


def _fail(grpc_context: RayServegRPCContext | None, error: errors.APIError) -> GrpcStatusError:
    """Sets the error's status on the call; returns the exception for a stream to raise."""
    code = status_code_of(error)
    if error.status >= 500:
        logger.warning("gRPC request failed: %s %s", code.name, error.message)
    if grpc_context is not None:
        grpc_context.set_code(code)
        grpc_context.set_details(error.message)
    return GrpcStatusError(code, error.message)


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
        clock = Clock()
        try:
            stream = await self._grpc_start(request, clock, self._grpc_authenticate(grpc_context))
            response = pb.GenerateResponse(request_id=stream.request_id, model=self._grpc_host.settings.served_model_name)
            texts = self._grpc_host.texts
            used = 0  # prompt + completion tokens so far (usage is only set at the end)
            try:
                async for event in stream:
                    out = event.output
                    clock.observe(out)
                    used = max(used, out.num_prompt_tokens + out.num_output_tokens)
                    response.text += out.text_delta
                    response.token_ids.extend(out.new_token_ids)
                    response.logprobs.extend(token_logprobs(out.logprobs, texts))
                    if out.finished:
                        set_finish(response, out)
            finally:
                stream.close()  # also when the client cancels (CancelledError here)
                _settle(stream, used)  # a cancelled call is charged what it generated
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
        clock = Clock()
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
                    set_finish(message, out)
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
        self, request: pb.GenerateRequest, clock: Clock, principal: Principal = ANONYMOUS
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
        permit = await admit(principal, 1) if admit is not None else host.limiter.acquire(1)
        try:
            info = await self._grpc_info()
            inputs = await _off_loop_if_large(
                request.ByteSize(), engine_inputs, request, model, host.tokenizer, info["max_model_len"]
            )
            if isinstance(permit, JointPermit):
                await self.charge(permit, inputs)  # type: ignore[attr-defined]
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

