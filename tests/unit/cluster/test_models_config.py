"""The `models:` list (cluster/models_config.py): each model's view, and the list's rules."""
from __future__ import annotations

import pytest

from cluster.config import ConfigError, KVServeConfig
from cluster.models_config import model_views, slug_of

TWO = {
    "engine": {"device": "cpu", "num_blocks": 64, "max_num_seqs": 8},
    "state": {"redis_url": "redis://localhost:6379/0"},
    "models": [
        {"name": "chat", "engine": {"max_num_seqs": 4}, "lora": {"modules": {"sql": "/adapters/sql"}}},
        {"name": "org/coder", "workers": {"num_replicas": 2, "tensor_parallel_size": 2},
         "disaggregation": {"prefill": {"autoscaling": {"role": "prefill"}}, "decode": {}}},
    ],
}


def test_a_config_without_models_is_its_own_one_view() -> None:
    config = KVServeConfig.from_dict({"model": {"served_model_name": "m"}})
    [view] = model_views(config)
    assert (view.name, view.slug, view.deployment("worker")) == ("m", "", "worker")
    assert view.config is config


def test_each_model_gets_its_engine_pools_adapters_and_redis_namespace() -> None:
    chat, coder = model_views(KVServeConfig.from_dict(TWO))
    assert (chat.name, coder.name, coder.slug) == ("chat", "org/coder", "org-coder")
    # The model's engine keys over the top-level engine's, key by key.
    assert (chat.config.engine.max_num_seqs, chat.config.engine.num_blocks) == (4, 64)
    assert (coder.config.engine.max_num_seqs, coder.config.engine.num_blocks) == (8, 64)
    assert chat.config.model.resolved_name() == "chat"
    assert chat.config.lora.modules == {"sql": "/adapters/sql"} and coder.config.lora.modules == {}
    assert chat.config.disaggregation is None and coder.config.disaggregation is not None
    assert coder.config.workers.tensor_parallel_size == 2 and chat.config.workers.tensor_parallel_size == 1
    assert coder.deployment("decode") == "decode-org-coder" and chat.deployment("worker") == "worker-chat"
    prefixes = {chat.config.redis_key_prefix(), coder.config.redis_key_prefix()}
    assert prefixes == {"kvserve:kvserve:model:chat", "kvserve:kvserve:model:org-coder"}
    assert chat.config.shared_view_spec().key_prefix != coder.config.shared_view_spec().key_prefix
    assert chat.config.engine_config().model.model == coder.config.engine_config().model.model  # both the default


