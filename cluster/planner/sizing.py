"""How many replicas a pool needs for a load within its SLO, priced by the step-cost model
(worker/costs/cost_model.py: the simulator's device and the engine's step-time budget use
the same one). Targets are scaled by `headroom` first (targets.py).

  decode   every running sequence gains one token per step, so a replica running a batch
           of B decodes at the mean context (prompt + output / 2) emits B / t(B) tokens/s,
           t(B) the modelled step time. B* is the largest batch with t(B) within the ITL
           target, max_num_seqs and the KV cache (B sequences of prompt + output tokens):
               replicas = ceil(rate x output tokens / (B* / t(B*)))
  prefill  a prompt of P tokens takes ceil(P / chunk) steps of at most max_num_batched_tokens
           tokens each: service time s = the sum of their step times. The pool is an M/M/c
           queue (queueing.py): the fewest replicas whose TTFT percentile wait + s fits the
           TTFT target
               replicas = servers_for_wait(rate, s, ttft_percentile, ttft - s)
  mixed    one replica does both: at x requests/s, a step of t seconds carries B = x out t
           decodes and c = x P t prompt tokens, t = cost(B decodes, a chunk of c); x* is the
           largest rate whose fixed point t keeps within the ITL target (bisection); the
           prompts queue as in a prefill pool, on the chunk room the decodes leave
               replicas = max(ceil(rate / x*), servers_for_wait(rate, s_mixed, ...))

Work already queued (`backlog` requests) is drained within `drain_s` (the planner passes
the start-up horizon: no replica started now helps sooner): it adds backlog / drain_s to
the rate a prefill or mixed pool is sized for. Decodes already running (`running`) need
ceil(running / B*) decode replicas whatever the forecast says (a burst's answers outlive it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.planner.forecast import Load
from cluster.planner.queueing import servers_for_wait
from cluster.planner.targets import PlannerSettings, SLOTargets
from worker.costs.cost_model import StepCostModel

ROLES = ("mixed", "prefill", "decode")


@dataclass(frozen=True)
class EngineLimits:
    """What one replica's engine holds (worker/config.py's SchedulerConfig and its KV pool)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    kv_tokens: int  # KV blocks x block size
    kv_usage_ceiling: float = 0.9

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.kv_tokens < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and kv_tokens must be >= 1")


