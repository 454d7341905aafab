"""The HTTP ingress: a Ray Serve FastAPI deployment speaking OpenAI's API.

Each handler is thin: read and validate the body, convert it (router/openai_convert.py:
tokenized once, here), send the engine requests through the worker handle
(router/generation.py), convert the outputs back. Limits, checked before any work:

- no or a wrong API key (when keys are configured, router/auth.py) -> 401
- body over `max_body_bytes`                    -> 413 (Content-Length, then while reading)
- malformed JSON, unknown field, bad value       -> 400
- unknown model                                  -> 404
- prompt + max_tokens over max_model_len, n over max_n -> 400
- more than `max_queued_requests` (weighted by n) in flight on this replica -> 429 at once
- over the API key's concurrent requests or tokens per minute -> 429 at once
- no result within `request_timeout_s`           -> 504

Endpoints: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics; all but
/health need the API key when keys are configured (/metrics too, unless metrics_public). The
gRPC methods come from router/grpc_servicer.py's mixin (same helpers, same limits).

No `from __future__ import annotations` here: Serve rebuilds the FastAPI routes of the
class, and FastAPI must then resolve the handlers' annotations (`Request`) at runtime.
"""
import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from router import errors
from router import openai_convert as convert
from router.auth import ANONYMOUS, ApiKeys, Principal
from router.key_limits import JointPermit, KeyLimits, worst_case_tokens
from router import openai_protocol as p
from router.disagg import DisaggregatedGenerate
from router.generation import GenerationStream, InFlightLimiter, Permit
from router.metrics import CONTENT_TYPE, IngressMetrics
from router.settings import IngressSettings

try:  # the gRPC API (router/grpc_servicer.py), when grpc and the generated stubs import
    from router.grpc_servicer import GrpcServicerMixin
except ImportError:  # HTTP only

    class GrpcServicerMixin:  # type: ignore[no-redef]
        pass

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

# Bodies above this are tokenized off the event loop (a long prompt takes milliseconds).
_LARGE_BODY_BYTES = 64 * 1024

app = FastAPI(title="kvserve", docs_url=None, redoc_url=None, openapi_url=None)


