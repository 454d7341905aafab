"""DeepSeek-V3 under tensor parallelism 2 (2 spawned processes, gloo, no Ray): attention
split by query heads over a latent pool every rank holds whole, the dense and shared MLPs
by intermediate size, the routed experts within each expert. The whole model's logits
over two steps (prefill, chunked prefill, decode through the paged latent cache) are the
single-device ones on every rank, and each rank reads well under the whole checkpoint.
A LoRA adapter on every MLA attention target gives the single-device logits too (q_b_proj
sharded by heads, q_a / kv_a whole on each rank, o_proj's delta before the all-reduce).
Uses test_tp_layers.py's two-step driver."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.support.tiny_deepseek import make_tiny_deepseek
from tests.unit.worker.tp.test_tp_layers import _model_logits
from worker.model.parallel import TPContext

SIZE = 2
VARIANTS = ("ds_qlora", "ds_qproj")


LORA_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")


def _rank_main(rank: int, init_file: str, model_dirs: dict[str, str], out_dir: str, adapter: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=SIZE)
    tp = TPContext(rank, SIZE, dist.group.WORLD)
    result = {name: _model_logits(path, tp) for name, path in model_dirs.items()}
    result["lora"] = _model_logits(model_dirs["ds_qlora"], tp, adapter)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], list[dict]]:
    from tests.support.tiny_lora import make_tiny_adapter

    root = tmp_path_factory.mktemp("deepseek_tp")
    dirs = {v: str(make_tiny_deepseek(v, root / v)) for v in VARIANTS}
    dirs["adapter"] = str(make_tiny_adapter(Path(dirs["ds_qlora"]), root / "adapter", 8, LORA_TARGETS, seed=2))
    out = root / "out"
    out.mkdir()
    models = {v: dirs[v] for v in VARIANTS}
    mp.spawn(_rank_main, args=(str(root / "init"), models, str(out), dirs["adapter"]), nprocs=SIZE, join=True)
    return dirs, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(SIZE)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_single_device(tp_run: tuple[dict[str, str], list[dict]], variant: str) -> None:
    dirs, results = tp_run
    single, _ = _model_logits(dirs[variant], TPContext())
    for result in results:  # every rank gets the full logits
        for step, (got, want) in enumerate(zip(result[variant][0], single)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"{variant} step {step}")
            assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_lora_logits_match_single_device(tp_run: tuple[dict[str, str], list[dict]]) -> None:
    dirs, results = tp_run
    single, _ = _model_logits(dirs["ds_qlora"], TPContext(), dirs["adapter"])
    base, _ = _model_logits(dirs["ds_qlora"], TPContext())
    assert not torch.allclose(single[-1], base[-1], atol=1e-3), "the adapter changes nothing: a vacuous test"
    for result in results:
        for step, (got, want) in enumerate(zip(result["lora"][0], single)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"lora step {step}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_rank_reads_its_share(tp_run: tuple[dict[str, str], list[dict]], variant: str) -> None:
    """Heads, experts, MLPs and the vocab are split; the latent path (q_a / kv_a and their
    norms), the gates and the norms are read whole by every rank."""
    dirs, results = tp_run
    _, single = _model_logits(dirs[variant], TPContext())
    per_rank = [r[variant][1] for r in results]
    assert all(s["num_tensors"] == single["num_tensors"] for s in per_rank)
    assert all(s["num_bytes"] < 0.65 * single["num_bytes"] for s in per_rank), (per_rank, single)
