"""Builds the kvserve Serve application from a `KVServeConfig`.

    ingress (FastAPI, router.frontend.ingress.Ingress) ──handle──> worker (worker.serving.replica.WorkerReplica)
                                                         routed by PolicyRouter (or pow2)

Entry points:
- `build_app(config)` for Python (the CLI, tests);
- `app_builder(args)` for `serve run cluster.app:app_builder key=value ...` and for a
  serveConfigV2 application (`import_path: cluster.app:app_builder`, `args:` = the same
  YAML schema, e.g. rendered by the Helm chart).
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import asdict, replace
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

from cluster.config import KVSERVE_POLICY, AutoscalingSection, KVServeConfig
from cluster.deps import missing
from cluster.pool_config import IngressAutoscalingSection
from cluster.slo_config import PLANNER_POLICY, planner_policy_kwargs
from cluster.tracing import TracingSetup, check_exporter
from cluster.models_config import ModelView, model_views
from router.frontend.ingress import Ingress
from router.frontend.models.pools import ModelPools
from router.frontend.settings import IngressSettings
from router.routing import ROUTER_CLASS
from worker.serving.replica import WorkerReplica

logger = logging.getLogger(__name__)

WORKER_DEPLOYMENT = "worker"
INGRESS_DEPLOYMENT = "ingress"
# Every router name but Serve's own pow2: a policy of router/routing/policies/ by that name.
POLICY_ROUTER = ROUTER_CLASS
# Streams per ingress replica beyond its 429 bound that still reach it: /health, /metrics,
# /v1/models must answer while it is saturated with generation requests.
_INGRESS_CONTROL_HEADROOM = 64
# How often a replica being removed checks whether its last request has finished.
_DRAIN_POLL_S = 0.5
# Serve's own default for AutoscalingConfig.metrics_interval_s (Serve warns on any explicit value).
_SERVE_METRICS_INTERVAL_S = AutoscalingConfig.model_fields["metrics_interval_s"].default


def build_app(config: KVServeConfig) -> Application:
    """The ingress over every served model's pools (cluster/models_config.py): one model,
    as `model:` configures it, or each of `models:`."""
    first, *others = [model_pools(view) for view in model_views(config)]
    ingress = serve.deployment(Ingress, name=INGRESS_DEPLOYMENT).options(**ingress_options(config))
    kwargs: dict[str, Any] = {}
    if first.prefill_worker is not None:
        kwargs.update(prefill_worker=first.prefill_worker, max_waiting_for_decode=first.max_waiting_for_decode)
    if others:
        kwargs["other_models"] = tuple(others)
    # The per-key limits are the ingress's, one budget across every model: counted under the
    # app's Redis prefix, not a model's namespace (cluster/models_config.py).
    settings = replace(first.settings, key_models=dict(config.ingress.key_models),
                       key_limits_store=config.redis_store_spec())
    return ingress.bind(first.worker, settings, **kwargs)


def model_pools(view: ModelView) -> ModelPools:
    """One model's pools, bound: its worker deployment, or its prefill and decode ones
    (router/frontend/disagg.py: ingress -> prefill pool (exports KV) -> decode pool)."""
    config = view.config
    settings = ingress_settings(config)
    if config.disaggregation is None:
        name = view.deployment(WORKER_DEPLOYMENT)
        worker = serve.deployment(WorkerReplica, name=name).options(**worker_options(config))
        engine = worker.bind(config.engine_config(), drain_timeout_s=config.workers.drain_timeout_s,
                             setup=tracing_setup(config, name),
                             stream_interval_s=config.workers.stream_interval_ms / 1000)
        return ModelPools(settings, engine)
    pools = {}
    for role, (pool_config, options) in pool_options(config).items():
        name = view.deployment(role)
        deployment = serve.deployment(WorkerReplica, name=name).options(**options)
        pools[role] = deployment.bind(pool_config.engine_config(), drain_timeout_s=pool_config.workers.drain_timeout_s,
                                      setup=tracing_setup(config, name))
    return ModelPools(settings, pools[DECODE_DEPLOYMENT], pools[PREFILL_DEPLOYMENT],
                      config.disaggregation.max_waiting_for_decode)


PREFILL_DEPLOYMENT = "prefill"
DECODE_DEPLOYMENT = "decode"


def pool_options(config: KVServeConfig) -> dict[str, tuple[KVServeConfig, dict[str, Any]]]:
    """Disaggregated: each pool's deployment name -> (the config with that pool as its
    `workers`, the pool's Serve options: its own replicas, resources and autoscaling)."""
    assert config.disaggregation is not None
    out = {}
    for name, section in ((PREFILL_DEPLOYMENT, config.disaggregation.prefill), (DECODE_DEPLOYMENT, config.disaggregation.decode)):
        pool_config = config.model_copy(update={"workers": section})
        options = worker_options(pool_config, output_streams=name == DECODE_DEPLOYMENT)
        if name == PREFILL_DEPLOYMENT and config.routing.router not in ("headroom", "pow2"):
            raise ValueError(f"disaggregation needs routing 'headroom' or 'pow2', got {config.routing.router!r}")
        out[name] = (pool_config, options)
    return out


