"""What an engine reports of itself after every step: its KV cache, its queues and its
step counters (the router's, the autoscaler's and the metrics' source)."""
from __future__ import annotations

from dataclasses import dataclass

from kv.stats import KVStats


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

    def to_dict(self) -> dict[str, float]:
        d = {k: v for k, v in self.__dict__.items() if k != "kv"}
        d.update(self.kv.to_dict())
        return d