@app.exception_handler(errors.APIError)
async def _api_error(request: Request, exc: errors.APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    body = errors.APIError(exc.status_code, str(exc.detail), "invalid_request_error").body()
    return JSONResponse(body, status_code=exc.status_code)


@app.exception_handler(Exception)
async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s", request.url.path)
    return JSONResponse(errors.internal(f"Internal error: {type(exc).__name__}.").body(), status_code=500)


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise errors.body_too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise errors.body_too_large(limit)
    try:
        data = json.loads(body)
    except ValueError as e:
        raise errors.bad_request(f"The request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise errors.bad_request("The request body must be a JSON object.", None, "invalid_json")
    if _SURROGATE_ESCAPE.search(body) and _has_lone_surrogate(data):
        # JSON may spell a lone UTF-16 surrogate ("\ud83d"); Python keeps it in the str,
        # and the tokenizer and the response encoder then fail on it (a 500 before this).
        raise errors.bad_request(
            "The request body contains a lone UTF-16 surrogate escape (such as \\ud83d without its pair); "
            "strings must be valid Unicode.", None, "invalid_json"
        )
    return data


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def _has_lone_surrogate(data: Any) -> bool:
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def parse(model: type[M], data: dict[str, Any]) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise errors.from_validation_error(e) from None


def load_tokenizer(path: str, trust_remote_code: bool) -> Any:
    # The workers' own loader (torch-free): a .gguf file's tokenizer is read from the file.
    from worker.model_config import load_tokenizer as load

    return load(path, trust_remote_code)


async def _wait(awaitable: Awaitable[Any], timeout_s: float) -> Any:
    async def inner() -> Any:
        return await awaitable

    return await asyncio.wait_for(inner(), timeout_s)


def _prompt_lengths(inputs: list[convert.EngineInput]) -> list[int]:
    lengths: dict[int, int] = {}
    for inp in inputs:
        lengths[inp.prompt_index] = len(inp.prompt_token_ids)
    return list(lengths.values())


async def _sse_events(
    stream: GenerationStream,
    formatter: convert.CompletionFormatter | convert.ChatFormatter,
    prompt_lengths: list[int],
    include_usage: bool,
    continuous_usage: bool,
    settle: Callable[[int], None] | None = None,  # tokens used, for the key's budget
) -> AsyncIterator[str]:
    """`data: {chunk}` events, an optional usage chunk, then `data: [DONE]`. An error
    after the first token can only be reported in the stream: an error event, then DONE."""
    states = {inp.index: convert.ChoiceState(inp.index, inp.prompt_index) for inp in stream.inputs}
    try:
        for chunk in formatter.start_chunks(sorted(states)):
            yield convert.sse(chunk)
        async for event in stream:
            states[event.index].add(event.output)
            chunk = formatter.delta_chunk(event.index, event.output)
            if chunk is not None:
                if include_usage and continuous_usage:
                    chunk.usage = convert.usage_of(list(states.values()), prompt_lengths)
                yield convert.sse(chunk)
        if include_usage:
            yield convert.sse(formatter.usage_chunk(convert.usage_of(list(states.values()), prompt_lengths)))
    except errors.APIError as e:
        yield convert.sse(e.body())
    except Exception as e:  # a bug: still end the stream in a way clients understand
        logger.exception("stream %s failed", stream.request_id)
        yield convert.sse(errors.internal(f"The request failed: {type(e).__name__}.").body())
    finally:
        stream.close()  # also on client disconnect (this generator is cancelled)
        if settle is not None:
            settle(convert.usage_of(list(states.values()), prompt_lengths).total_tokens)
    yield convert.SSE_DONE


# Serve snapshots what the class refers to when `serve.ingress` runs: everything the
# class uses must be defined above this line.
@serve.ingress(app)
class Ingress(GrpcServicerMixin):
    def __init__(
        self, worker: Any, settings: IngressSettings, prefill_worker: Any = None, max_waiting_for_decode: int = 256
    ) -> None:
        self.settings = settings
        self.worker = worker  # DeploymentHandle of the worker deployment (the decode pool when disaggregated)
        self._generate = worker.options(stream=True)
        if prefill_worker is not None:  # prefill/decode disaggregation (router/disagg.py)
            self._generate = DisaggregatedGenerate(prefill_worker, worker, max_waiting_for_decode)
        self.tokenizer = load_tokenizer(settings.tokenizer_path, settings.trust_remote_code)
        self.texts = convert.TokenTexts(self.tokenizer)
        self.metrics = IngressMetrics(settings.served_model_name)
        self.limiter = InFlightLimiter(settings.max_queued_requests, self.metrics)
        # Digests only (router/auth.py); a malformed entry fails the replica's start.
        self.api_keys = ApiKeys.from_env(settings.api_keys_env)
        self.api_keys.log_startup(settings.api_keys_env)
        # Per-key limits: counted here, or cluster-wide in the shared store cluster/ injected.
        store = settings.state_store.build() if settings.state_store is not None else None
        self.key_limits = KeyLimits(settings.max_concurrent_requests_per_key, settings.tokens_per_minute_per_key, store=store)
        self._model_info: dict[str, Any] | None = None

    # -- OpenAI endpoints ------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        principal = self._authenticate(request)
        body = await read_json(request, self.settings.max_body_bytes)
        req = parse(p.CompletionRequest, body)
        self._check_model(req.model)
        convert.check_n(req.n, self.settings.max_n)
        num_prompts = 1 if isinstance(req.prompt, str) or all(isinstance(x, int) for x in req.prompt) else len(req.prompt)
        # A list of prompts multiplies the engine requests as n does: bounded the same way
        # (by the in-flight bound, or max_n when that is larger), before any tokenizing.
        max_choices = max(self.limiter.limit, self.settings.max_n)
        if req.n * num_prompts > max_choices:
            raise errors.bad_request(
                f"This request asks for {req.n * num_prompts} completions ({num_prompts} prompts x n={req.n}); "
                f"this server allows at most {max_choices} per request.",
                "prompt",
                "invalid_value",
            )
        permit = await self.admit(principal, req.n * num_prompts)
        try:
            info = await self._info()
            inputs = await self._convert(
                len(body), convert.completion_inputs, req, self.tokenizer, info["max_model_len"], self.settings.max_n
            )
            await self.charge(permit, inputs)
        except BaseException:
            permit.release()
            raise
        request_id = f"cmpl-{uuid.uuid4().hex}"
        formatter = convert.CompletionFormatter(request_id, self.settings.served_model_name, self.texts, req.logprobs is not None)
        return await self._respond(inputs, formatter, req, permit, arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        principal = self._authenticate(request)
        body = await read_json(request, self.settings.max_body_bytes)
        req = parse(p.ChatCompletionRequest, body)
        self._check_model(req.model)
        convert.check_n(req.n, self.settings.max_n)
        permit = await self.admit(principal, req.n)
        try:
            info = await self._info()
            inputs = await self._convert(
                len(body), convert.chat_inputs, req, self.tokenizer, info["max_model_len"], self.settings.max_n
            )
            await self.charge(permit, inputs)
        except BaseException:
            permit.release()
            raise
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        formatter = convert.ChatFormatter(request_id, self.settings.served_model_name, self.texts, req.logprobs)
        return await self._respond(inputs, formatter, req, permit, arrival)

    @app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        self._authenticate(request)
        info = await self._info()
        card = p.ModelCard(id=self.settings.served_model_name, root=self.settings.tokenizer_path, max_model_len=info["max_model_len"])
        return JSONResponse(p.ModelList(data=[card]).model_dump())

    @app.get("/health")
    async def health(self) -> JSONResponse:
        """200 when a worker answers its health check; 503 otherwise."""
        try:
            await _wait(self.worker.check_health.remote(), 10.0)
        except Exception as e:
            error = errors.APIError(503, f"No healthy worker: {type(e).__name__}", "server_error", None, "unhealthy")
            return JSONResponse(error.body(), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        if not self.settings.metrics_public:
            self._authenticate(request)
        return Response(self.metrics.render(await self._worker_stats()), media_type=CONTENT_TYPE)

    # -- shutdown (cluster/cli.py, on SIGTERM) --------------------------------------------------
    async def begin_drain(self) -> int:
        """Refuse new requests with 503 from now on; running ones go on. Returns how many
        (weighted by n) are still in flight."""
        self.limiter.draining = True
        return self.limiter.in_flight

    async def num_in_flight(self) -> int:
        return self.limiter.in_flight

    # -- plumbing ----------------------------------------------------------------------------
    def _authenticate(self, request: Request) -> Principal:
        return self.api_keys.authenticate(request.headers.get("authorization"))

    async def admit(self, principal: Principal, weight: int) -> JointPermit:
        """The key's concurrency slot, then this replica's in-flight share (429 for either)."""
        lease = None
        if principal is not ANONYMOUS and self.key_limits.enabled:
            lease = await self.key_limits.acquire(principal.key_id)
        try:
            permit = self.limiter.acquire(weight)
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        return JointPermit(permit, lease)

    async def charge(self, permit: JointPermit, inputs: list[convert.EngineInput]) -> None:
        """Takes the request's worst case from its key's tokens-per-minute budget (429)."""
        if permit.lease is not None:
            await permit.lease.charge(worst_case_tokens(inputs))

    def _check_model(self, model: str) -> None:
        if model != self.settings.served_model_name:
            raise errors.model_not_found(model)

    async def _info(self) -> dict[str, Any]:
        """The workers' model facts, fetched once. `max_model_len` is the longest sequence
        a worker can hold: the model's limit, or the KV pool's when that is smaller (so that
        a default max_tokens always fits, and a too-long request is a 400 here)."""
        if self._model_info is None:
            info = dict(await self.worker.model_info.remote())
            stats = await self.worker.stats.remote()
            capacity = int(stats["total_blocks"]) * int(info["block_size"])
            info["max_model_len"] = min(int(info["max_model_len"]), capacity)
            self._model_info = info
        return self._model_info

    async def _convert(self, body_bytes: int, fn: Callable[..., list[convert.EngineInput]], *args: Any) -> list[convert.EngineInput]:
        if body_bytes > _LARGE_BODY_BYTES:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    async def _worker_stats(self) -> list[dict[str, Any]]:
        """`stats` of every worker replica (Serve's broadcast); ones that fail are left out."""
        try:
            results = await self.worker.broadcast("stats").results_async(
                timeout_s=self.settings.stats_timeout_s, return_exceptions=True
            )
        except Exception as e:
            logger.warning("worker stats unavailable: %r", e)
            return []
        return [r for r in results if isinstance(r, dict)]

    async def _respond(
        self,
        inputs: list[convert.EngineInput],
        formatter: convert.CompletionFormatter | convert.ChatFormatter,
        req: p.CompletionRequest | p.ChatCompletionRequest,
        permit: JointPermit,
        arrival: float,
    ) -> Response:
        stream = GenerationStream(
            self._generate, inputs, formatter.request_id, permit, self.settings.request_timeout_s, self.metrics, arrival,
            max_migrations=self.settings.max_migrations,
        )
        try:
            await stream.start()  # errors before the first token become HTTP statuses
        except BaseException:
            permit.settle(0)
            raise
        prompt_lengths = _prompt_lengths(inputs)
        if req.stream:
            continuous = req.stream_options is not None and req.stream_options.continuous_usage_stats
            events = _sse_events(stream, formatter, prompt_lengths, req.include_usage, continuous, permit.settle)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        states = {inp.index: convert.ChoiceState(inp.index, inp.prompt_index) for inp in inputs}
        try:
            async for event in stream:
                states[event.index].add(event.output)
        finally:
            permit.settle(convert.usage_of(list(states.values()), prompt_lengths).total_tokens)
        usage = convert.usage_of(list(states.values()), prompt_lengths)
        return JSONResponse(formatter.response(list(states.values()), usage).model_dump())
