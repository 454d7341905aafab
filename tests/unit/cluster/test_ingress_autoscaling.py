"""The ingress deployment's own autoscaling (KVServeConfig ingress.autoscaling ->
cluster/app.py:ingress_options): Serve's policy on streams per ingress replica, a removal
that waits for the replica's streams, and router settings independent of the replica count."""
from __future__ import annotations

import pytest

from cluster.app import ingress_options, request_router_config
from cluster.config import ConfigError, KVServeConfig


def config(ingress: dict) -> KVServeConfig:
    return KVServeConfig.from_dict({"engine": {"device": "cpu"}, "ingress": ingress})


def test_ingress_scales_on_ongoing_requests() -> None:
    c = config({"autoscaling": {"min_replicas": 2, "max_replicas": 5, "target_ongoing_requests": 100},
                "request_timeout_s": 300})
    options = ingress_options(c)
    a = options["autoscaling_config"]
    assert options["num_replicas"] == "auto"
    assert (a.min_replicas, a.max_replicas, a.target_ongoing_requests) == (2, 5, 100)
    assert a.policy.policy_function == "ray.serve.autoscaling_policy:default_autoscaling_policy"
    # A scale-down waits for the removed replica's streams as long as a request may run.
    assert options["graceful_shutdown_timeout_s"] == 300
    # No static 1/N share of a worker's free KV per router copy (router v2): with a shared
    # routing view each copy counts the others' reservations, so the router's settings do not
    # depend on how many ingress replicas run.
    kwargs = request_router_config(c).request_router_kwargs
    assert kwargs.get("headroom_share", 1.0) == 1.0
    assert kwargs == request_router_config(config({"num_replicas": 1})).request_router_kwargs


def test_fixed_size_ingress_is_unchanged() -> None:
    options = ingress_options(config({"num_replicas": 3}))
    assert options["num_replicas"] == 3 and "autoscaling_config" not in options
    assert "graceful_shutdown_timeout_s" not in options


@pytest.mark.parametrize("ingress, message", [
    ({"num_replicas": 2, "autoscaling": {}}, "not both"),
    ({"autoscaling": {"min_replicas": 3, "max_replicas": 2}}, "min_replicas (3) > max_replicas (2)"),
    ({"autoscaling": {"target_ongoing_request": 1}}, "target_ongoing_request"),
])
def test_bad_ingress_scaling_is_refused(ingress: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config(ingress)


def test_metrics_interval_default_is_serves_own() -> None:
    """Both autoscaling sections default metrics_interval_s to Serve's own default, so that
    cluster/app.py leaves the deprecated field unset (Serve warns on any explicit value)."""
    from ray.serve.config import AutoscalingConfig

    from cluster.pool_config import METRICS_INTERVAL_S

    assert METRICS_INTERVAL_S == AutoscalingConfig.model_fields["metrics_interval_s"].default
