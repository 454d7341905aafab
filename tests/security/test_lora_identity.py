"""Issue 48, findings 2 and 3b: an adapter's file sizes are checked before it is read,
a malformed adapter_config is a LoRAAdapterError (the load API's 400) naming no path, and
an adapter's identity is its content: replacing its files in place gives it a new hash
root (no old prefix KV served), and a worker never serves files whose digest is not the
one its request names."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from router.frontend.lora_modules import LoRAModules
from router.frontend.lora_policy import LoRAPolicy
from router.routing.types import request_hash_root
from tests.conftest import TinyModels
from worker.api import LoRAAdapterError
from worker.config import LoRAConfig
from worker.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
from worker.lora.engine_lora import EngineLoRA
from worker.lora.identity import make_ref, read_adapter_files, split_ref
from worker.lora.model_lora import adapter_loader
from worker.model.llama import LlamaArch
from worker.model_config import load_hf_config


@pytest.fixture(scope="module")
def base(tiny_model: TinyModels) -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def loader(base: Path) -> Any:
    return adapter_loader(LlamaArch.from_hf_config(load_hf_config(base)), 16)


def make(base: Path, out: Path, seed: int) -> Path:
    from tests.support.tiny_lora import make_tiny_adapter

    return make_tiny_adapter(base, out, 4, targets=("q_proj",), seed=seed)


def test_oversized_weights_refused_before_they_are_read(base: Path, tmp_path: Path) -> None:
    """Finding 2: a (sparse) 64 GiB weights file is refused from its size, not read."""
    adapter = make(base, tmp_path / "big", 0)
    os.truncate(adapter / WEIGHTS_FILE, 64 * 1024**3)
    tiny_loader = adapter_loader(LlamaArch.from_hf_config(load_hf_config(base)), 16, max_bytes=1024**2)
    with pytest.raises(LoRAAdapterError, match="bytes") as info:
        tiny_loader("big", str(adapter))
    assert str(tmp_path) not in str(info.value)


@pytest.mark.parametrize("config", ['[1, 2]', '{"r": 4, "lora_alpha": "x"}', '{"r": true}', '"text"', '{"r": 4, "bias": 5}'])
def test_malformed_adapter_config_is_an_adapter_error_without_path(loader: Any, base: Path, tmp_path: Path,
                                                                   config: str) -> None:
    """Low finding: a malformed adapter_config.json is a LoRAAdapterError (400), never a 500,
    and the message names no directory."""
    adapter = make(base, tmp_path / "bad", 0)
    (adapter / CONFIG_FILE).write_text(config)
    with pytest.raises(LoRAAdapterError) as info:
        loader("bad", str(adapter))
    assert str(tmp_path) not in str(info.value)


def test_replaced_files_give_a_new_identity(base: Path, tmp_path: Path) -> None:
    """Finding 3b: overwrite an adapter's directory, unload, load from the same path: the
    request's hash root (and so its prefix KV) is not the old one."""
    root = tmp_path / "adapters"
    make(base, root / "x", 0)
    modules = LoRAModules("tiny", (), True, LoRAPolicy(runtime_updates=True, adapter_roots=(str(root),)))

    async def check(name: str, path: str, roots: tuple[str, ...]) -> tuple[str, str]:
        return path, read_adapter_files(path, 1024**3).digest

    import asyncio

    from router.frontend.lora_modules import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

    asyncio.run(modules.load(LoadLoRAAdapterRequest(lora_name="x", lora_path=str(root / "x")), check))
    _, old_ref = modules.resolve("x")  # type: ignore[misc]
    shutil.rmtree(root / "x")
    make(base, root / "x", 1)  # same path, same shapes, other weights
    asyncio.run(modules.unload(UnloadLoRAAdapterRequest(lora_name="x")))
    asyncio.run(modules.load(LoadLoRAAdapterRequest(lora_name="x", lora_path=str(root / "x")), check))
    _, new_ref = modules.resolve("x")  # type: ignore[misc]
    assert split_ref(old_ref)[0] == split_ref(new_ref)[0] == str(root / "x")
    assert request_hash_root((), "x", old_ref) != request_hash_root((), "x", new_ref)