def app_builder(args: dict[str, Any]) -> Application:
    """Serve's application-builder hook: `args` is a KVServeConfig as a dict."""
    return build_app(KVServeConfig.from_dict(dict(args)))


def ingress_settings(config: KVServeConfig) -> IngressSettings:
    settings = config.ingress_settings(state_store=config.redis_store_spec())
    return replace(settings, setup=tracing_setup(config, INGRESS_DEPLOYMENT))


def tracing_setup(config: KVServeConfig, component: str) -> TracingSetup:
    """What each replica calls to set tracing up in its process (cluster/tracing.py). Always
    given: a replica's own OTEL_EXPORTER_OTLP_ENDPOINT may turn tracing on. An endpoint in
    the config without the exporter installed fails here, before anything is deployed."""
    setup = TracingSetup.of(config.observability, component)
    if setup.otlp_endpoint:
        check_exporter(setup.protocol())
    return setup


def ingress_options(config: KVServeConfig) -> dict[str, Any]:
    i = config.ingress
    actor_options: dict[str, Any] = {"num_cpus": i.num_cpus}
    if i.resources:
        actor_options["resources"] = dict(i.resources)
    elif i.off_gpu_hosts:
        actor_options.update(ingress_placement(_alive_nodes()))
    options: dict[str, Any] = {
        "num_replicas": i.num_replicas,
        # Above the 429 bound, so that the ingress itself answers 429 (with an OpenAI
        # error body) instead of requests queueing in the proxy.
        "max_ongoing_requests": i.max_queued_requests + _INGRESS_CONTROL_HEADROOM,
        "ray_actor_options": actor_options,
    }
    if i.autoscaling is not None:
        options.update(ingress_autoscaling(config))
    return options


def ingress_placement(nodes: list[dict[str, Any]]) -> dict[str, Any]:
    """Ray actor options that keep the ingress off the GPU hosts among `nodes` (ray.nodes()
    of the cluster it deploys to): a label selector excluding their node ids, when some
    node without GPUs can run it. Nothing when there is no such node (a one-node cluster,
    a laptop) or no GPU host. Hosts that join later are not excluded: on Kubernetes the chart
    pins the ingress to its own node group instead (ingress.resources)."""
    gpu_ids = sorted(n["NodeID"] for n in nodes if n["Resources"].get("GPU", 0) > 0)
    cpu_only = [n for n in nodes if n["Resources"].get("CPU", 0) > 0 and not n["Resources"].get("GPU", 0)]
    if not gpu_ids or not cpu_only:
        return {}
    return {"label_selector": {"ray.io/node-id": f"!in({','.join(gpu_ids)})"}}


def _alive_nodes() -> list[dict[str, Any]]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive")] if ray.is_initialized() else []


def ingress_autoscaling(config: KVServeConfig) -> dict[str, Any]:
    """Serve's own policy on ongoing requests per ingress replica. A replica Serve removes
    stops taking requests and is killed once its last stream ends: given as long as a
    request may run (request_timeout_s), a scale-down never cuts a client's stream."""
    a = config.ingress.autoscaling
    assert a is not None
    return {
        "num_replicas": "auto",
        "autoscaling_config": serve_autoscaling_config(a),
        "graceful_shutdown_timeout_s": config.ingress.request_timeout_s,
        "graceful_shutdown_wait_loop_s": _DRAIN_POLL_S,
    }


