"""Building the Serve application from the config (no Ray cluster is started)."""
from __future__ import annotations

import pytest

pytest.importorskip("ray")

from ray.serve import Application  # noqa: E402
from ray.serve.config import AutoscalingConfig, RequestRouterConfig  # noqa: E402

from cluster.app import KV_HEADROOM_ROUTER, app_builder, ingress_options, ingress_settings, worker_options  # noqa: E402
from cluster.config import ConfigError, KVServeConfig  # noqa: E402


def config(**sections: object) -> KVServeConfig:
    return KVServeConfig.from_dict({"model": {"path": "/models/x", "served_model_name": "x"}, **sections})


def test_app_builder_validates_and_builds() -> None:
    assert isinstance(app_builder({"model": "/models/x", "workers": {"num_replicas": 2}}), Application)
    with pytest.raises(ConfigError, match="did you mean 'workers'"):
        app_builder({"model": "/models/x", "worker": {}})


def test_worker_options() -> None:
    options = worker_options(config(engine={"device": "cpu"}, workers={"num_replicas": 3, "num_cpus": 0.5}))
    assert options["num_replicas"] == 3 and options["max_ongoing_requests"] == 256
    assert options["ray_actor_options"] == {"num_cpus": 0.5}
    gpu = worker_options(config(engine={"device": "cuda"}))
    assert gpu["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1.0}


def test_autoscaling_options() -> None:
    options = worker_options(config(workers={"autoscaling": {"min_replicas": 1, "max_replicas": 5}}))
    assert options["num_replicas"] == "auto"
    autoscaling = options["autoscaling_config"]
    assert isinstance(autoscaling, AutoscalingConfig) and autoscaling.max_replicas == 5
    assert autoscaling.policy.policy_function == "cluster.autoscaling:queue_depth_policy"
    builtin = worker_options(config(workers={"autoscaling": {"policy": "serve"}}))["autoscaling_config"]
    assert builtin.policy.policy_function != "cluster.autoscaling:queue_depth_policy"


def test_router_selection() -> None:
    assert "request_router_config" not in worker_options(config(routing={"router": "pow2"}))
    chosen = worker_options(config(routing={"router": "kv_headroom", "stats_period_s": 0.5})).get("request_router_config")
    try:
        import router.request_router  # noqa: F401
    except ImportError:
        assert chosen is None  # falls back to Serve's default until the module exists
        return
    assert isinstance(chosen, RequestRouterConfig)
    assert chosen.request_router_class == KV_HEADROOM_ROUTER and chosen.request_routing_stats_period_s == 0.5


def test_ingress_options_and_settings() -> None:
    c = config(ingress={"max_queued_requests": 10, "max_n": 3, "num_replicas": 2})
    options = ingress_options(c)
    assert options["num_replicas"] == 2 and options["max_ongoing_requests"] > 10
    settings = ingress_settings(c)
    assert (settings.served_model_name, settings.tokenizer_path, settings.max_queued_requests, settings.max_n) == ("x", "/models/x", 10, 3)
