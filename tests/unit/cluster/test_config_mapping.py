"""The user schema (pydantic, cluster/config.py) and the frozen dataclasses each layer owns:
every default is written once (in the dataclass) and every section field reaches its
dataclass through the one mapping (cluster/config_fields.py), or is a deployment option."""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from pydantic import BaseModel

from cluster.autoscaling import PoolTargets, QueueDepthPolicy
from cluster.config import (
    AutoscalingSection,
    EngineSection,
    KVServeConfig,
    ModelSection,
    RoutingSection,
    WorkersSection,
)
from cluster.config_fields import build, default_of, mapped_fields
from cluster.ingress_config import IngressSection, StateSection
from cluster.state_store import RedisStoreSpec
from router.routing.types import RoutingParams
from router.routing.redis_view import SharedViewSpec
from router.frontend.settings import IngressSettings
from cluster.speculative_config import SpeculativeSection
from worker.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig

# (section, dataclass, renames): the section fields that configure the dataclass.
MAPPINGS: list[tuple[type[BaseModel], type, dict[str, str]]] = [
    (EngineSection, ModelConfig, {}),
    (EngineSection, CacheConfig, {"num_blocks_override": "num_blocks"}),
    (EngineSection, SchedulerConfig, {}),
    (ModelSection, ModelConfig, {}),
    (WorkersSection, ModelConfig, {}),
    (IngressSection, IngressSettings, {}),
    (ModelSection, IngressSettings, {}),
    (StateSection, RedisStoreSpec, {"password_env": "redis_password_env"}),
    (AutoscalingSection, PoolTargets, {}),
    (RoutingSection, RoutingParams, {}),
    (RoutingSection, SharedViewSpec, {"mode": "shared_view_mode", "refresh_s": "shared_view_refresh_s"}),
    (SpeculativeSection, SpeculativeConfig, {}),
]
# Section fields that configure no dataclass: Serve deployment options, or inputs that are
# turned into a dataclass field by cluster/config.py or cluster/app.py (path -> model, ...).
NOT_MAPPED: dict[type[BaseModel], set[str]] = {
    EngineSection: {"speculative"},  # a section of its own (SpeculativeSection)
    SpeculativeSection: set(),
    ModelSection: {"path", "served_model_name"},  # resolved into ModelConfig.model / IngressSettings
    IngressSection: {"num_replicas", "autoscaling", "num_cpus", "resources", "off_gpu_hosts"},
    StateSection: {"redis_url", "key_prefix"},  # given to RedisStoreSpec as url / key_prefix
    AutoscalingSection: {"min_replicas", "max_replicas", "initial_replicas", "target_ongoing_requests",
                         "upscale_delay_s", "downscale_delay_s", "look_back_period_s", "metrics_interval_s",
                         "policy", "policy_kwargs", "slo"},  # slo: the SLO planner (cluster/slo_config.py)
    RoutingSection: {"router", "router_kwargs", "shared_view", "warm_start"},  # router kwargs (cluster/app.py)
}


def defaulted(cls: type, section: type[BaseModel], renames: dict[str, str]) -> set[str]:
    """The section fields that carry a default of cls (a field cls requires, such as
    IngressSettings.served_model_name, is resolved by cluster/config.py and given explicitly)."""
    return {renames.get(f.name, f.name) for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING} & mapped_fields(cls, section, renames)


@pytest.mark.parametrize(("section", "cls", "renames"), MAPPINGS, ids=lambda v: getattr(v, "__name__", ""))
def test_section_defaults_are_the_dataclass_defaults(section: type[BaseModel], cls: type, renames: dict[str, str]) -> None:
    by_section_name = {renames.get(f.name, f.name): f.name for f in dataclasses.fields(cls)}
    shared = defaulted(cls, section, renames)
    assert shared, f"{section.__name__} configures nothing of {cls.__name__}"
    for name in shared:
        assert section.model_fields[name].default == default_of(cls, by_section_name[name]), f"{section.__name__}.{name}"


