"""The real worker replica over the real engine core, with a model-free runner.

`FakeEngineWorker` is worker/serving/replica.py's `WorkerReplica` unchanged (generate, the stats Serve
reads for routing and autoscaling, the drain on removal) over the real `Engine` and
`AsyncEngine` (scheduler, KV block pool, waiting queue, step thread). Only the model runner
is fake (tests/support/fake_runner.py): every step takes `step_s` and samples token `TOKEN` for each
row that reaches its end, so a request with `max_tokens` k and no EOS runs exactly k decode steps. With a small
`max_num_seqs` the waiting queue grows under load exactly as a real engine's does.

No Ray at import: unit tests build one directly (`make_fake_engine`, `FakeEngineWorker`);
integration tests wrap `FakeEngineWorker` with `serve.deployment`. Each streamed output
carries `extra["replica_id"]`, so a test knows which replica served a request.
"""
from __future__ import annotations

from tests.support.fake_runner import TOKEN, VOCAB, FakeRunner
from worker.engine.async_engine import AsyncEngine
from worker.config import CacheConfig, SchedulerConfig
from worker.engine.core import Engine
from worker.api import RequestOutput
from worker.serving.replica import WorkerReplica

__all__ = ["TOKEN", "FakeEngineWorker", "make_fake_engine"]  # TOKEN: every sampled token (no EOS ids here)


def make_fake_engine(
    max_num_seqs: int = 2,
    step_s: float = 0.02,
    num_blocks: int = 256,
    block_size: int = 16,
    max_model_len: int = 1024,
) -> AsyncEngine:
    scheduler = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_model_len,
                                max_model_len=max_model_len)
    cache = CacheConfig(block_size=block_size, num_blocks_override=num_blocks)
    engine = Engine(scheduler, cache, FakeRunner(num_blocks, TOKEN, vocab_size=VOCAB, step_s=step_s), VOCAB)
    return AsyncEngine(engine, tokenizer=None)  # no tokenizer: outputs carry token ids only


class FakeEngineWorker(WorkerReplica):
    def __init__(self, max_num_seqs: int = 2, step_s: float = 0.02, num_blocks: int = 256,
                 block_size: int = 16, drain_timeout_s: float = 60.0) -> None:
        engine = make_fake_engine(max_num_seqs=max_num_seqs, step_s=step_s, num_blocks=num_blocks,
                                  block_size=block_size)
        self._attach(engine, block_size, drain_timeout_s)

    def _output(self, out: RequestOutput) -> RequestOutput:
        # Every output this replica sends (per call and batched) names its replica.
        out.extra["replica_id"] = self.replica_id
        return out