def worker_options(config: KVServeConfig, output_streams: bool = True) -> dict[str, Any]:
    """A worker pool's Serve options. `output_streams`: the pool's replicas each hold one
    batched output stream per ingress replica (worker/outputs/streams.py), a Serve request
    like any other; Serve's limit is the pool's engine requests plus those streams, or a
    replica full of engine requests refuses its own output stream, or the stream takes an
    engine request's place and that request waits at the router for a whole batch to end.
    The prefill pool of a disaggregated app answers unary calls only (False)."""
    w = config.workers
    stream_room = config.ingress.max_num_replicas() if output_streams else 0
    options: dict[str, Any] = {
        "max_ongoing_requests": w.max_ongoing_requests + stream_room,
        "ray_actor_options": worker_resources(config),
        "health_check_period_s": w.health_check_period_s,
        "health_check_timeout_s": w.health_check_timeout_s,
        # Removing a replica (scale-down, redeploy, shutdown): Serve stops routing to it,
        # polls its ongoing requests every wait_loop_s until none is left, then calls
        # WorkerReplica.__del__ (which stops the engine) and kills the actor; it kills it
        # anyway once timeout_s has passed.
        "graceful_shutdown_timeout_s": w.drain_timeout_s,
        "graceful_shutdown_wait_loop_s": _DRAIN_POLL_S,
        # No access line per call: every engine request is an internal call the ingress
        # already counts and traces, and the line is written on the event loop that feeds
        # the engine's step thread, holding the GIL the step needs.
        "logging_config": {"enable_access_log": False},
    }
    if w.autoscaling is not None:
        options["autoscaling_config"] = autoscaling_config(w.autoscaling, config)
        options["num_replicas"] = "auto"
    else:
        options["num_replicas"] = w.num_replicas
    router = request_router_config(config)
    if router is not None:
        options["request_router_config"] = router
    if w.tensor_parallel_size > 1:
        options.update(tensor_parallel_placement(options["ray_actor_options"], w.tensor_parallel_size))
    return options


def tensor_parallel_placement(replica: dict[str, Any], size: int) -> dict[str, Any]:
    """A TP replica's resources (num_cpus / num_gpus for the whole group) split into one
    bundle per rank, all on one node (STRICT_PACK). The replica actor is rank 0 and takes
    bundle 0; its rank actors take the others, each its whole bundle (worker/tp/runner.py).
    Custom resources are per rank (a pool's `kvserve_pool_<role>` counts GPUs)."""
    rank: dict[str, Any] = {"num_cpus": replica["num_cpus"] / size}
    bundle: dict[str, float] = {"CPU": rank["num_cpus"]}
    if replica.get("num_gpus"):
        rank["num_gpus"] = bundle["GPU"] = replica["num_gpus"] / size
    if replica.get("resources"):
        rank["resources"] = dict(replica["resources"])
        bundle.update(replica["resources"])
    return {
        "ray_actor_options": rank,
        "placement_group_bundles": [dict(bundle) for _ in range(size)],
        "placement_group_strategy": "STRICT_PACK",
    }


def autoscaling_config(a: AutoscalingSection, config: KVServeConfig | None = None) -> AutoscalingConfig:
    """Serve's AutoscalingConfig for the worker pool. kvserve's policy runs as the class
    QueueDepthPolicy, which Serve instantiates once with `policy_kwargs` (the typed
    targets), or, with `slo` targets, as the SLO planner (cluster/planner/serve_policy.py),
    which prices steps from `config`'s engine; Serve applies the delays and bounds to what
    either returns."""
    extra: dict[str, Any] = {}
    if a.initial_replicas is not None:
        extra["initial_replicas"] = a.initial_replicas
    if a.uses_planner() and a.slo is not None:
        if config is None:
            raise ValueError("the SLO planner needs the app's config (its engine prices the steps)")
        gpus = float(config.workers.num_gpus or config.workers.tensor_parallel_size)  # a GPU per rank by default
        kwargs = planner_policy_kwargs(a.slo, a.role, config.model.resolved_name(), config.engine,
                                       config.model.resolved_path(), a.scale_to_zero, gpus, a.slo.interval_s)
        extra["policy"] = AutoscalingPolicy(policy_function=PLANNER_POLICY, policy_kwargs=kwargs)
    elif a.uses_kvserve_policy():
        extra["policy"] = AutoscalingPolicy(policy_function=KVSERVE_POLICY, policy_kwargs=a.kvserve_policy_kwargs())
    elif a.policy != "serve":
        extra["policy"] = AutoscalingPolicy(policy_function=a.policy, policy_kwargs=dict(a.policy_kwargs))
    return serve_autoscaling_config(a, **extra)


