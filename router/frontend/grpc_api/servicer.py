"""The ingress's gRPC API (protos/kvserve/v1/kvserve.proto): a thin front end over the
request pipeline that HTTP uses too (router/frontend/pipeline.py).

    @serve.ingress(app)
    class Ingress(GrpcMethods):                    # router/frontend/ingress.py
        def __init__(...): self.grpc = GrpcServicer(pipeline)

Serve's gRPC proxy deserializes the request with the generated stubs, then calls the
ingress deployment's method named after the RPC (`Generate`, `GenerateStream`, ...),
passing Serve's `RayServegRPCContext` as the keyword argument `grpc_context`; a streaming
RPC is an async generator method. `GrpcMethods` gives the ingress class those methods,
each handing the call to its `grpc` attribute, a `GrpcServicer`. A servicer method
converts the message (router/frontend/grpc_api/convert.py: validated through the OpenAI request
models, one set of rules and messages for both APIs), runs it through the pipeline
(admit, tokenize, charge, stream, settle) and converts the events back.

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
proxy_response_generator.py, pinned by tests/integration/test_grpc_api.py): when the
client cancels, grpc cancels the proxy's handler task; ProxyResponseGenerator catches the
CancelledError and calls `.cancel()` on the response, which cancels the replica's call:
a CancelledError is raised in the method here, whose `finally` closes the
GenerationStream, which cancels the worker call, and the engine aborts the request (its
KV blocks are freed within a step). Serve alone misses one case (a client that stopped
reading, so the proxy was blocked in a write when the cancel came: the request ran on to
max_tokens); router/frontend/grpc_api/proxy.py's servicer function closes it.
"""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from protos.kvserve.v1 import kvserve_pb2 as pb
from router import errors
from router.frontend.auth import ANONYMOUS, Principal, grpc_authorization, grpc_metadata_value
from router.frontend.generation import GenerationStream
from router.frontend.grpc_api.convert import (
    Clock, echo_text, engine_inputs, num_choices, prompt_logprobs, replica_stats, set_finish, set_stop, status_code_of,
    token_logprobs, tokenize,
)
from router.frontend.pipeline import RequestPipeline
from router.routing import SESSION_HEADER, client_session_id

if TYPE_CHECKING:
    from ray.serve.grpc_util import RayServegRPCContext

logger = logging.getLogger(__name__)

R = TypeVar("R")

MAX_REQUEST_ID_CHARS = 128


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


async def _unary(grpc_context: RayServegRPCContext | None, empty: R, call: Awaitable[R]) -> R:
    """A unary RPC's reply, or `empty` with the error's status set on the call (raised
    instead when there is no call to set it on: a direct call, as in unit tests)."""
    try:
        return await call
    except errors.APIError as e:
        error = _fail(grpc_context, e)
        if grpc_context is None:
            raise error from None
        return empty


