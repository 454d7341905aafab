"""Tensor parallelism end to end on CPU (gloo): an engine whose runner leads a TP=2 group
of Ray actors gives token-identical greedy outputs to the single-device engine for a
mixed batch (chunked prefill, prefix hits, preemption), reads only its shard per rank,
and fails clearly when a rank dies; with LoRA adapters, a batch mixing the base model and
three adapters gives transformers + peft's greedy tokens.

Rank 0 lives in its own Ray actor here (as it does in a worker replica): a process joins
one torch.distributed group in its life, and the pytest process must not be it.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from kv.transfer import KVExport
from tests.conftest import run_engine
from tests.support.tiny_models import make_tiny_model
from worker.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from worker.engine.core import Engine
from worker.api import SamplingParams

import ray
from worker.engine.build import build_engine

VOCAB = 512


def _workload() -> tuple[list[list[int]], list[int]]:
    rng = random.Random(7)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    prefix = tokens(48)  # three full blocks: prefix-cache hits for the later requests
    prompts = [tokens(n) for n in (1, 17, 100, 33, 70)] + [prefix + tokens(n) for n in (5, 20, 9)]
    max_tokens = [24, 12, 20, 30, 8, 16, 10, 25]
    return prompts, max_tokens


def _config(model_dir: Path, tp_size: int) -> EngineConfig:
    return EngineConfig(
        ModelConfig(str(model_dir), dtype="float32", device="cpu", attention_backend="torch",
                    num_threads=1, tensor_parallel_size=tp_size),
        # 16 blocks of 16 for 6 requests of up to 130 tokens at once: preemption (2 here).
        CacheConfig(block_size=16, num_blocks_override=16),
        # 64-token budget: the long prompts are prefilled in chunks.
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
    )


def _run_workload(engine: Engine) -> tuple[dict[str, list[int]], dict[str, float]]:
    prompts, max_tokens = _workload()
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    # The shared-prefix requests go in after the first has cached the prefix.
    first = run_engine(engine, prompts[:6], params[:6], request_ids=[str(i) for i in range(6)])
    second = run_engine(engine, prompts[6:], params[6:], request_ids=["6", "7"])
    return {**first, **second}, engine.stats().to_dict()


def _prefill_exports(engine: Engine, prompts: list[list[int]]) -> list[KVExport]:
    """Prefill each prompt alone (the first token), keep its KV export, free the blocks."""
    exports = []
    for i, prompt in enumerate(prompts):
        rid = f"p{i}"
        engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), export_kv=True)
        outs = [out for _ in range(100) if engine.has_unfinished() for out in engine.step()]
        (out,) = [o for o in outs if o.request_id == rid]
        assert out.error is None, out.error
        exports.append(out.extra["kv_export"])
        assert engine.release_kv(rid)
    assert engine.num_pinned_blocks == 0 and engine.kv.num_free_blocks == engine.kv.num_total_blocks
    return exports


def _decode_imports(engine: Engine, prompts: list[list[int]], max_tokens: list[int],
                    exports: list[KVExport]) -> dict[str, list[int]]:
    """Import every export and decode to the end; the first token is the export's."""
    tokens: dict[str, list[int]] = {}
    for i, (prompt, n, export) in enumerate(zip(prompts, max_tokens, exports)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                           kv_import=export)
        tokens[str(i)] = [export.next_token_id]
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            tokens[out.request_id] += out.new_token_ids
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    return tokens


@ray.remote(num_cpus=1)
class TPEngineHost:
    """Rank 0: the engine, its scheduler and sampler, and the TPModelRunner."""

    def __init__(self, config: EngineConfig) -> None:
        import torch

        torch.set_num_threads(1)
        self.engine = build_engine(config)

    def run_workload(self) -> tuple[dict[str, list[int]], dict[str, float]]:
        return _run_workload(self.engine)

    def prefill_exports(self, prompts: list[list[int]]) -> list[KVExport]:
        return _prefill_exports(self.engine, prompts)

    def decode_imports(self, prompts: list[list[int]], max_tokens: list[int],
                       exports: list[KVExport]) -> dict[str, list[int]]:
        return _decode_imports(self.engine, prompts, max_tokens, exports)

    def load_stats(self) -> list[dict[str, int]]:
        return self.engine.runner.load_stats()

    def run_mixed(self, jobs: list[tuple[str, str | None, list[int], int]]) -> tuple[dict[str, list[int]], int]:
        from tests.support.tiny_lora import run_mixed

        tokens = run_mixed(self.engine, jobs)
        assert self.engine.kv.num_free_blocks == self.engine.kv.num_total_blocks
        return tokens, self.engine.lora.slots.num_loads

    def kill_rank_and_step(self) -> tuple[list[str | None], str]:
        runner = self.engine.runner
        ray.kill(runner.workers[0])
        ray.wait(runner._loop_refs, timeout=60)  # the loop's result: the actor has died
        self.engine.add_request("dead", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0))
        errors = [out.error for out in self.engine.step()]
        try:
            runner.check_health()
            health = "healthy"
        except Exception as e:
            health = str(e)
        return errors, health

    def shutdown(self) -> None:
        self.engine.runner.shutdown()


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tp") / "llama")


