"""Greedy outputs of a step that mixes the base model and several LoRA adapters (different
ranks, targets, rsLoRA) are token-for-token those of transformers + peft, each request
against its own adapter, on two model families."""
from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from worker.api import SamplingParams
from worker.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from worker.engine.core import Engine
from worker.engine.build import build_engine

if TYPE_CHECKING:
    from tests.conftest import TinyModels

VOCAB = 512


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 40))] for _ in range(n)]


@pytest.fixture(scope="module")
def adapters(tiny_model: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, Path]]:
    from tests.support.tiny_lora import make_mixed_adapters

    made: dict[str, dict[str, Path]] = {}

    def get(family: str) -> dict[str, Path]:
        if family not in made:
            made[family] = make_mixed_adapters(tiny_model(family), tmp_path_factory.mktemp(f"lora-{family}"))
        return made[family]

    return get


def _engine(model_dir: Path, modules: dict[str, Path], max_loras: int = 3, num_blocks: int = 256) -> Engine:
    return build_engine(EngineConfig(
        ModelConfig(str(model_dir), dtype="float32", device="cpu"),
        CacheConfig(block_size=16, num_blocks_override=num_blocks),
        SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512),
        LoRAConfig(max_loras=max_loras, max_lora_rank=16, modules=tuple((n, str(p)) for n, p in modules.items())),
    ))


def _run_mixed(engine: Engine, jobs: list[tuple[str, str | None, list[int], int]]) -> dict[str, list[int]]:
    from tests.support.tiny_lora import run_mixed

    return run_mixed(engine, jobs)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_mixed_batch_matches_peft(family: str, tiny_model: TinyModels, adapters: Callable) -> None:
    from tests.support.tiny_lora import peft_greedy

    base, paths = tiny_model(family), adapters(family)
    prompts = _prompts(8, seed=7)
    max_tokens = [12] * len(prompts)
    expected: dict[str | None, list[list[int]]] = {None: peft_greedy(base, None, prompts, max_tokens)}
    for name, path in paths.items():
        expected[name] = peft_greedy(base, path, prompts, max_tokens)
        assert expected[name] != expected[None], f"adapter {name} does not change outputs: a vacuous test"
    # Every prompt under every adapter and the base model, all in flight together; the
    # same prompt under two adapters must not share KV through the prefix cache.
    names: list[str | None] = [None, *paths]
    jobs = [(f"{name}/{i}", name, p, n) for name in names for i, (p, n) in enumerate(zip(prompts, max_tokens))]
    engine = _engine(base, paths)
    got = _run_mixed(engine, jobs)
    for name in names:
        assert [got[f"{name}/{i}"] for i in range(len(prompts))] == expected[name], name
    stats = engine.stats()
    assert stats.kv.free_blocks == stats.kv.total_blocks
    # Again, now that the prefix cache holds every prompt under every adapter.
    got = _run_mixed(engine, [(f"again-{rid}", *rest) for rid, *rest in jobs])
    for name in names:
        assert [got[f"again-{name}/{i}"] for i in range(len(prompts))] == expected[name], name


def test_one_slot_for_three_adapters(tiny_model: TinyModels, adapters: Callable) -> None:
    """max_loras=1: adapters take turns in the one slot (each admission waits for it to be
    free, then rewrites it); base-model requests never wait for it. Outputs still match."""
    from tests.support.tiny_lora import peft_greedy

    base, paths = tiny_model("llama"), adapters("llama")
    prompts = _prompts(2, seed=11)
    expected = {name: peft_greedy(base, path, prompts, [6, 6]) for name, path in paths.items()}
    expected[None] = peft_greedy(base, None, prompts, [6, 6])
    engine = _engine(base, paths, max_loras=1)
    jobs = [(f"{name}/{i}", name, p, 6) for name in [*paths, None] for i, p in enumerate(prompts)]
    got = _run_mixed(engine, jobs)
    for name in [*paths, None]:
        assert [got[f"{name}/{i}"] for i in range(2)] == expected[name], name
    assert engine.lora.slots.num_loads == 3  # one load per adapter: same-adapter requests share a turn
    # The routing report carries residency (not requests in flight), and the router reads it.
    import time

    from router.routing.types import ReplicaReport
    from worker.serving.routing_report import build_routing_stats

    last = list(paths)[-1]
    stats = build_routing_stats(engine, engine.stats(), [], time.time()).to_dict()
    assert stats["lora_resident"] == (last,) and stats["lora_loaded"] == (last,)  # max_cpu_loras = max_loras = 1
    report = ReplicaReport.from_stats(stats)
    assert report.lora_resident == frozenset({last}) and report.lora_loaded == frozenset({last})


