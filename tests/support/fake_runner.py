"""The one model-free runner of the tests (torch-free): the real Engine, Scheduler and
block pool run over it; only the model is missing.

`FakeRunner.execute` samples, for every sequence that reaches the end of its tokens this
step, `sample(seq)`: a fixed token (`token`), or with `token=None` a seeded random one
(EOS with probability `eos_prob`). Optional: `step_s` of modelled device time per step
(a simulated device, not synchronisation) and `check_plans(config, block_size)`, which
asserts the scheduler's invariants on every plan it is given. Subclasses change what is
sampled (`sample`) or what a step writes (tests/unit/kv/test_kv_transfer.py writes KV).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

from kv.cache_manager import cdiv
from worker.config import SchedulerConfig
from worker.scheduling.scheduler import SchedulerOutput
from worker.sequence import Sequence, SequenceStatus

TOKEN = 7  # the default sampled token: never an EOS of the fake engines
EOS = 2
VOCAB = 64


@dataclass
class FakeRunnerOutput:
    """Shaped like worker.runner.model_runner.RunnerOutput (which imports torch)."""

    token_ids: list[int | None]
    logprobs: list[None]
    forward_s: float = 0.0


class FakeRunner:
    def __init__(
        self,
        num_blocks: int,
        token: int | None = TOKEN,
        *,
        seed: int = 0,
        eos_prob: float = 0.0,
        vocab_size: int = VOCAB,
        step_s: float = 0.0,
    ) -> None:
        self.num_blocks = num_blocks
        self.token = token
        self.rng = random.Random(seed)
        self.eos_prob = eos_prob
        self.vocab_size = vocab_size
        self.step_s = step_s
        self.num_calls = 0
        self._limits: tuple[SchedulerConfig, int] | None = None

    def check_plans(self, config: SchedulerConfig, block_size: int) -> None:
        """From now on, assert every plan respects these limits and the block layout."""
        self._limits = (config, block_size)

    def execute(self, plan: SchedulerOutput) -> FakeRunnerOutput:
        self.num_calls += 1
        if self._limits is not None:
            check_plan(plan, self.num_blocks, *self._limits)
        if self.step_s:
            time.sleep(self.step_s)  # the modelled device time of one step
        token_ids = [self.sample(seq) if plan.samples(i) else None for i, seq in enumerate(plan.seqs)]
        return FakeRunnerOutput(token_ids, [None] * len(token_ids), self.step_s)

    def sample(self, seq: Sequence) -> int:
        if self.token is not None:
            return self.token
        if self.rng.random() < self.eos_prob:
            return EOS
        return self.rng.randrange(3, self.vocab_size)


def check_plan(plan: SchedulerOutput, num_blocks: int, config: SchedulerConfig, block_size: int) -> None:
    assert 0 < len(plan.seqs) <= config.max_num_seqs
    assert plan.num_batched_tokens <= config.max_num_batched_tokens
    assert len({s.request_id for s in plan.seqs}) == len(plan.seqs)
    for seq, num_new, block_ids in zip(plan.seqs, plan.num_new_tokens, plan.block_ids):
        assert seq.status is SequenceStatus.RUNNING
        assert 1 <= num_new <= seq.num_uncomputed_tokens
        assert len(block_ids) == cdiv(seq.num_computed_tokens + num_new, block_size)
        assert all(0 <= b < num_blocks for b in block_ids)
    assert not set(map(id, plan.preempted)) & set(map(id, plan.seqs))
