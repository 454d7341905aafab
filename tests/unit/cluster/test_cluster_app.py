"""Building the Serve application from the config (no Ray cluster is started)."""
from __future__ import annotations

from typing import Any

import pytest

from ray.serve import Application
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from cluster.app import (
    DECODE_DEPLOYMENT,
    POLICY_ROUTER,
    PREFILL_DEPLOYMENT,
    app_builder,
    ingress_options,
    ingress_settings,
    pool_options,
    worker_options,
)
from cluster.config import ConfigError, KVServeConfig


def config(**sections: object) -> KVServeConfig:
    return KVServeConfig.from_dict({"model": {"path": "/models/x", "served_model_name": "x"}, **sections})


def test_app_builder_validates_and_builds() -> None:
    assert isinstance(app_builder({"model": "/models/x", "workers": {"num_replicas": 2}}), Application)
    with pytest.raises(ConfigError, match="did you mean 'workers'"):
        app_builder({"model": "/models/x", "worker": {}})


def test_worker_options() -> None:
    options = worker_options(config(engine={"device": "cpu"}, workers={"num_replicas": 3, "num_cpus": 0.5}))
    # 256 engine requests, and the one ingress replica's output stream.
    assert options["num_replicas"] == 3 and options["max_ongoing_requests"] == 256 + 1
    assert options["ray_actor_options"] == {"num_cpus": 0.5}
    # The engine requests are internal calls: no access line each (the ingress counts them).
    assert options["logging_config"] == {"enable_access_log": False}
    gpu = worker_options(config(engine={"device": "cuda"}))
    assert gpu["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1.0}


def test_serves_limit_leaves_room_for_one_output_stream_per_ingress_replica() -> None:
    # A replica full of engine requests must still take each ingress's output stream.
    fixed = worker_options(config(workers={"max_ongoing_requests": 64}, ingress={"num_replicas": 3}))
    assert fixed["max_ongoing_requests"] == 64 + 3
    scaling = worker_options(config(workers={"max_ongoing_requests": 64},
                                    ingress={"autoscaling": {"min_replicas": 1, "max_replicas": 5}}))
    assert scaling["max_ongoing_requests"] == 64 + 5  # the most ingress replicas at once
    assert worker_options(config(workers={"max_ongoing_requests": 64}), output_streams=False)["max_ongoing_requests"] == 64


def test_only_the_decode_pool_holds_output_streams() -> None:
    pools = pool_options(config(ingress={"num_replicas": 2}, disaggregation={
        "prefill": {"max_ongoing_requests": 8}, "decode": {"max_ongoing_requests": 8}}))
    assert pools[PREFILL_DEPLOYMENT][1]["max_ongoing_requests"] == 8  # unary calls only
    assert pools[DECODE_DEPLOYMENT][1]["max_ongoing_requests"] == 8 + 2


def test_tensor_parallel_replica_gets_one_bundle_per_rank_on_one_node() -> None:
    # num_cpus is the whole group's; GPUs default to one per rank; custom resources per rank.
    options = worker_options(config(
        engine={"device": "cuda"},
        workers={"tensor_parallel_size": 2, "num_cpus": 4, "resources": {"kvserve_pool_decode": 1}},
    ))
    assert options["placement_group_bundles"] == [{"CPU": 2.0, "GPU": 1.0, "kvserve_pool_decode": 1}] * 2
    assert options["placement_group_strategy"] == "STRICT_PACK"
    # the replica actor (rank 0) takes bundle 0: exactly one bundle's worth
    assert options["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 1.0, "resources": {"kvserve_pool_decode": 1}}
    four = worker_options(config(engine={"device": "cpu"}, workers={"tensor_parallel_size": 4}))
    assert four["placement_group_bundles"] == [{"CPU": 1.0}] * 4
    single = worker_options(config(engine={"device": "cpu"}))
    assert "placement_group_bundles" not in single


def test_builtin_resources_are_not_custom_resources() -> None:
    with pytest.raises(ConfigError, match="not a custom resource; use num_cpus"):
        config(workers={"resources": {"GPU": 1}})


def test_autoscaling_options() -> None:
    options = worker_options(config(workers={"autoscaling": {"min_replicas": 1, "max_replicas": 5}}))
    assert options["num_replicas"] == "auto"
    autoscaling = options["autoscaling_config"]
    assert isinstance(autoscaling, AutoscalingConfig) and autoscaling.max_replicas == 5
    # kvserve's policy runs as the class, which Serve instantiates with the typed targets.
    assert autoscaling.policy.policy_function == "cluster.autoscaling:QueueDepthPolicy"
    assert autoscaling.policy.policy_kwargs == {
        "role": "mixed", "target_waiting_per_replica": 4.0, "target_waiting_prompt_tokens_per_replica": 8192.0,
        "kv_usage_ceiling": 0.85, "scale_to_zero": False}
    assert autoscaling.look_back_period_s == 30.0 and autoscaling.metrics_interval_s == 10.0
    builtin = worker_options(config(workers={"autoscaling": {"policy": "serve"}}))["autoscaling_config"]
    assert builtin.policy.is_default_policy_function()


def test_autoscaling_policy_kwargs_reach_the_policy_class() -> None:
    """What Serve's controller does with the config: deserialize the policy and, for a class,
    instantiate it once with policy_kwargs (ray/serve/_private/autoscaling_state.py)."""
    from ray.serve._private.autoscaling_state import _resolve_policy_callable

    from cluster.autoscaling import PoolTargets, QueueDepthPolicy

    a = {"role": "prefill", "target_waiting_prompt_tokens_per_replica": 2048, "kv_usage_ceiling": 0.5,
         "min_replicas": 0, "scale_to_zero": True, "upscale_delay_s": 1, "downscale_delay_s": 3,
         "look_back_period_s": 2, "metrics_interval_s": 0.5}
    autoscaling = worker_options(config(workers={"autoscaling": a}))["autoscaling_config"]
    assert (autoscaling.min_replicas, autoscaling.upscale_delay_s, autoscaling.downscale_delay_s) == (0, 1, 3)
    assert (autoscaling.look_back_period_s, autoscaling.metrics_interval_s) == (2, 0.5)
    policy = _resolve_policy_callable(autoscaling.policy)
    assert isinstance(policy, QueueDepthPolicy)
    assert policy.targets == PoolTargets(role="prefill", target_waiting_prompt_tokens_per_replica=2048,
                                         kv_usage_ceiling=0.5, scale_to_zero=True)
    # The helm/default spelling (the function) runs as the class too, with the typed fields.
    legacy = {"policy": "cluster.autoscaling:queue_depth_policy", "target_waiting_per_replica": 2}
    legacy_policy = worker_options(config(workers={"autoscaling": legacy}))["autoscaling_config"].policy
    assert legacy_policy.policy_function == "cluster.autoscaling:QueueDepthPolicy"
    assert legacy_policy.policy_kwargs["target_waiting_per_replica"] == 2
    custom = {"policy": "ray.serve.autoscaling_policy:replica_queue_length_autoscaling_policy",
              "policy_kwargs": {"x": 1}}
    custom_policy = worker_options(config(workers={"autoscaling": custom}))["autoscaling_config"].policy
    assert (custom_policy.policy_function, custom_policy.policy_kwargs) == (custom["policy"], {"x": 1})


def test_drain_options() -> None:
    options = worker_options(config(workers={"drain_timeout_s": 90}))
    assert options["graceful_shutdown_timeout_s"] == 90 and 0 < options["graceful_shutdown_wait_loop_s"] <= 1
    assert worker_options(config())["graceful_shutdown_timeout_s"] == 60


def test_router_selection() -> None:
    # pow2 too runs through PolicyRouter (Serve's algorithm): the ingress's batched output
    # streams name their replica, which only PolicyRouter honours.
    pow2 = worker_options(config(routing={"router": "pow2"}))["request_router_config"]
    assert pow2.request_router_class == POLICY_ROUTER and pow2.request_router_kwargs["policy"] == "pow2"
    # "kv_headroom" is the accepted alias of "headroom": both give the same router.
    for name in ("headroom", "kv_headroom"):
        chosen = worker_options(config(routing={"router": name, "stats_period_s": 0.5})).get("request_router_config")
        assert isinstance(chosen, RequestRouterConfig)
        assert chosen.request_router_class == POLICY_ROUTER and chosen.request_routing_stats_period_s == 0.5
        assert chosen.request_router_kwargs["policy"] == "headroom"


def test_baseline_router_selection() -> None:
    chosen = worker_options(config(routing={"router": "sticky", "router_kwargs": {"target_s": 5.0}})).get("request_router_config")
    assert isinstance(chosen, RequestRouterConfig)
    assert chosen.request_router_class == "router.routing.serve_router:PolicyRouter"
    assert chosen.request_router_kwargs["policy"] == "sticky"
    assert chosen.request_router_kwargs["target_s"] == 5.0


def test_ingress_options_and_settings() -> None:
    c = config(ingress={"max_queued_requests": 10, "max_n": 3, "num_replicas": 2})
    options = ingress_options(c)
    assert options["num_replicas"] == 2 and options["max_ongoing_requests"] > 10
    settings = ingress_settings(c)
    assert (settings.served_model_name, settings.tokenizer_path, settings.max_queued_requests, settings.max_n) == ("x", "/models/x", 10, 3)


def test_ingress_resources_pin_its_replicas() -> None:
    assert "resources" not in ingress_options(config())["ray_actor_options"]  # anywhere by default
    pinned = ingress_options(config(ingress={"resources": {"kvserve_ingress": 0.01}, "num_replicas": 2}))
    assert pinned["ray_actor_options"] == {"num_cpus": 0.5, "resources": {"kvserve_ingress": 0.01}}
    with pytest.raises(ConfigError, match="not a custom resource"):
        config(ingress={"resources": {"GPU": 1}})


def test_state_store_reaches_the_ingress_settings_without_the_password() -> None:
    import pickle

    from cluster.state_store import RedisStoreSpec

    assert ingress_settings(config()).state_store is None  # no Redis: each replica counts alone
    c = config(app_name="llm", state={"redis_url": "rediss://redis.ns.svc:6380/1", "socket_timeout_s": 0.5})
    spec = ingress_settings(c).state_store
    assert spec == RedisStoreSpec(
        url="rediss://redis.ns.svc:6380/1", key_prefix="kvserve:llm", password_env="KVSERVE_REDIS_PASSWORD",
        socket_timeout_s=0.5, lease_ttl_s=30.0,
    )
    assert pickle.loads(pickle.dumps(spec)) == spec  # what Serve sends to the replicas: no secret in it
    custom = config(state={"redis_url": "redis://r:6379", "key_prefix": "team-a", "redis_password_env": None})
    assert ingress_settings(custom).state_store.key_prefix == "team-a"  # type: ignore[union-attr]


def test_grpc_servicer_is_the_cancel_safe_one_or_a_loud_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from cluster.app import grpc_servicer
    from cluster.deps import MissingDependencyError
    from router.frontend.grpc_api.proxy import GRPC_SERVICER

    assert grpc_servicer() == GRPC_SERVICER
    monkeypatch.setitem(sys.modules, "router.frontend.grpc_api.proxy", None)  # as if grpc or the stubs did not import
    with pytest.raises(MissingDependencyError, match=r"gRPC API .* is unavailable: .*Install it: "):
        grpc_servicer()


def _node(node_id: str, cpus: float, gpus: float = 0) -> dict[str, Any]:
    return {"NodeID": node_id, "Alive": True, "Resources": {"CPU": cpus, "GPU": gpus} if gpus else {"CPU": cpus}}


def test_the_ingress_stays_off_gpu_hosts_when_a_cpu_node_can_run_it() -> None:
    from cluster.app import ingress_placement

    kuberay = [_node("head", 0), _node("cpu", 2), _node("gpu-b", 2, 1), _node("gpu-a", 2, 1)]
    assert ingress_placement(kuberay) == {"label_selector": {"ray.io/node-id": "!in(gpu-a,gpu-b)"}}
    assert ingress_placement([_node("laptop", 8)]) == {}  # no GPU host: nothing to avoid
    assert ingress_placement([_node("head", 0), _node("gpu", 4, 1)]) == {}  # nowhere else to go
    # Off without a cluster (no Ray here), with explicit resources (the chart's group), or when asked.
    assert "label_selector" not in ingress_options(config())["ray_actor_options"]
    pinned = ingress_options(config(ingress={"resources": {"kvserve_ingress": 0.01}}))["ray_actor_options"]
    assert pinned == {"num_cpus": 0.5, "resources": {"kvserve_ingress": 0.01}}