def test_unknown_and_broken_adapters(tiny_model: TinyModels, adapters: Callable, tmp_path: Path) -> None:
    from worker.api import LoRANotFoundError

    base, paths = tiny_model("llama"), adapters("llama")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "peft_type": "LORA"}')
    engine = _engine(base, {"r4-attn": paths["r4-attn"], "broken": broken})
    with pytest.raises(LoRANotFoundError, match=r"'nope' does not exist; known adapters: broken, r4-attn"):
        engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=2), lora_name="nope")
    # The broken adapter fails its own request when its load fails; the others finish.
    params = SamplingParams(max_tokens=3, temperature=0.0)
    engine.add_request("bad", [5, 6, 7], params, lora_name="broken")
    engine.add_request("good", [5, 6, 7], params, lora_name="r4-attn")
    engine.add_request("base", [5, 6, 7], params)
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert "adapter_model.safetensors" in finals["bad"].error and finals["bad"].finish_reason == "error"
    assert finals["good"].error is None and finals["good"].num_output_tokens == 3
    assert finals["base"].error is None and finals["base"].num_output_tokens == 3
    stats = engine.stats()
    assert stats.kv.free_blocks == stats.kv.total_blocks


def test_engine_learns_an_adapter_from_its_request(tiny_model: TinyModels, adapters: Callable) -> None:
    """A worker replica started after an adapter was loaded knows nothing of it: the
    request's path teaches it (the ingress sends every request's adapter with its path)."""
    from tests.support.tiny_lora import peft_greedy

    base, paths = tiny_model("llama"), adapters("llama")
    engine = build_engine(EngineConfig(
        ModelConfig(str(base), dtype="float32", device="cpu"), CacheConfig(block_size=16, num_blocks_override=64),
        lora=LoRAConfig(enable=True)))
    prompt = _prompts(1, seed=3)[0]
    engine.add_request("a", prompt, SamplingParams(max_tokens=5, temperature=0.0), lora_name="r8-all",
                       lora_path=str(paths["r8-all"]))
    got: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            got += out.new_token_ids
    assert got == peft_greedy(base, paths["r8-all"], [prompt], [5])[0]
    assert engine.lora.registry.names == ["r8-all"]


def test_abort_while_the_adapter_loads(tiny_model: TinyModels, adapters: Callable) -> None:
    """A request waiting for its adapter's host load (outside the scheduler) aborts cleanly:
    its adapter is unpinned and nothing stays unfinished."""
    import threading

    engine = _engine(tiny_model("llama"), adapters("llama"))
    # The real loader, held until the abort: a tiny adapter could otherwise be read before
    # add_request looks, and the request would go straight to the scheduler.
    gate, read = threading.Event(), engine.lora.registry._loader
    engine.lora.registry._loader = lambda name, path: gate.wait(30) and read(name, path)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2), lora_name="r16-mlp")
    assert engine.lora.is_loading(engine.seqs["a"])
    out = engine.abort_request("a")
    gate.set()
    assert out.finished and out.finish_reason == "abort"
    assert not engine.lora.registry.in_use("r16-mlp") and not engine.has_unfinished()
    assert engine.step() == []


def test_router_hashes_an_adapter_prompt_as_the_engine_caches_it(tiny_model: TinyModels, adapters: Callable) -> None:
    """The replica reports cached block hashes; the router must hash an adapter request's
    prompt from the same adapter-keyed root, or it would credit the base model's cache
    (or another adapter's) to it."""
    from router.routing.types import RequestProfile, request_hash_root

    paths = adapters("llama")
    engine = _engine(tiny_model("llama"), paths)
    prompt = _prompts(1, seed=5)[0] + list(range(3, 40))  # at least two full blocks
    _run_mixed(engine, [("a", "r4-attn", prompt, 2)])
    cached = set(engine.kv.cached_block_hashes(1000))
    own = RequestProfile(prompt, 2, request_hash_root((), "r4-attn", str(paths["r4-attn"]))).block_hashes(16)
    assert len(own) >= 2 and set(own) <= cached
    assert not set(RequestProfile(prompt, 2).block_hashes(16)) & cached  # the base model's chain


def test_kv_handed_over_under_the_adapter_root(tiny_model: TinyModels, adapters: Callable) -> None:
    """Disaggregation at the engine level: a prefill engine computes the prompt under the
    adapter and exports its KV under the adapter's hash root; a decode engine with the same
    adapter continues it token for token as peft does. The same export offered to a request
    of another adapter, or of the base model, is refused: its KV is not theirs."""
    from kv.block_hash import root_hash
    from tests.support.tiny_lora import peft_greedy
    from worker.api import KVImportError, lora_cache_key

    base, paths = tiny_model("llama"), adapters("llama")
    prompt = _prompts(1, seed=13)[0] + list(range(3, 40))  # two full blocks and a partial one
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prefill, decode = _engine(base, paths), _engine(base, paths)
    prefill.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0.0), export_kv=True,
                        lora_name="r8-all")
    (out,) = [o for _ in range(100) if prefill.has_unfinished() for o in prefill.step()]
    export = out.extra["kv_export"]
    assert export.hash_root == root_hash((lora_cache_key("r8-all", str(paths["r8-all"])),))
    for other in ("r4-attn", None):
        with pytest.raises(KVImportError, match="another LoRA adapter or cache salt"):
            decode.add_request(f"x-{other}", prompt, params, kv_import=export, lora_name=other)
    decode.add_request("d", prompt, params, kv_import=export, lora_name="r8-all")
    tokens = [export.next_token_id]
    while decode.has_unfinished():
        for o in decode.step():
            assert o.error is None, o.error
            tokens += o.new_token_ids
    assert tokens == peft_greedy(base, paths["r8-all"], [prompt], [8])[0]
    assert prefill.release_kv("p")
    for engine in (prefill, decode):
        assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