@pytest.mark.parametrize("section", list(NOT_MAPPED), ids=lambda s: s.__name__)
def test_every_section_field_reaches_a_dataclass_or_is_a_deployment_option(section: type[BaseModel]) -> None:
    mapped = set().union(*(defaulted(cls, s, r) for s, cls, r in MAPPINGS if s is section))
    assert mapped.isdisjoint(NOT_MAPPED[section])
    assert set(section.model_fields) == mapped | NOT_MAPPED[section]


def test_non_default_values_reach_the_engine_and_ingress_dataclasses() -> None:
    c = KVServeConfig.from_dict({
        "model": {"path": "/models/x", "seed": 7, "trust_remote_code": True},
        "engine": {"block_size": 32, "kv_cache_bytes": "1MiB", "num_blocks": 9, "max_num_seqs": 3,
                   "max_num_batched_tokens": 128, "max_model_len": 256, "dtype": "float32", "num_threads": 2,
                   "max_step_time_s": 0.05, "step_time_profile": "h100"},
        "workers": {"tensor_parallel_size": 2},
        "ingress": {"max_n": 2, "request_timeout_s": 5, "metrics_public": True},
    })
    e = c.engine_config()
    assert (e.model.model, e.model.seed, e.model.trust_remote_code, e.model.dtype, e.model.num_threads,
            e.model.tensor_parallel_size) == ("/models/x", 7, True, "float32", 2, 2)
    assert (e.cache.block_size, e.cache.kv_cache_bytes, e.cache.num_blocks_override) == (32, 1024**2, 9)
    assert (e.scheduler.max_num_seqs, e.scheduler.max_num_batched_tokens, e.scheduler.max_model_len) == (3, 128, 256)
    assert (e.scheduler.max_step_time_s, e.model.step_time_profile) == (0.05, "h100")
    s = c.ingress_settings()
    assert (s.served_model_name, s.tokenizer_path, s.trust_remote_code) == ("x", "/models/x", True)
    assert (s.max_n, s.request_timeout_s, s.metrics_public, s.max_queued_requests) == (2, 5, True, 1024)


def test_defaults_build_the_dataclasses_defaults() -> None:
    c = KVServeConfig.from_dict({"model": "/models/x"})
    assert c.engine_config().cache == CacheConfig() and c.engine_config().scheduler == SchedulerConfig()
    assert c.engine_config().model == ModelConfig(model="/models/x")
    assert AutoscalingSection().pool_targets() == PoolTargets() == QueueDepthPolicy().targets


def test_the_router_and_serve_share_one_report_period() -> None:
    """RoutingParams.stats_period_s must equal Serve's request_routing_stats_period_s: the
    latter is derived from the former, whichever way the user sets it."""
    for routing in ({}, {"stats_period_s": 0.5}, {"router_kwargs": {"stats_period_s": 2.0}}):
        params = RoutingSection.model_validate(routing).routing_params()
        fields: dict[str, Any] = params.serve_router_config()
        assert fields["request_routing_stats_period_s"] == fields["request_router_kwargs"]["stats_period_s"]
        assert RoutingParams.from_kwargs(fields["request_router_kwargs"]) == params


def test_build_refuses_ambiguity_and_unknown_fields() -> None:
    with pytest.raises(TypeError, match="offered by"):  # both sections have trust_remote_code
        build(ModelConfig, ModelSection(), ModelSection(), model="m")
    with pytest.raises(TypeError, match="no field"):
        build(SchedulerConfig, EngineSection(), max_num_seqs_typo=3)
    with pytest.raises(AttributeError):
        default_of(CacheConfig, "nope")
    with pytest.raises(TypeError, match="no default"):
        default_of(ModelConfig, "model")


def test_a_router_kwargs_typo_is_a_config_error() -> None:
    from cluster.config import ConfigError

    with pytest.raises(ConfigError, match="load_gate"):
        KVServeConfig.from_dict({"routing": {"router_kwargs": {"load_gate": 2}}})
    # pow2 takes no router parameters: nothing to check
    KVServeConfig.from_dict({"routing": {"router": "pow2", "router_kwargs": {}}})