def serve_autoscaling_config(a: AutoscalingSection | IngressAutoscalingSection, **extra: Any) -> AutoscalingConfig:
    """Serve's AutoscalingConfig from the fields both autoscaling sections share (bounds,
    Serve's target, timing), plus `extra` (a pool's policy, initial_replicas): the one place
    the config is built, for the ingress and for every worker pool."""
    fields: dict[str, Any] = {
        "min_replicas": a.min_replicas,
        "max_replicas": a.max_replicas,
        "target_ongoing_requests": a.target_ongoing_requests,
        "upscale_delay_s": a.upscale_delay_s,
        "downscale_delay_s": a.downscale_delay_s,
        "look_back_period_s": a.look_back_period_s,
    }
    if a.metrics_interval_s != _SERVE_METRICS_INTERVAL_S:  # Serve warns on any explicit value
        fields["metrics_interval_s"] = a.metrics_interval_s
    fields.update(extra)
    with warnings.catch_warnings():
        # metrics_interval_s is deprecated in favour of an environment variable that Ray 2.60
        # does not read yet; it is the only way to set the push interval.
        warnings.filterwarnings("ignore", message=".*metrics_interval_s.*deprecated", category=DeprecationWarning)
        return AutoscalingConfig(**fields)


def worker_resources(config: KVServeConfig) -> dict[str, Any]:
    """Per replica (a whole tensor-parallel group): explicit values win; otherwise one GPU
    per rank when the engine runs on CUDA (device 'cuda', or 'auto' on a cluster that has
    GPUs) and one CPU per rank."""
    w = config.workers
    ranks = float(w.tensor_parallel_size)
    num_gpus = w.num_gpus
    if num_gpus is None:
        device = config.engine.device
        num_gpus = ranks if device == "cuda" or (device == "auto" and _cluster_has_gpus()) else 0.0
    num_cpus = w.num_cpus if w.num_cpus is not None else ranks
    resources: dict[str, Any] = {"num_cpus": num_cpus}
    if num_gpus:
        resources["num_gpus"] = num_gpus
    if w.resources:
        resources["resources"] = dict(w.resources)
    return resources


def _cluster_has_gpus() -> bool:
    import ray

    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0


def request_router_config(config: KVServeConfig) -> RequestRouterConfig:
    """The request router the worker deployment runs: a policy of router/routing/policies/ by
    name (pow2 is Serve's own algorithm) through router/routing/serve_router.py's
    PolicyRouter. Always PolicyRouter: the ingress reads each worker replica's batched
    output stream by a call that names the replica (router/frontend/output_hub.py), which
    only PolicyRouter sends to that replica."""
    name = config.routing.router
    # Every router copy (one per ingress replica) may promise a replica's whole headroom:
    # with a shared view (state.redis_url) each counts the others' reservations; without one
    # they re-converge at each report. Serve's report period comes from the same params.
    shared = config.shared_view_spec()
    kwargs: dict[str, Any] = {"policy": name, "warm_start": config.routing.warm_start}
    if shared is not None:
        kwargs["shared_view"] = shared.to_dict()
    if name == "headroom":  # typed and checked params (RoutingSection validates them)
        kwargs.update(asdict(config.routing.routing_params()))
    else:  # the baseline's own options, checked by make_policy when the router starts
        kwargs.update({"stats_period_s": config.routing.stats_period_s, **config.routing.router_kwargs})
    return RequestRouterConfig(
        request_router_class=POLICY_ROUTER,
        request_router_kwargs=kwargs,
        request_routing_stats_period_s=config.routing.stats_period_s,
    )


def grpc_servicer() -> str:
    """The servicer function to give Serve's gRPC proxy (`gRPCOptions.grpc_servicer_functions`):
    the generated registration plus a cancel fix (router/frontend/grpc_api/proxy.py). Raises
    MissingDependencyError, with what to install, when grpc or the stubs do not import."""
    try:
        from router.frontend.grpc_api.proxy import GRPC_SERVICER
    except ImportError as e:
        raise missing("the gRPC API (config grpc.enabled)", e) from e
    return GRPC_SERVICER