class GrpcServicer:
    """The KVServe service over the request pipeline (see the module doc)."""

    def __init__(self, pipeline: RequestPipeline) -> None:
        self.pipeline = pipeline

    # -- RPCs ------------------------------------------------------------------------------
    async def Generate(
        self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext | None = None
    ) -> pb.GenerateResponse:
        return await _unary(grpc_context, pb.GenerateResponse(), self._generate(request, grpc_context))

    async def _generate(self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext | None) -> pb.GenerateResponse:
        clock = Clock()
        stream = await self._start(request, clock, self._authenticate(grpc_context), grpc_context, stream=False)
        response = pb.GenerateResponse(request_id=request.request_id or stream.request_id, model=self._model(request.model))
        tokenizer, prompts = self.pipeline.tokenizer, {inp.index: inp.prompt_token_ids for inp in stream.inputs}
        choices = {i: pb.Choice(index=i, text=echo_text(request, ids, tokenizer)) for i, ids in prompts.items()}
        usage = pb.Usage()
        try:
            async for event in stream:
                out, choice = event.output, choices[event.index]
                clock.observe(out)
                if out.prompt_logprobs is not None:
                    choice.prompt_logprobs.extend(prompt_logprobs(out.prompt_logprobs, prompts[event.index], self.pipeline.texts))
                choice.text += out.text_delta
                choice.token_ids.extend(out.new_token_ids)
                choice.logprobs.extend(token_logprobs(out.logprobs, self.pipeline.texts))
                if out.finished:
                    set_stop(choice, out)
                    # The choices share the prompt: it counts once, the outputs add up.
                    usage.prompt_tokens = out.num_prompt_tokens
                    usage.completion_tokens += out.num_output_tokens
                    usage.cached_prompt_tokens = max(usage.cached_prompt_tokens, out.num_cached_tokens)
        finally:
            stream.close()  # also when the client cancels (CancelledError here): settles
        response.choices.extend(choices[i] for i in sorted(choices))
        first = response.choices[0]
        response.text, response.finish_reason = first.text, first.finish_reason
        response.token_ids.extend(first.token_ids)
        response.logprobs.extend(first.logprobs)
        response.prompt_logprobs.extend(first.prompt_logprobs)
        if first.HasField("stop_reason"):
            setattr(response, first.WhichOneof("stop_reason"), getattr(first, first.WhichOneof("stop_reason")))
        response.usage.CopyFrom(usage)
        response.timing.CopyFrom(clock.timing())
        return response

    async def GenerateStream(
        self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext | None = None
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        clock = Clock()
        try:
            stream = await self._start(request, clock, self._authenticate(grpc_context), grpc_context)
        except errors.APIError as e:
            raise _fail(grpc_context, e) from None
        # Each choice's first message leads with the echo and carries the prompt logprobs.
        prompts = {inp.index: inp.prompt_token_ids for inp in stream.inputs}
        try:
            async for event in stream:
                out = event.output
                if not (out.new_token_ids or out.text_delta or out.finished):
                    continue
                clock.observe(out)
                ids = prompts.pop(event.index, None)
                message = pb.GenerateStreamResponse(
                    request_id=request.request_id or stream.request_id,
                    index=event.index,
                    token_ids=out.new_token_ids,
                    text=(echo_text(request, ids, self.pipeline.tokenizer) if ids is not None else "") + out.text_delta,
                    logprobs=token_logprobs(out.logprobs, self.pipeline.texts),
                    prompt_logprobs=prompt_logprobs(out.prompt_logprobs, ids or [], self.pipeline.texts),
                )
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

    async def Tokenize(
        self, request: pb.TokenizeRequest, grpc_context: RayServegRPCContext | None = None
    ) -> pb.TokenizeResponse:
        return await _unary(grpc_context, pb.TokenizeResponse(), self._tokenize(request, grpc_context))

    async def _tokenize(self, request: pb.TokenizeRequest, grpc_context: RayServegRPCContext | None) -> pb.TokenizeResponse:
        pipeline = self.pipeline
        principal = self._authenticate(grpc_context)
        await pipeline.lora.refresh(request.model)
        model = self._model(request.model)
        _check_size(request, pipeline.settings.max_body_bytes)
        ids = await pipeline.tokenizer_work(principal, request.ByteSize(), tokenize, request, model, pipeline.tokenizer)
        info = await pipeline.workers.model_info()
        response = pb.TokenizeResponse(token_ids=ids, count=len(ids), max_model_len=info["max_model_len"])
        if request.return_token_strings:
            response.tokens.extend(pipeline.texts(t) for t in ids)
        return response

    async def ListModels(
        self, request: pb.ListModelsRequest, grpc_context: RayServegRPCContext | None = None
    ) -> pb.ListModelsResponse:
        return await _unary(grpc_context, pb.ListModelsResponse(), self._list_models(grpc_context))

    async def _list_models(self, grpc_context: RayServegRPCContext | None) -> pb.ListModelsResponse:
        admin = self._authenticate(grpc_context).admin  # directories are for admin keys only
        info = await self.pipeline.workers.model_info()
        settings = self.pipeline.settings
        model = pb.ModelInfo(
            id=settings.served_model_name,
            root=settings.tokenizer_path if admin else settings.served_model_name,
            max_model_len=info["max_model_len"],
            vocab_size=info.get("vocab_size", 0),
            block_size=info.get("block_size", 0),
        )
        models = [model] + [
            pb.ModelInfo(id=name, root=path if admin else name, parent=settings.served_model_name, max_model_len=info["max_model_len"],
                         vocab_size=info.get("vocab_size", 0), block_size=info.get("block_size", 0))
            for name, path in sorted(self.pipeline.lora.paths.items())
        ]
        return pb.ListModelsResponse(models=models)

    async def Health(
        self, request: pb.HealthRequest, grpc_context: RayServegRPCContext | None = None
    ) -> pb.HealthResponse:
        """SERVING when a worker answers its health check in time (as GET /health), else
        NOT_SERVING with the reason; the call itself succeeds either way, as in
        grpc.health.v1. NOT_SERVING while the ingress drains (router/frontend/grpc_api/health.py turns
        this verdict into grpc.health.v1's)."""
        if self.pipeline.limiter.draining:
            return pb.HealthResponse(status=pb.HealthResponse.STATUS_NOT_SERVING, message="draining: shutting down")
        reason = await self.pipeline.workers.health.reason()  # cached: no worker call per probe
        if reason is not None:
            return pb.HealthResponse(status=pb.HealthResponse.STATUS_NOT_SERVING, message=reason)
        return pb.HealthResponse(status=pb.HealthResponse.STATUS_SERVING)

    async def Stats(
        self, request: pb.StatsRequest, grpc_context: RayServegRPCContext | None = None
    ) -> pb.StatsResponse:
        return await _unary(grpc_context, pb.StatsResponse(), self._stats(grpc_context))

    async def _stats(self, grpc_context: RayServegRPCContext | None) -> pb.StatsResponse:
        self._authenticate(grpc_context)
        limiter = self.pipeline.limiter
        response = pb.StatsResponse(ingress_in_flight=limiter.in_flight, ingress_max_in_flight=limiter.limit, timestamp=time.time())
        for stats in await self.pipeline.workers.stats():
            replica = replica_stats(stats)
            response.replicas.append(replica)
            response.free_blocks += replica.free_blocks
            response.total_blocks += replica.total_blocks
            response.free_tokens += replica.free_blocks * replica.block_size
            response.num_running += replica.num_running
            response.num_waiting += replica.num_waiting
        response.replicas.sort(key=lambda r: (r.pool, r.replica_id))
        return response

    # -- conversion ------------------------------------------------------------------------
    def _authenticate(self, grpc_context: RayServegRPCContext | None) -> Principal:
        """The caller, from the `authorization: Bearer KEY` metadata; APIError 401 (->
        UNAUTHENTICATED) when keys are configured and it is missing or wrong."""
        if not self.pipeline.api_keys.enabled:
            return ANONYMOUS
        metadata = grpc_context.invocation_metadata() if grpc_context is not None else None
        return self.pipeline.authenticate(grpc_authorization(metadata))

    def _model(self, model: str) -> str:
        """The served model's name (empty means it) or a LoRA adapter's. Another name:
        NOT_FOUND, listing the known ones."""
        lora = self.pipeline.lora.resolve(model)
        return lora[0] if lora is not None else self.pipeline.settings.served_model_name

    async def _start(self, request: pb.GenerateRequest, clock: Clock, principal: Principal,
                     grpc_context: RayServegRPCContext | None, stream: bool = True) -> GenerationStream:
        """Validates the message, then runs it through the pipeline (which waits for the
        first output, so that errors before any token have their status). The session is
        the `x-session-id` metadata's (router/routing/sessions.py)."""
        async with self.pipeline.intake.slot():  # router/frontend/intake.py
            return await self._start_in_slot(request, clock, principal, grpc_context, stream)

    async def _start_in_slot(self, request: pb.GenerateRequest, clock: Clock, principal: Principal,
                             grpc_context: RayServegRPCContext | None, stream: bool) -> GenerationStream:
        await self.pipeline.lora.refresh(request.model)  # the cluster's run-time adapters
        model = self._model(request.model)
        _check_size(request, self.pipeline.settings.max_body_bytes)
        # The client's id names the engine request and appears in logs: short and printable.
        if len(request.request_id) > MAX_REQUEST_ID_CHARS or not request.request_id.isprintable():
            raise errors.bad_request(
                f"request_id must be at most {MAX_REQUEST_ID_CHARS} printable characters.", "request_id", "invalid_value"
            )
        tokenizer, max_n = self.pipeline.tokenizer, self.pipeline.settings.max_n
        n = num_choices(request, max_n)  # before any work: the in-flight share is n
        metadata = grpc_context.invocation_metadata() if grpc_context is not None else None
        return await self.pipeline.start(
            principal,
            n,
            request.ByteSize(),
            lambda max_model_len: engine_inputs(request, model, tokenizer, max_model_len, max_n),
            engine_request_id(request.request_id),
            clock.arrival,
            client_session_id(grpc_metadata_value(metadata, SESSION_HEADER), None),
            stream=stream, lora=self.pipeline.lora.resolve(request.model),
            offload=request.WhichOneof("constraint") is not None,  # a grammar to check
            priority=request.priority if request.HasField("priority") else None,
        )


def engine_request_id(client_id: str) -> str:
    """The id the engine request runs under. The client's own id (echoed in every response)
    is not unique across keys or calls: as the engine's id, another key's request with the
    same one would be refused as "already in use" (or fail the first). A random suffix
    scopes it to this call; the client's part keeps it findable in logs."""
    suffix = uuid.uuid4().hex
    return f"{client_id}.{suffix[:12]}" if client_id else f"grpc-{suffix}"


class GrpcMethods:
    """The KVServe RPCs as methods of the ingress deployment class, where Serve's gRPC proxy
    looks for them; each hands the call to the class's `grpc` servicer. (No `__init__`: a
    subclass of a @serve.ingress class must keep the wrapper's async one.)"""

    grpc: GrpcServicer

    async def Generate(self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext | None = None) -> pb.GenerateResponse:
        return await self.grpc.Generate(request, grpc_context)

    async def GenerateStream(
        self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext | None = None
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        # aclosing: when Serve closes or cancels this generator, the servicer's closes at
        # once (its finally cancels the worker call), not whenever it is collected.
        async with aclosing(self.grpc.GenerateStream(request, grpc_context)) as messages:
            async for message in messages:
                yield message

    async def Tokenize(self, request: pb.TokenizeRequest, grpc_context: RayServegRPCContext | None = None) -> pb.TokenizeResponse:
        return await self.grpc.Tokenize(request, grpc_context)

    async def ListModels(
        self, request: pb.ListModelsRequest, grpc_context: RayServegRPCContext | None = None
    ) -> pb.ListModelsResponse:
        return await self.grpc.ListModels(request, grpc_context)

    async def Health(self, request: pb.HealthRequest, grpc_context: RayServegRPCContext | None = None) -> pb.HealthResponse:
        return await self.grpc.Health(request, grpc_context)

    async def Stats(self, request: pb.StatsRequest, grpc_context: RayServegRPCContext | None = None) -> pb.StatsResponse:
        return await self.grpc.Stats(request, grpc_context)


def _check_size(request: Any, limit: int) -> None:
    """The HTTP body cap for gRPC messages too (Serve's proxy accepts up to 2 GiB)."""
    if request.ByteSize() > limit:
        raise errors.APIError(
            413, f"The request message is larger than {limit} bytes.", "invalid_request_error", None, "request_too_large"
        )
