"""Tensor parallelism 2 end to end on the MoE families (Ray actors, gloo): the engine whose
runner leads the TP group (tp/runner.py, the model from the registry) gives transformers'
greedy tokens on gpt-oss and Qwen3-MoE for a mixed batch with chunked prefill, prefix hits
and preemption, every rank reading about half of the checkpoint."""
from __future__ import annotations

from pathlib import Path

import pytest
import ray

from tests.integration.test_tensor_parallel import TPEngineHost, _config, _workload
from tests.support.tiny_moe import make_tiny_moe

pytestmark = pytest.mark.integration


def _greedy_ignoring_eos(model_dir: Path, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """transformers' argmax token after token, EOS included (the workload ignores EOS)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for prompt, n in zip(prompts, max_tokens, strict=True):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        outs.append(ids[len(prompt):])
    return outs


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_tp2_moe_matches_transformers(serve_cluster: object, family: str, tmp_path: Path) -> None:
    model_dir = make_tiny_moe(family, tmp_path / family)
    prompts, max_tokens = _workload()
    expected = {str(i): out for i, out in enumerate(_greedy_ignoring_eos(model_dir, prompts, max_tokens))}
    host = TPEngineHost.remote(_config(model_dir, 2))
    try:
        outputs, stats = ray.get(host.run_workload.remote(), timeout=600)
        assert outputs == expected
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
        single_bytes = sum(Path(f).stat().st_size for f in model_dir.glob("*.safetensors"))
        for rank_stats in ray.get(host.load_stats.remote()):
            assert rank_stats["num_bytes"] < 0.6 * single_bytes
    finally:
        ray.get(host.shutdown.remote(), timeout=60)
        ray.kill(host)
