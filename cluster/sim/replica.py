"""A simulated replica: the REAL engine (worker.engine.core.Engine: scheduler, KV cache manager,
prefix cache, chunked prefill, preemption, KV export/import) stepped on the virtual clock.

The engine runs its own step loop logic unchanged; only time is virtual. One engine step
that starts at virtual time t with plan P ends at t + cost(P), where cost is the step-cost
model of worker/sim (through `step_time_s`); its outputs (sampled tokens) are delivered
at that end time, and the next step starts right then. Requests that arrive while a step
is "running" join the engine's queues at once, exactly as they would join the real
engine's inbox, and are scheduled by the next step.

    step event at t:   outputs = engine.step()  ->  dt = cost(plan)  ->  done event at t + dt
    done event:        deliver outputs (timestamped t + dt), then the next step event

With KV tiers (cluster/sim/tiers.py), a step also carries the device -> host copies its
plan made (dt grows by them), and a request loading from a tier wakes the replica when its
copies end, so an otherwise idle replica steps it then.

KV events: the engine records them (Engine.enable_kv_events: the block pool's and the
tiers' hooks), and the replica numbers each step's as one batch right after the step,
as the worker's step loop does (worker/kvcache/event_stream.py's KVEventStream); each report
carries the stream's window and a snapshot taken as it is built, and routers keep their
exact index from them (cluster/sim/run.py).

The engine itself stamps `first_token_time` etc. with the wall clock; the simulator
ignores those stamps and takes every time from the virtual clock.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from cluster.sim.clock import EventQueue
from cluster.sim.lora import sim_lora_path
from cluster.sim.tiers import SimTierManager
from kv.kv_cache import KVCacheSpec
from kv.transfer import KVExport
from router.routing.types import RoutingParams, RequestProfile
from worker.engine.async_engine import MAX_PREFIX_HASHES
from worker.engine.core import Engine
from worker.kvcache.event_stream import KVEventStream
from worker.serving.routing_report import build_routing_stats
from worker.costs.cost_model import StepCostModel
from worker.api import RequestError
from worker.api import RequestOutput
from worker.api import SamplingParams
from worker.scheduling.scheduler import SchedulerOutput

OutputSink = Callable[["SimReplica", RequestOutput, float], None]
# The device a capacity weight of 1 means: the router's default prefill rate's.
_REFERENCE_PREFILL_TOKENS_PER_S = RoutingParams().prefill_tokens_per_s


class VirtualDevice:
    """The engine's runner, as the simulator hands it over: the simulated-device runner
    (worker/sim/runner.py SimRunner with sleep=False: tokens, and the modelled duration of
    the step it just executed in `last_step_s`), plus KV export/import as bookkeeping only
    (the KV cache manager still allocates, pins and registers every block; no tensor holds
    KV, so an export's tensor is a 1-layer 1-head int8 stand-in whose SHAPE follows the
    real layout rules; the transfer time comes from the model shape, not from it)."""

    def __init__(self, runner: Any, block_size: int) -> None:
        self.runner = runner
        self.num_blocks: int = runner.num_blocks
        # The model's KV groups (kv/kv_groups.py): the engine's KV manager releases
        # sliding-window blocks as on a real device, and the routing report says so.
        self.kv_layout = getattr(runner, "kv_layout", None)
        self.kv_bytes_per_block: int = getattr(runner, "kv_bytes_per_block", 0)
        # A LoRA adapter's host-to-device copy (cluster/sim/lora.py): the step that admits a
        # sequence whose adapter is not in its slot yet first writes the slot, as the real
        # runner does, so each slot load adds this to that step.
        self.lora_swap_s = 0.0
        self.last_step_s = 0.0
        self.num_executed = 0
        self.kv_spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=1, block_size=block_size, dtype=torch.int8)

    def execute(self, plan: SchedulerOutput) -> Any:
        result = self.runner.execute(plan)
        self.last_step_s = self.runner.last_step_s + len(plan.lora_loads) * self.lora_swap_s
        self.num_executed += 1
        return result

    @property
    def step_predictor(self) -> StepCostModel:
        """The runner's exact step-time prediction (the engine's step-time budget)."""
        return self.runner.step_predictor

    def export_kv(self, block_ids: list[int]) -> torch.Tensor:
        return torch.zeros((1, 2, len(block_ids) * self.kv_spec.block_size, 1, 1), dtype=torch.int8)

    def import_kv(self, block_ids: list[int], kv: torch.Tensor) -> None:
        return None


@dataclass
class ReplicaTimeline:
    """Samples taken at every stats report: (time, ongoing, waiting, running, kv usage)."""

    times: list[float] = field(default_factory=list)
    num_ongoing: list[int] = field(default_factory=list)  # at the replica: waiting + running + KV in transit
    num_waiting: list[int] = field(default_factory=list)
    num_running: list[int] = field(default_factory=list)
    kv_usage: list[float] = field(default_factory=list)


class SimReplica:
    def __init__(self, key: int, role: str, engine: Engine, device: VirtualDevice, clock: EventQueue,
                 sink: OutputSink) -> None:
        self.key = key
        self.role = role  # "mixed" | "prefill" | "decode"
        self.engine = engine
        self.device = device
        self.clock = clock
        self.sink = sink
        self.num_ongoing = 0  # requests sent here and not finished (Serve's max_ongoing_requests counts these)
        self.busy_s = 0.0  # virtual time spent executing steps
        self.num_steps = 0
        self.draining = False  # scale-down: takes no new requests, finishes what it has
        self.created_at = clock.now  # a starting replica holds its device from here
        self.ready_at: float | None = None  # None: never became ready (cancelled while starting)
        self.removed_at: float | None = None
        self.timeline = ReplicaTimeline()
        self._stepping = False  # a step event or a step in flight is scheduled
        self._prefill_tokens_per_s: float | None = None  # modelled once, on the first report
        self.max_report_hashes = MAX_PREFIX_HASHES  # per tier, as the worker's snapshot caps them
        self.kv_events = KVEventStream(engine.enable_kv_events(), clock=lambda: clock.now)
        if engine.kv.retention is not None:  # sessions' TTLs run on the virtual clock
            engine.kv.retention.clock = lambda: clock.now

    # -- requests ----------------------------------------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               export_kv: bool = False, kv_import: KVExport | None = None,
               profile: RequestProfile | None = None, lora_name: str | None = None,
               session_id: str | None = None) -> str | None:
        """Hand a request to the engine now. Returns None, or the engine's RequestError
        message when it refuses the request (then it is not counted as ongoing).
        `profile`: the router's profile of the prompt; its block hashes (memoised there,
        computed there if no router needed them) are handed to the engine, which would
        otherwise hash the same prompt again (a real replica does: another process).
        `lora_name`: the request's adapter (cluster/sim/lora.py), learnt on first use as a
        real replica learns it from the request. `session_id`: the client's session (its
        finished turn's KV is retained for the next: kv/retention.py)."""
        hashes = profile.block_hashes(self.engine.kv.block_size) if profile is not None else None
        lora = {"lora_name": lora_name, "lora_path": sim_lora_path(lora_name)} if lora_name is not None else {}
        try:
            self.engine.add_request(request_id, prompt_token_ids, params, arrival_time=self.clock.now,
                                    export_kv=export_kv, kv_import=kv_import, prompt_block_hashes=hashes,
                                    session_id=session_id, **lora)
        except RequestError as e:
            return str(e)
        self.num_ongoing += 1
        self.wake()
        return None

    def release_kv(self, request_id: str) -> None:
        """The decode side has the exported KV: unpin it (blocks may free: try to step)."""
        if self.engine.release_kv(request_id):
            self.wake()

    def wake(self) -> None:
        if not self._stepping:
            self._stepping = True
            self.clock.at(self.clock.now, self._step)

    # -- the step loop on the virtual clock ----------------------------------------------------
    def _step(self) -> None:
        if self._only_loading():
            self._stepping = False  # the adapter load's completion wakes the replica
            return
        executed = self.device.num_executed
        outputs = self.engine.step()
        self.kv_events.drain()
        tiers = self.tiers
        copy_s = tiers.take_copy_s() if tiers is not None else 0.0
        if self.device.num_executed == executed:  # nothing to run (idle, blocked on pinned blocks, or loading)
            self._stepping = False
            self._deliver(outputs)
            if tiers is not None and tiers.has_pending:
                self.clock.at(max(tiers.next_load_done_s, self.clock.now + copy_s), self.wake)  # type: ignore[type-var]
            return
        dt = self.device.last_step_s + copy_s
        self.busy_s += dt
        self.num_steps += 1
        self.clock.at(self.clock.now + dt, self._step_done, outputs)

    def _only_loading(self) -> bool:
        """Nothing to step but adapter loads still on the virtual clock: the engine would wait
        for them on the wall clock (Engine.wait_for_compiles), which here can only stall."""
        lora = self.engine.lora
        return (lora is not None and lora.num_loading > 0 and not self.engine.scheduler.has_unfinished()
                and not any(f.done() for f in lora.futures()))

    def _step_done(self, outputs: list[RequestOutput]) -> None:
        self._deliver(outputs)
        self._step()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = self.clock.now
        for out in outputs:
            if out.finished:
                self.num_ongoing -= 1
            self.sink(self, out, now)

    @property
    def tiers(self) -> SimTierManager | None:
        return self.engine.tiers  # type: ignore[return-value]

    # -- what the replica reports (worker/serving/replica.py's records, same keys) ---------------------
    def routing_stats(self) -> dict[str, Any]:
        """WorkerReplica.record_routing_stats (the same builder), on the virtual clock. The
        prefill rate is the engine's measured one, as a real worker's; the capacity weight
        stays the cost model's (the device's pure-prefill rate relative to the router's
        reference device: mixed fleets). The KV events' snapshot (what a router rebuilds
        from) is taken as the report is built."""
        self.take_kv_snapshot()
        return build_routing_stats(
            self.engine, self.engine.stats(), [], self.clock.now,
            capacity_weight=self.modelled_prefill_tokens_per_s / _REFERENCE_PREFILL_TOKENS_PER_S,
            kv_events=self.kv_events.report(),
        ).to_dict()

    def take_kv_snapshot(self) -> None:
        """The cached hashes per tier, capped at `max_report_hashes` each, exact as of the
        stream's latest batch (drained first: nothing runs between the two)."""
        self.kv_events.drain()
        tiers, limit = self.tiers, self.max_report_hashes
        host, disk = tiers.routing_hashes(limit) if tiers is not None else ([], [])
        self.kv_events.take_snapshot(self.engine.kv.cached_block_hashes(limit), host, disk)

    @property
    def modelled_prefill_tokens_per_s(self) -> float:
        """The cost model's rate for a full chunk of a fresh prompt per step (modelled once)."""
        if self._prefill_tokens_per_s is None:
            from worker.costs.cost_model import SeqWork

            chunk = self.engine.scheduler.config.max_num_batched_tokens
            step_s = self.device.runner.cost.step_time_s([SeqWork(num_new_tokens=chunk, context_len=0)])
            self._prefill_tokens_per_s = chunk / step_s
        return self._prefill_tokens_per_s

    def sample_timeline(self) -> None:
        kv = self.engine.kv
        tl = self.timeline
        tl.times.append(self.clock.now)
        tl.num_ongoing.append(self.num_ongoing)
        tl.num_waiting.append(self.engine.scheduler.num_waiting)  # waiting KV imports included
        tl.num_running.append(self.engine.scheduler.num_running)
        tl.kv_usage.append(1.0 - kv.num_free_blocks / kv.num_total_blocks)

    @property
    def accepting(self) -> bool:
        return not self.draining and self.removed_at is None