def test_worker_refuses_files_that_are_not_the_named_content(loader: Any, base: Path, tmp_path: Path) -> None:
    """Finding 3b: a worker reading an adapter by reference checks its digest: files
    replaced behind the reference are refused, never served under the old identity."""
    adapter = make(base, tmp_path / "x", 0)
    ref = make_ref(str(adapter), read_adapter_files(str(adapter), 1024**3).digest)
    assert loader("x", ref).digest == split_ref(ref)[1]
    shutil.rmtree(adapter)
    make(base, adapter, 1)
    with pytest.raises(LoRAAdapterError, match="changed since it was loaded"):
        loader("x", ref)


def test_engine_drops_old_weights_for_a_new_identity(loader: Any, base: Path, tmp_path: Path) -> None:
    """Finding 3b: a worker that holds an adapter's weights in host memory, asked for the same
    name under its new content, reads the new files and chains from a new root."""
    adapter = make(base, tmp_path / "x", 0)
    old_ref = make_ref(str(adapter), read_adapter_files(str(adapter), 1024**3).digest)
    lora = EngineLoRA(LoRAConfig(enable=True), loader)
    lora.ensure("x", old_ref)
    old_key = lora.cache_key("x")
    lora.registry.pin("x").result()
    old_weights = lora.registry.get("x").weights
    lora.registry.unpin("x")
    shutil.rmtree(adapter)
    make(base, adapter, 1)
    new_ref = make_ref(str(adapter), read_adapter_files(str(adapter), 1024**3).digest)
    lora.ensure("x", new_ref)
    assert lora.cache_key("x") != old_key
    assert request_hash_root((), "x", new_ref) != request_hash_root((), "x", old_ref)
    new = lora.registry.pin("x").result()
    key = next(iter(new.weights))
    assert not torch.equal(new.weights[key][0], old_weights[key][0])
    assert json.loads((adapter / CONFIG_FILE).read_text())["r"] == new.rank


def test_engine_never_serves_old_weights_or_kv_after_files_are_replaced(base: Path, tmp_path: Path) -> None:
    """Finding 3b end to end on a real engine: serve a prompt under an adapter, replace its
    files in place (same shapes), unload it on the worker, serve the same prompt under the
    new content: the output is peft's for the new files, and no prefix block is reused."""
    from tests.support.tiny_lora import peft_greedy
    from worker.api import SamplingParams
    from worker.config import CacheConfig, EngineConfig, ModelConfig
    from worker.engine.build import build_engine

    engine = build_engine(EngineConfig(ModelConfig(str(base), dtype="float32", device="cpu"),
                                       CacheConfig(block_size=16, num_blocks_override=64), lora=LoRAConfig(enable=True)))
    adapter = make(base, tmp_path / "x", 0)
    prompt = list(range(3, 40))  # two full blocks

    def serve(request_id: str) -> tuple[list[int], int]:
        ref = make_ref(str(adapter), read_adapter_files(str(adapter), 1024**3).digest)
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=4, temperature=0.0), lora_name="x",
                           lora_path=ref)
        tokens, cached = [], 0
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
                cached = max(cached, out.num_cached_tokens or 0)
        return tokens, cached

    first, _ = serve("first")
    assert first == peft_greedy(base, adapter, [prompt], [4])[0]
    shutil.rmtree(adapter)
    make(base, adapter, 7)
    assert engine.unload_lora("x") and engine.lora.registry.names == []
    second, cached = serve("second")
    assert second == peft_greedy(base, adapter, [prompt], [4])[0]
    assert cached == 0


def test_unreadable_adapter_file_is_an_adapter_error(loader: Any, base: Path, tmp_path: Path) -> None:
    """A directory where the config file should be is a LoRAAdapterError (400), not a 500."""
    adapter = make(base, tmp_path / "odd", 0)
    (adapter / CONFIG_FILE).unlink()
    (adapter / CONFIG_FILE).mkdir()
    with pytest.raises(LoRAAdapterError, match="no adapter_config.json") as info:
        loader("odd", str(adapter))
    assert str(tmp_path) not in str(info.value)
