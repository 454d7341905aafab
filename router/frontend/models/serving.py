"""One served model inside an ingress replica: its workers, tokenizer, pipeline (admission,
limits, metrics) and the endpoints over that pipeline.

Built once per model when the ingress starts. What the models share is passed in: the API
keys (one set per replica), the intake window (one arrival order per replica) and the store
of /v1/responses (a stored response may be continued on another model).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from router.frontend.auth import ApiKeys
from router.frontend.openai_api import protocol as p
from router.frontend.disagg import DisaggregatedGenerate
from router.frontend.grpc_api.servicer import GrpcServicer
from router.frontend.intake import IntakeWindow
from router.frontend.key_limits import KeyLimits
from router.frontend.messages_api.endpoint import MessagesEndpoint
from router.frontend.metrics import IngressMetrics
from router.frontend.models.pools import ModelPools
from router.frontend.output_hub import OutputHub
from router.frontend.pipeline import RequestPipeline
from router.frontend.responses_api.endpoint import ResponsesEndpoint
from router.frontend.responses_api.store import ResponseStore
from router.frontend.settings import IngressSettings
from router.frontend.workers import Workers
from router.routing import RouterSnapshotSource
from router.serve_internals import initialized_request_router_of, process_transport
from worker.api import load_tokenizer


@dataclass(frozen=True)
class ModelServing:
    settings: IngressSettings
    pipeline: RequestPipeline
    grpc: GrpcServicer
    responses: ResponsesEndpoint
    messages: MessagesEndpoint

    @property
    def name(self) -> str:
        return self.settings.served_model_name


def build_servings(models: Sequence[ModelPools], api_keys: ApiKeys, replica_id: str | None) -> list[ModelServing]:
    """Every served model's serving objects on this replica, the first model's first. The
    models share this replica's arrival order, its stored responses and the per-key limits'
    counts (a key's concurrency and tokens per minute are one budget across the models)."""
    first = build_serving(models[0], api_keys, replica_id)
    p = first.pipeline
    return [first, *(build_serving(m, api_keys, replica_id, p.intake, first.responses.store, p.key_limits)
                     for m in models[1:])]


def key_limits_of(settings: IngressSettings) -> KeyLimits:
    """The per-key limits over their store: the app-wide one when given, else the model's
    state store, else this replica's counts."""
    factory = settings.key_limits_store or settings.state_store
    store = factory.build() if factory is not None else None
    return KeyLimits(settings.max_concurrent_requests_per_key, settings.tokens_per_minute_per_key, store=store)


def build_serving(pools: ModelPools, api_keys: ApiKeys, replica_id: str | None,
                  intake: IntakeWindow | None = None, response_store: ResponseStore | None = None,
                  key_limits: KeyLimits | None = None) -> ModelServing:
    """The model's serving objects on this replica; `intake`, `response_store` and
    `key_limits` shared with the other models when given (else its own)."""
    settings, worker, prefill = pools.settings, pools.worker, pools.prefill_worker
    # Outputs come back in batches, one list per engine step for all of this replica's
    # requests on a worker (router/frontend/output_hub.py); disaggregated, the decode
    # pool's do (router/frontend/disagg.py). Engine requests take this process's Serve
    # transport (gRPC between replicas in Serve's throughput mode), except a
    # disaggregated request's, whose KV handle holds an ObjectRef (serve_internals).
    generate: Any = (OutputHub(process_transport(worker)) if prefill is None
                     else DisaggregatedGenerate(process_transport(prefill, by_reference=True),
                                                process_transport(worker, by_reference=True),
                                                pools.max_waiting_for_decode))
    workers = Workers(worker, generate, settings.stats_timeout_s, prefill_handle=prefill,
                      cold_start=settings.cold_start, scale_to_zero=settings.scale_to_zero)
    # Per-key limits: counted here, or cluster-wide in the shared store cluster/ injected;
    # built by the first model, shared by the others.
    own_limits = key_limits is None
    if key_limits is None:
        key_limits = key_limits_of(settings)
    store = key_limits.store
    tokenizer = load_tokenizer(settings.tokenizer_path, settings.trust_remote_code)
    # Admission control judges with the reports of this replica's request router for the
    # model's worker pool; off when disaggregated (the prefill pool is routed elsewhere).
    routing_source = RouterSnapshotSource(worker) if prefill is None else None
    # Every series this replica serves carries its id (router/frontend/metrics.py: no double counting).
    metrics = IngressMetrics(settings.served_model_name, ingress_replica=replica_id)
    metrics.router.source = lambda: initialized_request_router_of(worker)
    if own_limits and hasattr(store, "observer"):  # the shared store's outages show here
        store.observer = metrics
        metrics.limit_store_up(True)
    pipeline = RequestPipeline(settings, workers, tokenizer, metrics, api_keys, key_limits, routing_source)
    if intake is not None:
        pipeline.intake = intake
    return serving_of(pipeline, response_store)


def serving_of(pipeline: RequestPipeline, response_store: ResponseStore | None = None) -> ModelServing:
    """The endpoints over a model's pipeline; stored responses in `response_store`, else
    where the model's settings say."""
    store = response_store if response_store is not None else pipeline.settings.response_store.build()
    return ModelServing(pipeline.settings, pipeline, GrpcServicer(pipeline), ResponsesEndpoint(pipeline, store),
                        MessagesEndpoint(pipeline))


async def model_cards(serving: ModelServing, admin: bool) -> list[p.ModelCard]:
    """/v1/models' entries of one served model: the model, then its adapters (directories
    for admin keys only; the others see names)."""
    info = await serving.pipeline.workers.model_info()
    await serving.pipeline.lora.refresh()  # the cluster's run-time adapters
    base, length = serving.name, info["max_model_len"]
    cards = [p.ModelCard(id=base, root=serving.settings.tokenizer_path if admin else base, max_model_len=length)]
    cards += [p.ModelCard(id=name, root=path if admin else name, parent=base, max_model_len=length)
              for name, path in sorted(serving.pipeline.lora.paths.items())]
    return cards
