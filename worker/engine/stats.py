"""What an engine reports of itself after every step: its KV cache, its queues and its
step counters (the router's, the autoscaler's and the metrics' source)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kv.stats import KVStats
from worker.spec.stats import SpecCounters

if TYPE_CHECKING:
    from worker.scheduling.scheduler import Scheduler
    from worker.engine.step_meters import StepCounters


@dataclass(frozen=True)
class EngineStats:
    kv: KVStats
    num_running: int
    num_waiting: int
    num_waiting_prompt_tokens: int
    num_preemptions: int
    num_generated_tokens: int
    num_steps: int
    tokens_per_s: float  # generated tokens per second over the last few seconds
    forward_share: float  # share of step time spent in the model forward (cumulative)
    scheduler_share: float = 0.0  # share of step time in schedule + update (cumulative)
    num_arrived: int = 0  # requests handed to the engine since it started
    num_arrived_prompt_tokens: int = 0  # their prompt tokens
    # Speculative decoding (worker/spec/stats.py): drafts verified, those accepted, and the
    # decode rows that carried them (all 0 with speculation off).
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_verify_rows: int = 0

    def to_dict(self) -> dict[str, float]:
        d = {k: v for k, v in self.__dict__.items() if k != "kv"}
        d.update(self.kv.to_dict())
        return d


def engine_stats(kv: KVStats, scheduler: Scheduler, counters: StepCounters,
                 spec: SpecCounters | None = None) -> EngineStats:
    """The report of an engine whose KV cache (with its tiers) stands at `kv`."""
    spec = spec if spec is not None else SpecCounters()
    return EngineStats(
        kv=kv,
        num_running=scheduler.num_running,
        num_waiting=scheduler.num_waiting,
        # Uncached only (Scheduler.waiting_uncached_tokens): the router's prefill backlog.
        num_waiting_prompt_tokens=scheduler.waiting_uncached_tokens(),
        num_preemptions=scheduler.num_preemptions,
        num_generated_tokens=counters.num_generated_tokens,
        num_steps=counters.num_steps,
        tokens_per_s=counters.tokens_per_s,
        forward_share=counters.forward_share,
        scheduler_share=counters.scheduler_share,
        num_arrived=counters.num_arrived,
        num_arrived_prompt_tokens=counters.num_arrived_prompt_tokens,
        num_draft_tokens=spec.num_draft_tokens,
        num_accepted_draft_tokens=spec.num_accepted_tokens,
        num_verify_rows=spec.num_verify_rows,
    )