class PoolSizer:
    def __init__(self, cost: StepCostModel, limits: EngineLimits, targets: SLOTargets,
                 settings: PlannerSettings = PlannerSettings()) -> None:
        self.cost = cost
        self.limits = limits
        self.targets = targets
        self.itl_budget_s = targets.itl_s * settings.headroom
        self.ttft_budget_s = targets.ttft_s * settings.headroom

    # -- decode ----------------------------------------------------------------------------
    def decode_step_s(self, batch: int, context: int) -> float:
        return self.cost.predict_rows([(1, context, True)] * batch) if batch > 0 else 0.0

    def decode_batch(self, load: Load) -> int:
        """B*: the largest decode batch within the ITL target, max_num_seqs and the KV cache (>= 1)."""
        context = int(load.prompt_tokens + load.output_tokens / 2)
        held = max(load.prompt_tokens + load.output_tokens, 1.0)
        high = min(self.limits.max_num_seqs, max(1, int(self.limits.kv_tokens * self.limits.kv_usage_ceiling / held)))
        low = 1
        while low < high:  # the step time grows with the batch: the last batch within budget
            mid = (low + high + 1) // 2
            if self.decode_step_s(mid, context) <= self.itl_budget_s + 1e-12:
                low = mid
            else:
                high = mid - 1
        return low

    def decode_replicas(self, load: Load, running: float = 0.0) -> int:
        if load.rate <= 0 and running <= 0:
            return 0
        batch = self.decode_batch(load)
        tokens_per_s = batch / self.decode_step_s(batch, int(load.prompt_tokens + load.output_tokens / 2))
        by_rate = math.ceil(load.rate * load.output_tokens / tokens_per_s - 1e-9)
        return max(1, by_rate, math.ceil(running / batch - 1e-9))

    # -- prefill ---------------------------------------------------------------------------
    def prefill_service_s(self, prompt_tokens: float, chunk: int | None = None) -> float:
        """A prompt's steps, one chunk each, back to back."""
        chunk = chunk or self.limits.max_num_batched_tokens
        total, done, rows = int(math.ceil(prompt_tokens)), 0, []
        while done < total:
            n = min(chunk, total - done)
            rows.append(self.cost.predict_rows([(n, done, done + n >= total)]))
            done += n
        return sum(rows)

    def prefill_replicas(self, load: Load, backlog: float = 0.0, drain_s: float | None = None) -> int:
        rate = load.rate + max(backlog, 0.0) / max(drain_s or 0.0, self.ttft_budget_s)
        if rate <= 0:
            return 0
        service = self.prefill_service_s(load.prompt_tokens)
        return servers_for_wait(rate, service, self.targets.ttft_percentile, max(self.ttft_budget_s - service, 0.0))

    # -- mixed -----------------------------------------------------------------------------
    def mixed_step_s(self, rate: float, load: Load) -> tuple[float, int, int]:
        """The fixed point of one replica's step at `rate` requests/s: (t, decodes, chunk tokens)."""
        context = int(load.prompt_tokens + load.output_tokens / 2)
        t = self.itl_budget_s
        batch = chunk = 0
        for _ in range(8):
            batch = max(1, round(rate * load.output_tokens * t))
            chunk = max(1, round(rate * load.prompt_tokens * t))
            rows = [(1, context, True)] * batch + [(chunk, int(load.prompt_tokens / 2), False)]
            t = self.cost.predict_rows(rows)
        return t, batch, chunk

    def mixed_rate(self, load: Load) -> float:
        """x*: the most requests/s one mixed replica serves within the ITL target and its limits."""
        held = max(load.prompt_tokens + load.output_tokens, 1.0)

        def fits(rate: float) -> bool:
            t, batch, chunk = self.mixed_step_s(rate, load)
            return (t <= self.itl_budget_s + 1e-12 and batch <= self.limits.max_num_seqs
                    and batch + chunk <= self.limits.max_num_batched_tokens
                    and batch * held <= self.limits.kv_tokens * self.limits.kv_usage_ceiling)

        low, high = 0.0, 1.0
        while fits(high) and high < 1e4:
            low, high = high, high * 2
        for _ in range(30):
            mid = (low + high) / 2
            low, high = (mid, high) if fits(mid) else (low, mid)
        return low

    def mixed_replicas(self, load: Load, backlog: float = 0.0, drain_s: float | None = None) -> int:
        rate = load.rate + max(backlog, 0.0) / max(drain_s or 0.0, self.ttft_budget_s)
        if rate <= 0:
            return 0
        per_replica = self.mixed_rate(load)
        by_itl = math.ceil(rate / per_replica - 1e-9) if per_replica > 0 else self.limits.max_num_seqs
        t, batch, _ = self.mixed_step_s(per_replica, load)
        room = max(1, self.limits.max_num_batched_tokens - batch)  # chunk tokens the decodes leave a step
        service = math.ceil(load.prompt_tokens / room) * t
        by_ttft = servers_for_wait(rate, service, self.targets.ttft_percentile, max(self.ttft_budget_s - service, 0.0))
        return max(1, by_itl, by_ttft)

    def replicas(self, role: str, load: Load, backlog: float = 0.0, running: float = 0.0,
                 drain_s: float | None = None) -> int:
        """A pool's replicas for `load`, plus its `backlog` drained within `drain_s` (a
        decode pool: its waiting imports count as running) and its `running` decodes."""
        if role == "prefill":
            return self.prefill_replicas(load, backlog, drain_s)
        if role == "decode":
            return self.decode_replicas(load, running + backlog)
        if role == "mixed":
            return max(self.mixed_replicas(load, backlog, drain_s), self.decode_replicas(load.scaled(0.0), running))
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