@pytest.mark.parametrize("models, match", [
    ([{"name": "a"}, {"name": "a"}], "the name 'a' is used twice"),
    ([{}, {}], "is used twice"),  # two embedded default models under its one name
    ([{"name": "a/b"}, {"name": "a_b"}, {"name": "a-b"}], "the deployment slug 'a-b' is used twice"),
    ([{"name": "a", "lora": {"modules": {"x": "/p"}}}, {"name": "b", "lora": {"modules": {"x": "/q"}}}],
     "the LoRA adapter 'x' is used twice"),
    ([{"name": "a", "lora": {"modules": {"b": "/p"}}}, {"name": "b"}], "'b' is both a model and a LoRA adapter"),
    ([{"name": "a", "engin": {}}], "engin"),
    ([{"name": "a", "engine": {"max_num_seq": 3}}], "max_num_seq"),
    ([{"name": "a", "engine": {"block_size": 12}}], "power of two"),
    ([{"name": ""}], "name"),
])
def test_bad_model_lists_are_refused(models: list[dict], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        KVServeConfig.from_dict({"models": models})


def test_model_and_models_together_are_refused() -> None:
    with pytest.raises(ConfigError, match="not both"):
        KVServeConfig.from_dict({"model": "/m", "models": [{"name": "a"}]})


def test_a_models_sections_are_validated_where_they_are() -> None:
    with pytest.raises(ConfigError, match=r"models\.0\.workers\.autoscaling: min_replicas \(3\) > max_replicas"):
        KVServeConfig.from_dict({"models": [{"name": "a", "workers": {
            "autoscaling": {"min_replicas": 3, "max_replicas": 2}}}]})


def test_key_models_must_name_served_models() -> None:
    config = KVServeConfig.from_dict({"models": [{"name": "a"}, {"name": "b"}],
                                      "ingress": {"key_models": {"0123456789ab": ["b"]}}})
    assert config.ingress_settings().key_models == {"0123456789ab": ["b"]}
    with pytest.raises(ConfigError, match="'c' is not a served model"):
        KVServeConfig.from_dict({"models": [{"name": "a"}], "ingress": {"key_models": {"k": ["c"]}}})
    # One model (no list): a key may be limited to it by its name too.
    KVServeConfig.from_dict({"model": {"served_model_name": "m"}, "ingress": {"key_models": {"k": ["m"]}}})


def test_slug() -> None:
    assert slug_of("meta-llama/Llama-3.2-1B") == "meta-llama-Llama-3.2-1B"
    assert slug_of("///") == "model"


def test_a_local_cluster_gets_cpus_for_every_models_pools() -> None:
    from cluster.cli import local_num_cpus

    config = KVServeConfig.from_dict({"engine": {"device": "cpu"}, "models": [
        {"name": "a", "workers": {"num_replicas": 40, "num_cpus": 1}},
        {"name": "b", "disaggregation": {"prefill": {"num_replicas": 20, "num_cpus": 1},
                                         "decode": {"num_replicas": 10, "num_cpus": 1}}}]})
    assert local_num_cpus(config) == 71  # 40 + 20 + 10 worker CPUs and the ingress's 0.5


def test_the_app_binds_every_models_pools_to_one_ingress() -> None:
    from cluster.app import app_builder

    app = app_builder({**TWO, "ingress": {"key_models": {"0123456789ab": ["chat"]}}})
    ingress = app._bound_deployment
    assert ingress.name == "ingress"
    worker, settings = ingress.init_args
    assert worker._bound_deployment.name == "worker-chat" and settings.served_model_name == "chat"
    assert settings.key_models == {"0123456789ab": ["chat"]} and "prefill_worker" not in ingress.init_kwargs
    [coder] = ingress.init_kwargs["other_models"]
    assert coder.settings.served_model_name == "org/coder"
    assert (coder.worker._bound_deployment.name, coder.prefill_worker._bound_deployment.name) == (
        "decode-org-coder", "prefill-org-coder")
    # Each pool runs its model's engine, and its router shares its view in its own namespace.
    chat_engine = worker._bound_deployment.init_args[0]
    assert chat_engine.scheduler.max_num_seqs == 4 and chat_engine.lora.modules == (("sql", "/adapters/sql"),)
    views = {d.name: d._deployment_config.request_router_config.request_router_kwargs["shared_view"]["key_prefix"]
             for d in (worker._bound_deployment, coder.worker._bound_deployment)}
    assert views == {"worker-chat": "kvserve:kvserve:model:chat", "decode-org-coder": "kvserve:kvserve:model:org-coder"}


def test_a_single_model_app_keeps_its_deployment_names() -> None:
    from cluster.app import app_builder

    ingress = app_builder({"engine": {"device": "cpu"}})._bound_deployment
    assert ingress.init_args[0]._bound_deployment.name == "worker" and "other_models" not in ingress.init_kwargs
    disagg = app_builder({"engine": {"device": "cpu"}, "disaggregation": {}})._bound_deployment
    assert disagg.init_args[0]._bound_deployment.name == "decode"
    assert disagg.init_kwargs["prefill_worker"]._bound_deployment.name == "prefill"


def test_each_model_has_its_own_planner_targets() -> None:
    from cluster.app import worker_options

    config = KVServeConfig.from_dict({
        "engine": {"device": "sim:h200", "model_shape": "llama-3-8b"},
        "models": [
            {"name": "chat", "workers": {"autoscaling": {"max_replicas": 8, "slo": {
                "ttft_ms": 500, "itl_ms": 30, "priority": 2}}}},
            {"name": "batch", "engine": {"max_num_seqs": 32}, "workers": {"autoscaling": {"max_replicas": 2}}},
        ]})
    chat, batch = (worker_options(view.config)["autoscaling_config"] for view in model_views(config))
    assert chat.policy.policy_function == "cluster.planner.serve_policy:SLOPlannerPolicy"
    assert chat.policy.policy_kwargs["model"] == "chat" and chat.max_replicas == 8
    assert batch.policy.policy_function == "cluster.autoscaling:QueueDepthPolicy" and batch.max_replicas == 2
    # The planner prices the model's own engine; a model without a cost model is refused.
    with pytest.raises(ConfigError, match=r"models\[0\] \(a\).*step_time_profile"):
        KVServeConfig.from_dict({"engine": {"device": "cpu"}, "models": [
            {"name": "a", "workers": {"autoscaling": {"slo": {"ttft_ms": 1000, "itl_ms": 50}}}}]})
