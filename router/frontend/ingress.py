"""The HTTP ingress: a Ray Serve FastAPI deployment speaking OpenAI's API.

Each handler is thin: read and validate the body (router/frontend/openai_api/http_body.py), run it
through the request pipeline that gRPC uses too (router/frontend/pipeline.py: admit,
tokenize once here, charge the key's budget, stream through the worker handle, settle),
convert the events back to OpenAI's JSON or server-sent events
(router/frontend/openai_api/http_response.py). Limits, checked before any work:

- no or a wrong API key (when keys are configured, router/frontend/auth.py) -> 401
- body over `max_body_bytes`                    -> 413 (Content-Length, then while reading)
- body not all there within `body_read_timeout_s` -> 408
- malformed JSON, unknown field, bad value       -> 400
- unknown model                                  -> 404
- prompt + max_tokens over max_model_len, n over max_n -> 400
- more than `max_queued_requests` (weighted by n) in flight on this replica -> 429 at once
- no worker can take it (KV headroom, queue bound): held (router/routing/admission.py); the hold
  queue full or `admission_max_wait_s` passed -> 429 with Retry-After
- over the API key's concurrent requests or tokens per minute -> 429 at once
- no result within `request_timeout_s`           -> 504

Endpoints: /v1/completions, /v1/chat/completions, /v1/responses and Anthropic's
/v1/messages (translations onto chat: router/frontend/responses_api/, messages_api/), /v1/models, vLLM's /tokenize,
/detokenize and /version, /health, /metrics; all but /health need the API key
when keys are configured (/metrics too, unless metrics_public). The
gRPC methods come from router/frontend/grpc_api/servicer.py (GrpcMethods -> GrpcServicer, the same pipeline).

No `from __future__ import annotations` here: Serve rebuilds the FastAPI routes of the
class, and FastAPI must then resolve the handlers' annotations (`Request`) at runtime.
"""
import asyncio
import logging
import time
import uuid
from dataclasses import replace
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any, Optional, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from router import errors
from router.frontend.openai_api import convert as convert
from router.frontend.openai_api import protocol as p
from router.frontend.openai_api import tokenize_api as tk
from router.frontend.auth import ApiKeys, Principal, require_admin
from router.frontend.grpc_api.servicer import GrpcMethods
from router.frontend.openai_api.http_body import parse, read_json
from router.frontend.openai_api.http_response import echo_texts, respond
from router.frontend.lora_modules import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from router.frontend.metrics import CONTENT_TYPE
from router.frontend.messages_api.endpoint import authorization_of
from router.frontend.models.directory import ModelDirectory
from router.frontend.models.grpc_models import ModelsGrpc
from router.frontend.models.metrics_merge import render_models
from router.frontend.models.pools import ModelPools
from router.frontend.models.serving import ModelServing, build_servings, model_cards, serving_of
from router.frontend.intake import IntakeWindow
from router.frontend.messages_api.errors import error_response
from router.routing import SESSION_HEADER, client_session_id
from router.frontend.settings import MAX_WAITING_FOR_DECODE, IngressSettings
from router.frontend.openai_api.structured import has_grammar
from router.frontend.tool_calling.chat_tools import tool_mode
from router.frontend.reasoning.choose import reasoning_factory
from router.tracing import ClientTraceContext

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

try:
    KVSERVE_VERSION = package_version("kvserve")
except PackageNotFoundError:  # run from a source tree without an install
    KVSERVE_VERSION = "0+unknown"

app = FastAPI(title="kvserve", docs_url=None, redoc_url=None, openapi_url=None)
app.add_middleware(ClientTraceContext)  # a client's traceparent, when accepted (router/tracing.py)


@app.exception_handler(errors.APIError)
async def _api_error(request: Request, exc: errors.APIError) -> JSONResponse:
    retry_after = getattr(exc, "retry_after_s", None)  # admission control's sheds (router/routing/admission.py)
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    body = errors.APIError(exc.status_code, str(exc.detail), "invalid_request_error").body()
    return JSONResponse(body, status_code=exc.status_code)


@app.exception_handler(Exception)
async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s", request.url.path)
    return JSONResponse(errors.internal(f"Internal error: {type(exc).__name__}.").body(), status_code=500)


def _model_name(lora: tuple[str, str] | None, settings: IngressSettings) -> str:
    """The `model` a response names: the adapter's, or the served model's."""
    return lora[0] if lora is not None else settings.served_model_name


def _body_model(body: Any) -> Optional[str]:
    """The `model` of a JSON body, when it is a string (the endpoint's own parsing says
    what is wrong with any other)."""
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None


