"""DeepSeek-V3 under tensor parallelism 2 (2 spawned processes, gloo, no Ray): attention
split by query heads over a latent pool every rank holds whole, the dense and shared MLPs
by intermediate size, the routed experts within each expert. The whole model's logits
over two steps (prefill, chunked prefill, decode through the paged latent cache) are the
single-device ones on every rank, and each rank reads well under the whole checkpoint.
Uses test_tp_layers.py's two-step driver."""
from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.support.tiny_deepseek import make_tiny_deepseek
from tests.unit.worker.tp.test_tp_layers import _model_logits
from worker.model.parallel import TPContext

SIZE = 2
VARIANTS = ("ds_qlora", "ds_qproj")


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
    root = tmp_path_factory.mktemp("deepseek_tp")
    dirs = {v: str(make_tiny_deepseek(v, root / v)) for v in VARIANTS}
    out = root / "out"
    out.mkdir()
    mp.spawn(_rank_main, args=(str(root / "init"), dirs, str(out)), nprocs=SIZE, join=True)
    return dirs, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(SIZE)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_single_device(tp_run: tuple[dict[str, str], list[dict]], variant: str) -> None:
    dirs, results = tp_run
    single, _ = _model_logits(dirs[variant], TPContext())
    for result in results:  # every rank gets the full logits
        for step, (got, want) in enumerate(zip(result[variant][0], single)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"{variant} step {step}")
            assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_rank_reads_its_share(tp_run: tuple[dict[str, str], list[dict]], variant: str) -> None:
    """Heads, experts, MLPs and the vocab are split; the latent path (q_a / kv_a and their
    norms), the gates and the norms are read whole by every rank."""
    dirs, results = tp_run
    _, single = _model_logits(dirs[variant], TPContext())
    per_rank = [r[variant][1] for r in results]
    assert all(s["num_tensors"] == single["num_tensors"] for s in per_rank)
    assert all(s["num_bytes"] < 0.65 * single["num_bytes"] for s in per_rank), (per_rank, single)
