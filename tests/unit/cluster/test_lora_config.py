"""The `lora` section: vLLM's `--lora-modules` flag, the mapping onto the engine's
LoRAConfig and the ingress's settings, and its bounds."""
from __future__ import annotations

import argparse

import pytest

from cluster.cli import add_config_flags, config_from_args
from cluster.config import ConfigError, KVServeConfig
from cluster.lora_config import parse_lora_modules
from worker.config import LoRAConfig


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    return parser.parse_args(list(argv))


def test_lora_modules_flag_both_forms() -> None:
    assert parse_lora_modules(["sql=/a/sql", '{"name": "chat", "path": "/a/chat"}']) == {"sql": "/a/sql", "chat": "/a/chat"}
    with pytest.raises(ValueError, match="takes name=path"):
        parse_lora_modules(["just-a-path"])


def test_cli_flags_reach_engine_and_ingress() -> None:
    config = config_from_args(_args("--lora-modules", "b=/p/b", "a=/p/a", "--max-loras", "2", "--max-lora-rank", "32"))
    assert config.engine_config().lora == LoRAConfig(max_loras=2, max_lora_rank=32, modules=(("a", "/p/a"), ("b", "/p/b")))
    settings = config.ingress_settings()
    assert settings.lora_modules == (("a", "/p/a"), ("b", "/p/b")) and settings.lora_enabled
    plain = config_from_args(_args("--enable-lora"))
    assert plain.engine_config().lora.enabled and plain.ingress_settings().lora_enabled
    assert not KVServeConfig().engine_config().lora.enabled


def test_rank_bound_refused() -> None:
    with pytest.raises(ConfigError, match="max_lora_rank"):
        KVServeConfig.from_dict({"lora": {"max_lora_rank": 65}})


@pytest.mark.parametrize("data", [
    {"workers": {"tensor_parallel_size": 2}},
    {"engine": {"device": "sim:h200"}},
    {"disaggregation": {"prefill": {"num_replicas": 1}, "decode": {"num_replicas": 1}}},
])
def test_served_with_tp_sim_devices_and_disaggregation(data: dict) -> None:
    config = KVServeConfig.from_dict({"lora": {"modules": {"a": "/x"}}, **data})
    assert config.engine_config().lora.modules == (("a", "/x"),)
