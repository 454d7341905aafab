"""The `lora` section: vLLM's `--lora-modules` flag, the mapping onto the engine's
LoRAConfig and the ingress's settings, and where adapters cannot be served yet."""
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


@pytest.mark.parametrize("data, fragment", [
    ({"lora": {"max_lora_rank": 65}}, "max_lora_rank"),
    ({"lora": {"enable": True}, "workers": {"tensor_parallel_size": 2}}, "tensor_parallel_size 1"),
    ({"lora": {"modules": {"a": "/x"}}, "engine": {"device": "sim:h200"}}, "a real device"),
])
def test_refused_where_not_served(data: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        KVServeConfig.from_dict(data)