@pytest.fixture(scope="module")
def single_device_result(tiny_llama_dir: Path) -> tuple[dict[str, list[int]], dict[str, float]]:
    import torch

    threads = torch.get_num_threads()
    try:
        return _run_workload(build_engine(_config(tiny_llama_dir, 1)))
    finally:
        torch.set_num_threads(threads)


def test_tp2_greedy_matches_single_device(serve_cluster: object, tiny_llama_dir: Path, single_device_result: tuple) -> None:
    expected, single_stats = single_device_result
    host = TPEngineHost.remote(_config(tiny_llama_dir, 2))
    try:
        outputs, stats = ray.get(host.run_workload.remote(), timeout=600)
        assert outputs == expected
        # the workload exercised what it claims to (on both sides alike)
        assert stats["num_preemptions"] > 0 and stats["num_preemptions"] == single_stats["num_preemptions"]
        assert stats["prefix_cache_hits"] > 0

        per_rank = ray.get(host.load_stats.remote())
        assert len(per_rank) == 2
        single_bytes = sum(Path(f).stat().st_size for f in tiny_llama_dir.glob("*.safetensors"))
        for rank_stats in per_rank:  # each rank materialised about half of the checkpoint
            assert rank_stats["num_bytes"] < 0.6 * single_bytes

        errors, health = ray.get(host.kill_rank_and_step.remote(), timeout=120)
        assert errors and all(e and "tensor-parallel rank 1 of 2 died" in e for e in errors)
        assert "tensor-parallel rank 1 of 2 died" in health
    finally:
        ray.kill(host)


def test_kv_moves_between_tp2_and_single_device_engines(
    serve_cluster: object, tiny_llama_dir: Path, single_device_result: tuple
) -> None:
    """Disaggregation across TP sizes: a TP=2 prefill engine's exports carry all KV heads
    (gathered from both ranks) and a single-device engine decodes them; a single-device
    export is split over a TP=2 decode engine's ranks. Greedy tokens equal one engine's."""
    import torch

    expected, _ = single_device_result
    prompts, max_tokens = _workload()
    threads = torch.get_num_threads()
    host = TPEngineHost.remote(_config(tiny_llama_dir, 2))
    try:
        exports = ray.get(host.prefill_exports.remote(prompts), timeout=600)
        assert all(e.num_kv_heads == exports[0].num_kv_heads and e.kv.shape[3] == e.num_kv_heads for e in exports)
        single = build_engine(_config(tiny_llama_dir, 1))
        assert _decode_imports(single, prompts, max_tokens, exports) == expected  # TP=2 -> TP=1

        local_exports = _prefill_exports(single, prompts)
        for mine, theirs in zip(local_exports, exports):  # the same KV, whichever side computed it
            n = mine.num_tokens  # rows past the prompt are the last block's unused slots
            torch.testing.assert_close(mine.kv[:, :, :n], theirs.kv[:, :, :n], rtol=1e-4, atol=1e-5)
        tokens = ray.get(host.decode_imports.remote(prompts, max_tokens, local_exports), timeout=600)
        assert tokens == expected  # TP=1 -> TP=2
    finally:
        ray.kill(host)
        torch.set_num_threads(threads)


def test_tp2_lora_mixed_batch_matches_peft(serve_cluster: object, tiny_llama_dir: Path,
                                          tmp_path_factory: pytest.TempPathFactory) -> None:
    """Base-model requests and requests of three adapters (ranks 4, 8, 16; attention only,
    all targets with rsLoRA, MLP only) in flight together on a TP=2 engine: each rank
    applies its shard of every adapter, and the tokens are peft's. Two slots for three
    adapters: a slot is rewritten on both ranks mid-run."""
    from tests.support.tiny_lora import make_mixed_adapters, peft_greedy

    paths = make_mixed_adapters(tiny_llama_dir, tmp_path_factory.mktemp("tp-lora"))
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (7, 21, 40)]
    names: list[str | None] = [None, *paths]
    expected = {name: peft_greedy(tiny_llama_dir, paths.get(name) if name else None, prompts, [8] * len(prompts))
                for name in names}
    assert all(expected[name] != expected[None] for name in paths)
    config = _config(tiny_llama_dir, 2)
    config = EngineConfig(config.model, CacheConfig(block_size=16, num_blocks_override=64), config.scheduler,
                          LoRAConfig(max_loras=2, max_lora_rank=16, modules=tuple((n, str(p)) for n, p in paths.items())))
    host = TPEngineHost.remote(config)
    try:
        jobs = [(f"{name}/{i}", name, p, 8) for name in names for i, p in enumerate(prompts)]
        got, num_slot_writes = ray.get(host.run_mixed.remote(jobs), timeout=600)
        for name in names:
            assert [got[f"{name}/{i}"] for i in range(len(prompts))] == expected[name], name
        assert num_slot_writes >= 3
    finally:
        ray.get(host.shutdown.remote(), timeout=120)
        ray.kill(host)


def test_indivisible_heads_rejected(tiny_llama_dir: Path) -> None:
    # The tiny model has 4 attention heads: 3 ranks cannot split them. Rejected before any
    # rank (or Ray) is involved.
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's 4 attention heads"):
        build_engine(_config(tiny_llama_dir, 3))