def flush_replica_log() -> None:
    """Write this replica's buffered log lines to its file now. In Serve's throughput mode
    (cluster/serve_env.py) a replica's `ray.serve` logger, where kvserve's own lines arrive
    through the replica's redirected stderr, keeps lines below ERROR in a buffer of
    RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE records."""
    for handler in logging.getLogger("ray.serve").handlers:
        handler.flush()


# Serve snapshots what the class refers to when `serve.ingress` runs: everything the
# class uses must be defined above this line.
@serve.ingress(app)
class Ingress(GrpcMethods):
    def __init__(
        self, worker: Any, settings: IngressSettings, prefill_worker: Any = None,
        max_waiting_for_decode: int = MAX_WAITING_FOR_DECODE, other_models: tuple[ModelPools, ...] = (),
    ) -> None:
        """The first model's pools and settings (the one model of a single-model app), and
        the other models' (router/frontend/models/): the ingress-wide settings (limits,
        keys) are the first model's."""
        if settings.setup is not None:  # this process's set-up from cluster/ (tracing: cluster/tracing.py)
            settings.setup()
        self.settings = settings
        # Digests only (router/frontend/auth.py); a malformed entry fails the replica's start.
        api_keys = ApiKeys.from_env(settings.api_keys_env, admin_name=settings.admin_api_keys_env)
        api_keys.log_startup(settings.api_keys_env)
        replica_id = serve.get_replica_context().replica_id.unique_id
        # The models share this replica's arrival order, its stored responses and the per-key limits.
        first, *others = build_servings([ModelPools(settings, worker, prefill_worker, max_waiting_for_decode),
                                         *other_models], api_keys, replica_id)
        self._models = ModelDirectory([first, *others], settings.key_models)
        self.pipeline = first.pipeline  # the first model's: keys, limits, operator endpoints
        self.grpc: Any = first.grpc if not others else ModelsGrpc(self._models)
        flush_replica_log()  # the start-up lines (the API-key warning among them) in the file now

    @property
    def served(self) -> ModelDirectory:
        """The served models. An ingress assembled around one `pipeline` without __init__
        (an endpoint's own tests) serves that pipeline's model."""
        if "_models" not in self.__dict__:
            settings = self.__dict__.get("settings", self.pipeline.settings)
            self._models = ModelDirectory([replace(serving_of(self.pipeline), settings=settings)], settings.key_models)
        return self._models

    @property
    def intake(self) -> IntakeWindow:
        """This replica's arrival order (router/frontend/intake.py), one for every model."""
        return self.served.default.pipeline.intake

    # -- OpenAI endpoints ------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        principal = self._authenticate(request)  # before an intake slot: no slot for a stranger
        async with self.intake.slot():  # router/frontend/intake.py
            serving, req, num_bytes = await self._read_for_model(request, p.CompletionRequest, principal)
            pipeline, settings = serving.pipeline, serving.settings
            convert.check_n(req.n, settings.max_n)
            num_prompts = 1 if isinstance(req.prompt, str) or all(isinstance(x, int) for x in req.prompt) else len(req.prompt)
            if num_prompts > settings.max_prompts_per_request:
                raise errors.bad_request(
                    f"This request has {num_prompts} prompts; this server allows at most "
                    f"{settings.max_prompts_per_request} per request.", "prompt", "invalid_value",
                )
            # A list of prompts multiplies the engine requests as n does: bounded the same way
            # (by the in-flight bound, or max_n when that is larger), before any tokenizing.
            max_choices = max(pipeline.limiter.limit, settings.max_n)
            if req.n * num_prompts > max_choices:
                raise errors.bad_request(
                    f"This request asks for {req.n * num_prompts} completions ({num_prompts} prompts x n={req.n}); "
                    f"this server allows at most {max_choices} per request.",
                    "prompt",
                    "invalid_value",
                )
            tokenizer, max_n = pipeline.tokenizer, settings.max_n
            lora = pipeline.lora.resolve(req.model)
            stream = await pipeline.start(
                principal, req.n * num_prompts, num_bytes,
                lambda max_model_len: convert.completion_inputs(req, tokenizer, max_model_len, max_n),
                f"cmpl-{uuid.uuid4().hex}", arrival, client_session_id(request.headers.get(SESSION_HEADER), req.user),
                stream=req.stream, lora=lora, offload=has_grammar(req), priority=req.priority,
            )
        formatter = convert.CompletionFormatter(stream.request_id, _model_name(lora, settings), pipeline.texts, req.logprobs is not None, req.prompt_logprobs)
        if req.echo:
            ids = {inp.index: inp.prompt_token_ids for inp in stream.inputs}
            formatter.set_echo(echo_texts(req.prompt, stream.inputs, tokenizer), ids, req.logprobs)
        return await respond(stream, formatter, req)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        principal = self._authenticate(request)  # before an intake slot: no slot for a stranger
        async with self.intake.slot():  # router/frontend/intake.py
            serving, req, num_bytes = await self._read_for_model(request, p.ChatCompletionRequest, principal)
            pipeline, settings = serving.pipeline, serving.settings
            convert.check_n(req.n, settings.max_n)
            tokenizer, max_n, parser = pipeline.tokenizer, settings.max_n, settings.tool_call_parser
            lora = pipeline.lora.resolve(req.model)
            stream = await pipeline.start(
                principal, req.n, num_bytes,
                lambda max_model_len: convert.chat_inputs(req, tokenizer, max_model_len, max_n, parser,
                                                          settings.reasoning_parser),
                f"chatcmpl-{uuid.uuid4().hex}", arrival, client_session_id(request.headers.get(SESSION_HEADER), req.user),
                stream=req.stream, lora=lora, offload=has_grammar(req), priority=req.priority,
            )
        mode = tool_mode(req, parser, getattr(tokenizer, "chat_template", None))
        # A grammar-held output (structured, a forced call) is all answer: nothing to split.
        reasoning = None if has_grammar(req) else reasoning_factory(
            settings.reasoning_parser, tokenizer, stream.inputs[0].prompt_token_ids)
        formatter = convert.ChatFormatter(stream.request_id, _model_name(lora, settings), pipeline.texts, req.logprobs, mode,
                                          req.prompt_logprobs, reasoning)
        return await respond(stream, formatter, req)

    # -- OpenAI's Responses API (router/frontend/responses_api/) ---------------------------
    @app.post("/v1/responses")
    async def create_response(self, request: Request) -> Response:
        arrival = time.monotonic()
        principal = self._authenticate(request)  # before an intake slot: no slot for a stranger
        async with self.intake.slot():
            body, num_bytes = await read_json(request, self.settings.max_body_bytes, self.settings.body_read_timeout_s)
            serving = await self.served.find(_body_model(body), principal)
            turn = await serving.responses.start(principal, body, num_bytes, arrival, request.headers.get(SESSION_HEADER))
        return await serving.responses.respond(turn)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(self, response_id: str, request: Request) -> JSONResponse:
        return await self.served.default.responses.retrieve(self._authenticate(request), response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str, request: Request) -> JSONResponse:
        return await self.served.default.responses.delete(self._authenticate(request), response_id)

    # -- Anthropic's Messages API (router/frontend/messages_api/): its own error shape -------
    @app.post("/v1/messages")
    async def create_message(self, request: Request) -> Response:
        arrival = time.monotonic()
        try:
            principal = self.pipeline.authenticate(authorization_of(request.headers))  # before an intake slot
            async with self.intake.slot():
                body, num_bytes = await read_json(request, self.settings.max_body_bytes, self.settings.body_read_timeout_s)
                serving = await self.served.find(_body_model(body), principal)
                turn = await serving.messages.start(principal, body, num_bytes, arrival, request.headers.get(SESSION_HEADER))
            return await serving.messages.respond(turn)
        except errors.APIError as e:
            return error_response(e)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(self, request: Request) -> Response:
        try:
            principal = self.pipeline.authenticate(authorization_of(request.headers))
            body, num_bytes = await read_json(request, self.settings.max_body_bytes, self.settings.body_read_timeout_s)
            serving = await self.served.find(_body_model(body), principal)
            return await serving.messages.count_tokens(principal, body, num_bytes)
        except errors.APIError as e:
            return error_response(e)

    @app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        principal = self._authenticate(request)
        cards = []
        for serving in self.served.allowed(principal):  # a key sees only the models it may use
            cards += await model_cards(serving, principal.admin)
        return JSONResponse(p.ModelList(data=cards).model_dump())

    # -- vLLM's LoRA adapter endpoints (router/frontend/lora_modules.py) ---------------------------
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> Response:
        require_admin(self._authenticate(request))  # before the body is read
        principal, req, _ = await self._read(request, LoadLoRAAdapterRequest)
        pipeline = (await self.served.find(req.base_model, principal)).pipeline  # its base model's pools
        return PlainTextResponse(await pipeline.lora.load(req, pipeline.workers.check_lora))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> Response:
        require_admin(self._authenticate(request))
        _, req, _ = await self._read(request, UnloadLoRAAdapterRequest)
        pipeline = self.served.owner_of(req.lora_name).pipeline
        message = await pipeline.lora.unload(req)
        await pipeline.workers.unload_lora(req.lora_name)  # the workers drop its weights
        return PlainTextResponse(message)

    # -- vLLM's utility endpoints -------------------------------------------------------------
    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(self, request: Request) -> JSONResponse:
        require_admin(self._authenticate(request))  # every tenant's cache on every replica
        counts = [await s.pipeline.workers.reset_prefix_cache() for s in self.served.servings.values()]
        num_reset, num_failed = sum(c[0] for c in counts), sum(c[1] for c in counts)
        return JSONResponse({"num_replicas_reset": num_reset, "num_replicas_failed": num_failed},
                            status_code=503 if num_failed else 200)

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> JSONResponse:
        """vLLM's /tokenize: the ids generation would see, with the context length."""
        principal = self._authenticate(request)
        serving, req, num_bytes = await self._read_for_model(request, tk.TokenizeRequest, principal)
        pipeline = serving.pipeline
        tokenizer = pipeline.tokenizer
        ids = await pipeline.tokenizer_work(principal, num_bytes, lambda: tk.tokenize_ids(req, tokenizer))
        info = await pipeline.workers.model_info()
        strs = [pipeline.texts(t) for t in ids] if req.return_token_strs else None
        out = tk.TokenizeResponse(count=len(ids), max_model_len=int(info["max_model_len"]), tokens=ids, token_strs=strs)
        return JSONResponse(out.model_dump(exclude_none=True))

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> JSONResponse:
        """vLLM's /detokenize: token ids back to text (special tokens kept, as vLLM)."""
        principal = self._authenticate(request)
        serving, req, num_bytes = await self._read_for_model(request, tk.DetokenizeRequest, principal)
        tokenizer = serving.pipeline.tokenizer
        text = await serving.pipeline.tokenizer_work(principal, num_bytes, lambda: tk.detokenize_text(req, tokenizer))
        return JSONResponse(tk.DetokenizeResponse(prompt=text).model_dump())

    @app.get("/version")
    async def version(self, request: Request) -> JSONResponse:
        """kvserve's version; behind the API key like every endpoint but /health (a
        version tells an attacker which known flaws to try)."""
        self._authenticate(request)
        return JSONResponse(tk.VersionResponse(version=KVSERVE_VERSION).model_dump())

    @app.get("/health")
    async def health(self) -> JSONResponse:
        """200 when a worker answers its health check; 503 otherwise, and while draining
        (a readiness probe then takes this instance out of rotation). Unauthenticated, so
        it reads the cached verdict (router/frontend/health_verdict.py): no worker call of
        its own, no internals in the body."""
        reason = "The server is shutting down." if self.pipeline.limiter.draining else None
        reason = reason or await self.served.unhealthy_reason()
        if reason is not None:
            error = errors.APIError(503, reason, "server_error", None, "unhealthy")
            return JSONResponse(error.body(), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        if not self.settings.metrics_public:
            self._authenticate(request)
        servings = list(self.served.servings.values())
        if len(servings) == 1:
            return Response(self.pipeline.metrics.render(await self.pipeline.workers.stats()), media_type=CONTENT_TYPE)
        stats = await asyncio.gather(*(s.pipeline.workers.stats() for s in servings))
        return Response(render_models([s.pipeline.metrics for s in servings], stats), media_type=CONTENT_TYPE)

    # -- shutdown (cluster/cli.py, on SIGTERM) --------------------------------------------------
    async def begin_drain(self) -> int:
        """Refuse new requests with 503 from now on; running ones go on. Returns how many
        (weighted by n) are still in flight."""
        return self.served.drain()

    async def num_in_flight(self) -> int:
        return self.served.in_flight()

    # -- plumbing ----------------------------------------------------------------------------
    def _authenticate(self, request: Request) -> Principal:
        return self.pipeline.authenticate(request.headers.get("authorization"))

    async def _read(self, request: Request, model: type[M], principal: Principal | None = None
                    ) -> tuple[Principal, M, int]:
        """Authenticate (unless the caller has: `principal`), read the JSON body (bounded)
        and validate it: every POST endpoint starts so."""
        principal = principal if principal is not None else self._authenticate(request)
        body, num_bytes = await read_json(request, self.settings.max_body_bytes, self.settings.body_read_timeout_s)
        return principal, parse(model, body), num_bytes

    async def _read_for_model(self, request: Request, model: type[M], principal: Principal
                              ) -> tuple[ModelServing, M, int]:
        """As _read, for an endpoint served by the model the body names (optional where the
        endpoint allows it): that model's serving, or 404 when the caller may use no model
        or adapter of that name (router/frontend/models/directory.py)."""
        _, req, num_bytes = await self._read(request, model, principal)
        name = getattr(req, "model", None)
        serving = await self.served.find(name, principal)
        if name is not None:
            await serving.pipeline.lora.refresh(name)  # the cluster's run-time adapters
            serving.pipeline.lora.resolve(name)  # the base model or a known adapter; else 404
        return serving, req, num_bytes
