"""Tensor-parallel layers (worker/model/parallel.py) over 2 real processes (spawned, gloo,
no Ray) compute what the single-device layers compute: layer by layer, and the whole
model's logits over two steps (prefill, chunked prefill, decode through the paged KV
cache) for kv heads split (Hkv=2) and replicated (Hkv=1), tied and untied heads, qkv bias
and qk-norm. Each rank reads only its shard of the checkpoint.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from tests.support.tiny_models import make_tiny_model
from worker.runner.inputs import host_batch
from worker.model.parallel import (
    ColumnParallelLinear, RowParallelLinear, TPContext, VocabParallelEmbedding, kv_head_range,
    parallel_logits, validate_tp,
)

SIZE = 2
MODELS = ("llama", "qwen2", "qwen3", "llama_kv1")


def _make_kv1_model(out: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=301, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return out


def _two_steps() -> list[tuple[list[list[int]], list[int], list[int], list[list[int]]]]:
    """(token ids per seq, num_computed, num_new, block ids) for two steps, block_size 16."""
    a = [(7 * i + 3) % 250 + 3 for i in range(40)]
    b = [(5 * i + 1) % 250 + 3 for i in range(9)]
    step1 = ([a, b], [0, 0], [24, 9], [[0, 1], [2]])  # a: first chunk of its prompt
    step2 = ([a, b + [17]], [24, 9], [16, 1], [[0, 1, 3], [2]])  # a: rest; b: decode
    return [step1, step2]


def _model_logits(
    model_dir: str, tp: TPContext, lora_adapter: str | None = None
) -> tuple[list[torch.Tensor], dict[str, int]]:
    """The model's logits over `_two_steps`; with `lora_adapter`, every row runs under that
    PEFT adapter (slot 0)."""
    from worker.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig
    from worker.model_config import load_hf_config
    from worker.runner.model_runner import ModelRunner
    from worker.scheduling.scheduler import SchedulerOutput
    from worker.tp.plan_codec import MirrorSeq

    config = EngineConfig(
        ModelConfig(model=model_dir, device="cpu", dtype="float32", attention_backend="torch"),
        CacheConfig(block_size=16, num_blocks_override=32),
        lora=LoRAConfig(enable=bool(lora_adapter), max_loras=1, max_lora_rank=8),
    )
    runner = ModelRunner(config, load_hf_config(Path(model_dir)), 256, tp)
    if lora_adapter:
        assert runner.lora is not None
        runner.lora.write_slot(0, runner.lora_loader("a", lora_adapter))
    outs = []
    groups = runner.kv_layout.num_groups
    for token_ids, computed, num_new, block_ids in _two_steps():
        if groups > 1:  # one table per KV group (kv/kv_groups.py), each of its own blocks
            block_ids = [[[b + 4 * g for b in t] for g in range(groups)] for t in block_ids]
        seqs = [MirrorSeq(list(t), list(b), c) for t, b, c in zip(token_ids, block_ids, computed)]
        plan = SchedulerOutput(seqs=seqs, num_new_tokens=num_new, block_ids=block_ids)  # type: ignore[arg-type]
        order = list(range(len(seqs)))
        order.sort(key=lambda i: num_new[i] != 1)
        batch = host_batch(plan, order, runner.block_size, runner._num_groups)
        if runner.lora is not None:
            runner.lora.prepare([0] * len(order), batch.lens, runner.device, runner.dtype)
        with torch.inference_mode():
            outs.append(runner.model.compute_logits(runner._forward(batch)[0]))
    stats = runner.model.load_stats
    return outs, {"num_tensors": stats.num_tensors, "num_bytes": stats.num_bytes}


def _layer_outputs(tp: TPContext) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 12, generator=g)
    w = torch.randn(10, 12, generator=g)
    col = ColumnParallelLinear(12, [(tp.rank * 5, tp.rank * 5 + 5)], bias=False, tp=tp)
    col.weight.data.copy_(w[tp.rank * 5 : tp.rank * 5 + 5])
    row = RowParallelLinear(10, 7, tp)
    wr = torch.randn(7, 10, generator=g)
    lo, hi = row.col_range
    row.weight.data.copy_(wr[:, lo:hi])
    vocab = 11  # not divisible by 2: the last shard is padded
    we = torch.randn(vocab, 12, generator=g)
    emb = VocabParallelEmbedding(vocab, 12, tp)
    elo, ehi = emb.row_range
    emb.weight.data.zero_()
    emb.weight.data[: ehi - elo].copy_(we[elo:ehi])
    ids = torch.tensor([0, 5, 6, 10, 3])
    col_out = col(x)
    return {
        "col": col_out,
        "row": row((x @ w.T)[:, lo:hi]),
        "emb": emb(ids),
        "logits": parallel_logits(x, emb.weight, vocab, tp),
        "ref_col": F.linear(x, w)[:, tp.rank * 5 : tp.rank * 5 + 5],
        "ref_row": F.linear(x @ w.T, wr),
        "ref_emb": F.embedding(ids, we),
        "ref_logits": F.linear(x, we),
    }


def _rank_main(rank: int, init_file: str, model_dirs: dict[str, str], out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=SIZE)
    tp = TPContext(rank, SIZE, dist.group.WORLD)
    result: dict[str, object] = {"layers": _layer_outputs(tp)}
    for name, path in model_dirs.items():
        result[name] = _model_logits(path, tp)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], list[dict]]:
    root = tmp_path_factory.mktemp("tp")
    dirs = {f: str(make_tiny_model(f, root / f)) for f in ("llama", "qwen2", "qwen3")}
    dirs["llama_kv1"] = str(_make_kv1_model(root / "llama_kv1"))
    out = root / "out"
    out.mkdir()
    mp.spawn(_rank_main, args=(str(root / "init"), dirs, str(out)), nprocs=SIZE, join=True)
    return dirs, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(SIZE)]


def test_layers_match_single_device(tp_run: tuple[dict[str, str], list[dict]]) -> None:
    for result in tp_run[1]:
        layers = result["layers"]
        torch.testing.assert_close(layers["col"], layers["ref_col"])
        torch.testing.assert_close(layers["row"], layers["ref_row"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layers["emb"], layers["ref_emb"])
        torch.testing.assert_close(layers["logits"], layers["ref_logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", MODELS)
def test_model_logits_match_single_device(tp_run: tuple[dict[str, str], list[dict]], name: str) -> None:
    dirs, results = tp_run
    single, _ = _model_logits(dirs[name], TPContext())
    for result in results:  # every rank gets the full logits
        for step, (got, want) in enumerate(zip(result[name][0], single)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"{name} step {step}")
            assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_each_rank_reads_only_its_shard(tp_run: tuple[dict[str, str], list[dict]], name: str) -> None:
    """Every tensor is touched once per rank, but only its shard is materialised: the
    ranks together read the checkpoint once, plus the replicated norm weights."""
    dirs, results = tp_run
    _, single = _model_logits(dirs[name], TPContext())
    per_rank = [r[name][1] for r in results]
    assert all(s["num_tensors"] == single["num_tensors"] for s in per_rank)
    from safetensors import safe_open

    norm_bytes = 0
    with safe_open(os.path.join(dirs[name], "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            if key.endswith("norm.weight"):
                norm_bytes += f.get_tensor(key).numel() * 4
    assert sum(s["num_bytes"] for s in per_rank) == single["num_bytes"] + (SIZE - 1) * norm_bytes
    assert all(s["num_bytes"] < 0.6 * single["num_bytes"] for s in per_rank)


def test_heads_not_divisible_are_rejected() -> None:
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        validate_tp(4, 2, 3)
    with pytest.raises(ValueError, match="KV heads"):
        validate_tp(12, 3, 2)  # 2 does not divide 3, 3 does not divide 2
    validate_tp(8, 2, 4)
    validate_tp(8, 1, 4)  # replicated kv head
    validate_tp(8, 8, 4)


def test_model_rejects_bad_tp_size(tmp_path: Path) -> None:
    from worker.model.llama import LlamaArch, LlamaForCausalLM
    from worker.model_config import load_hf_config

    path = make_tiny_model("llama", tmp_path / "m")
    hf_config = load_hf_config(path)
    with torch.device("meta"), pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide"):
        LlamaForCausalLM(LlamaArch.from_hf_config(hf_config), hf_config, None, 64, TPContext(0, 3))


def test_replicated_kv_heads_follow_their_q_heads() -> None:
    # Hq=8, Hkv=2, N=4: ranks 0,1 use kv head 0; ranks 2,3 use kv head 1.
    assert [kv_head_range(8, 2, TPContext(r, 4)) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_head_range(8, 4, TPContext(r, 2)) for r in range(2)] == [(0, 2), (2, 4)]
