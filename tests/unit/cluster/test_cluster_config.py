"""KVServeConfig: the one schema for CLI, serve deploy and Helm (no Ray needed)."""
from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import ConfigError, KVServeConfig, parse_bytes
from worker.config import EngineConfig

FULL_YAML = """
app_name: llm
route_prefix: /
model:
  path: /models/my-llama
  served_model_name: llama
  trust_remote_code: false
  seed: 7
engine:
  block_size: 32
  kv_cache_bytes: 512MiB
  gpu_memory_utilization: 0.8
  num_blocks: 1000
  max_num_seqs: 128
  max_num_batched_tokens: 4096
  max_model_len: 8192
  enable_prefix_caching: false
  dtype: bfloat16
  device: cuda
  attention_backend: flash
  num_threads: 4
workers:
  num_replicas: 2
  max_ongoing_requests: 512
  num_cpus: 4
  num_gpus: 1
  tensor_parallel_size: 1
  autoscaling:
    min_replicas: 1
    max_replicas: 8
    target_ongoing_requests: 32
    upscale_delay_s: 5
    downscale_delay_s: 60
    look_back_period_s: 5
    policy: cluster.autoscaling:QueueDepthPolicy
    policy_kwargs: {role: decode}
  health_check_period_s: 5
  health_check_timeout_s: 20
ingress:
  num_replicas: 2
  num_cpus: 1
  max_queued_requests: 2000
  max_body_bytes: 8MiB
  max_n: 8
  request_timeout_s: 300
http: {host: 0.0.0.0, port: 8080}
grpc: {port: 9090, enabled: true}
routing:
  router: kv_headroom  # the accepted alias of headroom
  stats_period_s: 0.5
  router_kwargs: {load_gate_threshold: 2.0}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvserve.yaml"
    path.write_text(text)
    return path


def test_full_yaml_is_accepted(tmp_path: Path) -> None:
    config = KVServeConfig.from_yaml(write(tmp_path, FULL_YAML))
    assert config.engine.kv_cache_bytes == 512 * 1024**2
    assert config.ingress.max_body_bytes == 8 * 1024**2
    assert config.workers.autoscaling is not None and config.workers.autoscaling.max_replicas == 8
    assert config.http.port == 8080 and config.grpc.port == 9090
    assert config.routing.router_kwargs == {"load_gate_threshold": 2.0}
    assert config.model.resolved_name() == "llama"


def test_builds_engine_config(tmp_path: Path) -> None:
    engine = KVServeConfig.from_yaml(write(tmp_path, FULL_YAML)).engine_config()
    assert isinstance(engine, EngineConfig)
    assert engine.model.model == "/models/my-llama"
    assert (engine.model.dtype, engine.model.device, engine.model.attention_backend) == ("bfloat16", "cuda", "flash")
    assert engine.model.seed == 7 and engine.model.num_threads == 4
    assert engine.cache.block_size == 32
    assert engine.cache.kv_cache_bytes == 512 * 1024**2
    assert engine.cache.gpu_memory_utilization == 0.8
    assert engine.cache.enable_prefix_caching is False
    assert engine.cache.num_blocks_override == 1000
    assert (engine.scheduler.max_num_seqs, engine.scheduler.max_num_batched_tokens, engine.scheduler.max_model_len) == (128, 4096, 8192)


def test_empty_config_has_defaults() -> None:
    config = KVServeConfig.from_dict({})
    assert config.http.host == "127.0.0.1" and config.http.port == 8000 and config.grpc.port == 9000
    assert config.workers.num_replicas == 1 and config.workers.max_ongoing_requests == 256
    assert config.routing.router == "headroom"
    assert config.model.path is None


def test_typo_names_the_closest_key() -> None:
    with pytest.raises(ConfigError) as info:
        KVServeConfig.from_dict({"engine": {"blok_size": 16}})
    message = str(info.value)
    assert "engine.blok_size" in message and "did you mean 'block_size'" in message


def test_typo_at_top_level_and_in_nested_optional_section() -> None:
    with pytest.raises(ConfigError) as info:
        KVServeConfig.from_dict({"wokers": {}, "workers": {"autoscaling": {"max_replica": 3}}})
    message = str(info.value)
    assert "wokers: unknown key; did you mean 'workers'" in message
    assert "workers.autoscaling.max_replica: unknown key; did you mean 'max_replicas'" in message


def test_typo_in_file_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "ingress:\n  max_queued_request: 5\n")
    with pytest.raises(ConfigError) as info:
        KVServeConfig.from_yaml(path)
    assert str(path) in str(info.value) and "max_queued_requests" in str(info.value)


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"engine": {"block_size": 12}}, "power of two"),
        ({"engine": {"dtype": "float8"}}, "engine.dtype"),
        ({"engine": {"gpu_memory_utilization": 1.5}}, "engine.gpu_memory_utilization"),
        ({"workers": {"tensor_parallel_size": 0}}, "tensor_parallel_size must be >= 1"),
        ({"workers": {"autoscaling": {"min_replicas": 5, "max_replicas": 2}}}, "min_replicas (5) > max_replicas (2)"),
        ({"routing": {"router": "random"}}, "routing.router"),
        ({"engine": {"kv_cache_bytes": "lots"}}, "not a byte size"),
        ({"route_prefix": "v1"}, "must start with '/'"),
    ],
)
def test_bad_values_are_rejected(data: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        KVServeConfig.from_dict(data)
    assert fragment in str(info.value)


def test_model_shorthand_and_served_name(tmp_path: Path) -> None:
    model_dir = tmp_path / "Tiny-Llama"
    model_dir.mkdir()
    assert KVServeConfig.from_dict({"model": str(model_dir)}).model.resolved_name() == "Tiny-Llama"
    assert KVServeConfig.from_dict({"model": "org/Some-Model"}).model.resolved_name() == "org/Some-Model"


def test_default_model_name() -> None:
    assert KVServeConfig().model.resolved_name() == "kvserve-tiny"


def test_overrides_are_validated() -> None:
    config = KVServeConfig().with_overrides({"http.port": 8001, "workers.num_replicas": 3})
    assert config.http.port == 8001 and config.workers.num_replicas == 3
    with pytest.raises(ConfigError):
        KVServeConfig().with_overrides({"workers.num_replicas": 0})


def test_parse_bytes() -> None:
    assert parse_bytes("1GiB") == 1024**3
    assert parse_bytes("512MB") == 512 * 1000**2
    assert parse_bytes("64KiB") == 64 * 1024
    assert parse_bytes("100") == 100
    assert parse_bytes(5) == 5


def test_config_is_frozen() -> None:
    config = KVServeConfig()
    with pytest.raises(Exception):
        config.http.port = 1  # type: ignore[misc]


def test_autoscaling_typed_policy_settings() -> None:
    a = KVServeConfig.from_dict({"workers": {"autoscaling": {}}}).workers.autoscaling
    assert a is not None and a.uses_kvserve_policy()
    assert (a.role, a.target_waiting_per_replica, a.target_waiting_prompt_tokens_per_replica) == ("mixed", 4.0, 8192.0)
    assert (a.kv_usage_ceiling, a.scale_to_zero, a.look_back_period_s, a.metrics_interval_s) == (0.85, False, 30.0, 10.0)
    assert KVServeConfig.from_dict({}).workers.drain_timeout_s == 60.0
    zero = {"min_replicas": 0, "scale_to_zero": True, "role": "prefill"}
    a = KVServeConfig.from_dict({"workers": {"autoscaling": zero}}).workers.autoscaling
    assert a is not None and a.kvserve_policy_kwargs()["scale_to_zero"] is True


def test_policy_kwargs_of_kvserve_policy_become_typed_fields(tmp_path: Path) -> None:
    """`policy_kwargs: {role: decode}` (FULL_YAML) is the same as `role: decode`, and survives
    a round trip through with_overrides."""
    config = KVServeConfig.from_yaml(write(tmp_path, FULL_YAML))
    a = config.workers.autoscaling
    assert a is not None and a.role == "decode" and a.policy_kwargs == {}
    again = config.with_overrides({"workers.autoscaling.kv_usage_ceiling": 0.9}).workers.autoscaling
    assert again is not None and (again.role, again.kv_usage_ceiling) == ("decode", 0.9)
    custom = {"policy": "my.module:Policy", "policy_kwargs": {"role": "anything"}}
    a = KVServeConfig.from_dict({"workers": {"autoscaling": custom}}).workers.autoscaling
    assert a is not None and a.policy_kwargs == {"role": "anything"} and not a.uses_kvserve_policy()


@pytest.mark.parametrize(
    ("autoscaling", "fragment"),
    [
        ({"min_replicas": 0}, "min_replicas 0 needs scale_to_zero: true"),
        ({"kv_usage_ceiling": 1.5}, "workers.autoscaling.kv_usage_ceiling"),
        ({"kv_usage_ceiling": 0}, "workers.autoscaling.kv_usage_ceiling"),
        ({"role": "encode"}, "workers.autoscaling.role"),
        ({"target_waiting_per_replica": 0}, "workers.autoscaling.target_waiting_per_replica"),
        ({"policy_kwargs": {"target": 3}}, "policy_kwargs ['target'] are not settings of kvserve's policy"),
        ({"role": "decode", "policy_kwargs": {"role": "prefill"}}, "role is set twice"),
        ({"metrics_interval_s": 0}, "workers.autoscaling.metrics_interval_s"),
    ],
)
def test_bad_autoscaling_values_are_rejected(autoscaling: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        KVServeConfig.from_dict({"workers": {"autoscaling": autoscaling}})
    assert fragment in str(info.value)


def test_bad_drain_timeout_is_rejected() -> None:
    with pytest.raises(ConfigError, match="workers.drain_timeout_s"):
        KVServeConfig.from_dict({"workers": {"drain_timeout_s": -1}})


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("http://redis:6379", "must be redis://HOST"),
        ("redis://", "must be redis://HOST"),
        ("redis://redis:port", "not a valid URL"),
        ("redis://:hunter2-secret@redis:6379", "must not contain a password"),
        ("redis://user:hunter2-secret@redis:6379", "must not contain a password"),
    ],
)
def test_bad_redis_urls_are_rejected_without_echoing_them(url: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment) as e:
        KVServeConfig.from_dict({"state": {"redis_url": url}})
    assert "state.redis_url" in str(e.value) and "hunter2" not in str(e.value)


def test_state_section() -> None:
    assert KVServeConfig.from_dict({}).state.redis_url is None
    state = KVServeConfig.from_dict({"state": {"redis_url": "rediss://r.ns.svc:6380/2", "lease_ttl_s": 10}}).state
    assert (state.redis_url, state.redis_password_env, state.lease_ttl_s) == ("rediss://r.ns.svc:6380/2", "KVSERVE_REDIS_PASSWORD", 10)
    with pytest.raises(ConfigError, match="did you mean 'redis_url'"):
        KVServeConfig.from_dict({"state": {"redis_ur": "redis://r"}})
    with pytest.raises(ConfigError, match="state.socket_timeout_s"):
        KVServeConfig.from_dict({"state": {"socket_timeout_s": 0}})


def test_stored_responses_follow_state_redis_url() -> None:
    """/v1/responses' store: Redis under the app's key prefix when state.redis_url is set
    (every ingress replica sees it), else each replica's memory."""
    local = KVServeConfig.from_dict({"app_name": "a"}).ingress_settings().response_store
    assert local.url is None
    shared = KVServeConfig.from_dict({"app_name": "a", "state": {"redis_url": "redis://cache:6379/0"}})
    spec = shared.ingress_settings().response_store
    assert spec.url == "redis://cache:6379/0" and spec.key_prefix == shared.redis_key_prefix()
    assert spec.password_env == shared.state.redis_password_env
