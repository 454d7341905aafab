"""The MoE families under tensor parallelism 2 (2 spawned processes, gloo, no Ray), sharded
within each expert: the whole model's logits over two steps (prefill, chunked prefill,
decode through the paged KV cache) are the single-device ones on every rank, and each rank
reads only its shard of the experts. Uses test_tp_layers.py's two-step driver.

Families: Qwen3-MoE (dense and sparse layers, qkv/o biases), Mixtral (per-expert w1/w3/w2),
gpt-oss (fused interleaved experts with biases added once, sinks sharded by head).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.support.tiny_moe import make_tiny_moe
from tests.unit.worker.test_tp_layers import _model_logits
from worker.model.parallel import TPContext

SIZE = 2
FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")


def _rank_main(rank: int, init_file: str, model_dirs: dict[str, str], out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=SIZE)
    tp = TPContext(rank, SIZE, dist.group.WORLD)
    result = {name: _model_logits(path, tp) for name, path in model_dirs.items()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], list[dict]]:
    root = tmp_path_factory.mktemp("moe_tp")
    dirs = {f: str(make_tiny_moe(f, root / f)) for f in FAMILIES}
    out = root / "out"
    out.mkdir()
    mp.spawn(_rank_main, args=(str(root / "init"), dirs, str(out)), nprocs=SIZE, join=True)
    return dirs, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(SIZE)]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_single_device(tp_run: tuple[dict[str, str], list[dict]], family: str) -> None:
    dirs, results = tp_run
    single, _ = _model_logits(dirs[family], TPContext())
    for result in results:  # every rank gets the full logits
        for step, (got, want) in enumerate(zip(result[family][0], single)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"{family} step {step}")
            assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("family", FAMILIES)
def test_each_rank_reads_about_half(tp_run: tuple[dict[str, str], list[dict]], family: str) -> None:
    """Experts, attention (sinks too) and the vocab are split; only norms, routers and the
    replicated biases are read whole, so a rank reads well under 60% of the checkpoint."""
    dirs, results = tp_run
    _, single = _model_logits(dirs[family], TPContext())
    per_rank = [r[family][1] for r in results]
    assert all(s["num_tensors"] == single["num_tensors"] for s in per_rank)
    assert all(s["num_bytes"] < 0.6 * single["num_bytes"] for s in per_rank), (per_rank, single)


def test_expert_size_not_divisible_is_refused(tmp_path: Path) -> None:
    from dataclasses import replace

    from worker.model.registry import arch_for
    from worker.model_config import load_hf_config

    arch = arch_for(load_hf_config(make_tiny_moe("mixtral", tmp_path / "m")))
    arch.validate_tp(2)
    with pytest.raises(ValueError, match="expert intermediate size 30"):
        replace(arch, moe_intermediate_size=30).validate_tp(4)
