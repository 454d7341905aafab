"""The runner's own greedy path (worker/runner/lm_head.py): an all-greedy step's ids are
the argmax of its logits over the real vocabulary, taken at launch with no sampler; a step
with a sampled row goes through the sampler; both give the sampler's ids."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.support.tiny_models import make_tiny_model
from worker.api import SamplingParams
from worker.config import CacheConfig, EngineConfig, ModelConfig
from worker.model_config import load_hf_config
from worker.runner.lm_head import greedy_ids, head_logits
from worker.runner.model_runner import ModelRunner
from worker.scheduling.plan import SchedulerOutput
from worker.sequence import Sequence


def test_greedy_ids_never_pick_a_padded_column() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0], [3.0, 0.0, 1.0, 9.0]])  # column 3: head padding
    assert greedy_ids(logits, vocab_size=3).tolist() == [2, 0]


def test_head_logits_in_the_model_dtype_only_where_asked() -> None:
    calls: list[bool] = []

    def compute(hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        calls.append(fp32)
        return hidden

    h = torch.zeros(1, 2)
    head_logits(compute, h, in_model_dtype=True)
    head_logits(compute, h, in_model_dtype=False)
    assert calls == [False, True]


def _runner(tmp_path: Path) -> ModelRunner:
    model_dir = make_tiny_model("llama", tmp_path / "m")
    config = EngineConfig(ModelConfig(model=str(model_dir), device="cpu", dtype="float32", attention_backend="torch"),
                          CacheConfig(block_size=16, num_blocks_override=16))
    return ModelRunner(config, load_hf_config(model_dir), 128)


def _plan(params: list[SamplingParams]) -> SchedulerOutput:
    seqs = [Sequence(f"r{i}", [(5 * i + j) % 200 + 3 for j in range(7)], p) for i, p in enumerate(params)]
    return SchedulerOutput(seqs=seqs, num_new_tokens=[7] * len(seqs), block_ids=[[i] for i in range(len(seqs))])


def test_an_all_greedy_step_samples_at_launch_with_the_samplers_ids(tmp_path: Path) -> None:
    runner = _runner(tmp_path)
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    launched = runner.launch(_plan([greedy, greedy]))
    assert launched.sampled is not None  # taken by the runner, not queued for the sampler
    assert runner.sampler is not None and launched.logits is not None
    expected = runner.sampler(launched.logits, [launched.plan.seqs[i] for i in launched.sample_rows]).token_ids
    assert runner.wait(launched).token_ids == expected


def test_a_step_with_a_sampled_row_goes_through_the_sampler(tmp_path: Path) -> None:
    runner = _runner(tmp_path)
    plan = _plan([SamplingParams(temperature=0.0, max_tokens=4), SamplingParams(temperature=1.0, seed=3, max_tokens=4)])
    launched = runner.launch(plan)
    assert launched.sampled is None
    out = runner.wait(launched)
    assert all(isinstance(t, int) for t in out.token_ids)
    assert out.token_ids[0] == int(launched.logits[0].argmax())  # type: ignore[index]
