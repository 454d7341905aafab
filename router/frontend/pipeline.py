"""One request pipeline for both front ends: admit -> convert -> charge -> stream -> settle.

    HTTP handler (router/frontend/ingress.py)           gRPC method (router/frontend/grpc_api/servicer.py)
      intake: its turn in this replica's window (router/frontend/intake.py), until sent
      authenticate, read + validate the body     authenticate, validate the message
                       \\                         /
              RequestPipeline.start(principal, weight, ..., to_inputs, request_id)
                admit    the key's concurrency slot (router/frontend/key_limits.py), then this
                         replica's in-flight share (InFlightLimiter)        -> 429 / 503
                convert  tokenize + sampling params, with the workers' max_model_len,
                         off the event loop when the request is large or
                         carries a grammar to check                          -> 400
                charge   the worst case from the key's tokens-per-minute budget -> 429
                hold     admission control (router/routing/admission.py): while no worker replica
                         can take it, held in a queue fair between keys -> 429 at its bound
                         (its intake slot is given back while it is held)
                stream   GenerationStream.start(): the engine requests go out through
                         the worker handle (KV-headroom router) and the first output is
                         awaited, so that errors before any token have their status
              -> GenerationStream; the front end converts its events to its wire format
                settle   when the stream closes (finished, failed, cancelled): the unused
                         part of the charge is refunded, the slot and share released

Each stage undoes what the earlier ones took when it fails, so a request refused at any
point holds nothing. The front ends only convert: a body or message into `to_inputs`,
events into chunks or messages, errors into statuses.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

from router import errors
from router.routing import AdmissionController, RequestProfile, SnapshotSource, Ticket, request_hash_root
from router.frontend.lora_modules import LoRAModules
from router.frontend.auth import ANONYMOUS, ApiKeys, Principal
from router.frontend.generation import GenerationStream, InFlightLimiter, StreamPermit
from router.frontend.intake import IntakeWindow, release_current
from router.frontend.key_limits import JointPermit, KeyLimits, worst_case_tokens
from router.frontend.metrics import IngressMetrics
from router.frontend.openai_api.convert import EngineInput, TokenTexts
from router.frontend.settings import IngressSettings
from router.frontend.workers import Workers

# Requests above this many bytes are tokenized off the event loop (a long prompt takes
# milliseconds).
LARGE_REQUEST_BYTES = 64 * 1024

T = TypeVar("T")

# Builds a request's engine inputs given the longest sequence a worker holds.
ToInputs = Callable[[int], list[EngineInput]]


class RequestPipeline:
    """What both front ends share: the collaborators and the request's stages."""

    def __init__(
        self,
        settings: IngressSettings,
        workers: Workers,
        tokenizer: object,
        metrics: IngressMetrics,
        api_keys: ApiKeys,
        key_limits: KeyLimits,
        # The request router's reports for admission control (router/routing/admission_source.py's
        # RouterSnapshotSource on the worker handle); None: admission control off.
        routing_source: SnapshotSource | None = None,
    ) -> None:
        self.settings = settings
        # The adapters requests may name as `model` (router/frontend/lora_modules.py).
        registry = settings.state_store.adapter_registry() if settings.state_store is not None else None
        self.lora = LoRAModules(settings.served_model_name, settings.lora_modules, settings.lora_enabled,
                                settings.lora_policy, registry)
        self.workers = workers
        self.tokenizer = tokenizer
        self.texts = TokenTexts(tokenizer)
        self.metrics = metrics
        self.limiter = InFlightLimiter(settings.max_queued_requests, metrics)
        self.intake = IntakeWindow(settings.intake_window, settings.max_queued_requests)
        self.api_keys = api_keys
        self.key_limits = key_limits
        self.admission = AdmissionController(
            routing_source, settings.admission_queue_size, settings.admission_max_wait_s or settings.request_timeout_s,
            settings.admission_max_waiting_per_replica, metrics, key_weights=settings.key_weights,
        )

    def authenticate(self, authorization: str | None) -> Principal:
        """The caller of a request with this `Authorization` value (HTTP header or gRPC
        metadata): ANONYMOUS when keys are off, else APIError 401 unless it is a key."""
        return self.api_keys.authenticate(authorization)

    async def admit(self, principal: Principal, weight: int) -> JointPermit:
        """The key's concurrency slots (one per engine request), then this replica's
        in-flight share (429 for either)."""
        lease = None
        if principal is not ANONYMOUS and self.key_limits.enabled:
            lease = await self.key_limits.acquire(principal.key_id, weight)
        try:
            permit = self.limiter.acquire(weight)
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        return JointPermit(permit, lease)

    async def tokenizer_work(self, principal: Principal, num_bytes: int, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)` (tokenizer work outside a generation: /tokenize, /detokenize, gRPC
        Tokenize) inside the limits a generation has (the key's slot, this replica's share),
        off the event loop for a large body: HTTP and gRPC alike."""
        permit = await self.admit(principal, 1)
        try:
            return await off_loop_if_large(num_bytes, work, *args)
        finally:
            permit.release()

    async def start(
        self,
        principal: Principal,
        weight: int,  # engine requests it will send (n x prompts): its in-flight share
        request_bytes: int,
        to_inputs: ToInputs,
        request_id: str,
        arrival: float,  # time.monotonic() when the request came in
        session_id: str | None = None,  # the client's session (router/routing/sessions.py)
        stream: bool = True,  # False: the client reads only the final text
        lora: tuple[str, str] | None = None,  # the LoRA adapter (name, path) that serves it
        offload: bool = False,  # convert off the event loop whatever the size (a constraint to check)
        priority: int | None = None,  # the client's band; None: its key's default
    ) -> GenerationStream:
        band = self.band_of(principal, priority)
        permit = await self.admit(principal, weight)
        try:
            info = await self.workers.model_info()
            inputs = await self._convert(request_bytes, to_inputs, int(info["max_model_len"]), offload)
            if self.settings.isolate_prefix_cache_per_key:
                inputs = isolated(inputs, principal)
            inputs = self.stamped(inputs, principal, band)
            if permit.lease is not None:
                await permit.lease.charge(worst_case_tokens(inputs))
            lora_name, lora_path = lora if lora is not None else (None, None)
            profiles = [
                RequestProfile(inp.prompt_token_ids, int(inp.params.max_tokens),
                               request_hash_root(inp.params.cache_keys, lora_name, lora_path), lora_name)
                for inp in inputs
            ]
            ticket = await self.admission.admit(principal.key_id, profiles, band, on_hold=release_current)
        except BaseException:
            # Ended before the engine ran (refused, shed, cancelled): nothing was used.
            permit.settle(0)
            permit.release()
            raise
        stream = GenerationStream(
            self.workers.generate, inputs, request_id, AdmittedPermit(permit, ticket), self.settings.request_timeout_s,
            self.metrics, arrival,
            max_migrations=self.settings.max_migrations, session_id=session_id, stream=stream, lora=lora,
            cold_start=self.settings.cold_start,
        )
        await stream.start()  # on failure the stream has closed: refunded, released
        return stream

    def band_of(self, principal: Principal, requested: int | None) -> int:
        """The request's priority band: its key's default when it asks for none; a key may
        ask for a worse band (a larger value), never a better one (400)."""
        default = self.settings.key_priorities.get(principal.key_id, self.settings.unlisted_key_priority)
        if requested is None:
            return default
        if principal is not ANONYMOUS and requested < default:
            raise errors.bad_request(
                f"priority {requested} is better than this API key's band ({default}); lower values are served first.",
                "priority", "invalid_value",
            )
        return requested

    def stamped(self, inputs: list[EngineInput], principal: Principal, band: int) -> list[EngineInput]:
        """The inputs with their band and their key and its weight: the engine orders by the
        band and, within it, shares its running slots between keys (worker/scheduling/bands.py)."""
        weight = self.settings.key_weights.get(principal.key_id, 1)
        return [replace(inp, params=replace(inp.params, priority=band, tenant=principal.key_id, tenant_weight=weight))
                for inp in inputs]

    @staticmethod
    async def _convert(request_bytes: int, to_inputs: ToInputs, max_model_len: int, offload: bool = False) -> list[EngineInput]:
        # Grammar checks (structured outputs, forced tool calls) take milliseconds or more
        # even for small bodies: never on the event loop.
        if offload or request_bytes > LARGE_REQUEST_BYTES:
            return await asyncio.to_thread(to_inputs, max_model_len)
        return to_inputs(max_model_len)


async def off_loop_if_large(num_bytes: int, work: Callable[..., T], *args: Any) -> T:
    """`work(*args)` (tokenizer work), on a thread when the request is large."""
    if num_bytes > LARGE_REQUEST_BYTES:
        return await asyncio.to_thread(work, *args)
    return work(*args)


def isolated(inputs: list[EngineInput], principal: Principal) -> list[EngineInput]:
    """The inputs with their cache salt framed by the caller's key: each key's prefix-cache
    partition is its own, and a client's salt partitions only within its key's. A key id
    holds no NUL and salts are never empty, so no salt a client sends can make its framed
    salt equal another key's."""
    return [
        replace(inp, params=replace(inp.params, cache_salt=f"{principal.key_id}\x00{inp.params.cache_salt or ''}"))
        for inp in inputs
    ]


class AdmittedPermit:
    """What a stream holds: the pipeline's JointPermit and its admission Ticket, given
    back together when the stream closes (the ticket first: it lets a held request go)."""

    def __init__(self, permit: StreamPermit, ticket: Ticket) -> None:
        self._permit = permit
        self.ticket = ticket

    def settle(self, used_tokens: int) -> None:
        self._permit.settle(used_tokens)

    def release(self) -> None:
        try:
            self.ticket.release()
        finally:
            self._permit.release()
