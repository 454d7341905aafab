"""The simulated device's runner: the real engine drives it in place of the model runner.

It loads no weights and allocates no KV tensors (the block pool's bookkeeping is all a
simulated replica holds per block). Each step (`execute(plan)`, or `launch` then `wait`):
- prices the plan with the step-cost model (worker/costs/cost_model.py);
- samples, for each row that reaches the end of its tokens, a deterministic token: a
  hash of the sequence's WHOLE token history (and the request's seed, when it has one).
  A request migrated to another replica arrives as prompt + the tokens already streamed,
  hashes the same history there, and so continues token for token. EOS ids are never
  produced: a request runs to max_tokens (or a stop token / string the client set),
  which is what a simulation wants (lengths set by the workload);
- with `sleep=True` (a live cluster of simulated replicas) waits the modelled step time
  times `time_dilation` on the engine's step thread: the sleep stands for the device's
  work, it is not synchronisation. Two ways, as the engine drives it:
  `execute` (the serial Engine.step) takes the host work the engine did since the previous
  step (schedule, update, outputs: real Python time) off the modelled host overheads, up
  to their size, so that it is not counted twice; `launch` / `wait` (the async engine's
  overlapped loop, worker/scheduling/async_scheduler.py) run the whole modelled step on the clock from
  the launch while the host works beside it, as a GPU runs a launched step;
- with `sleep=False` (the discrete-event simulator) returns at once; the modelled time
  is in `last_step_s` (and RunnerOutput.forward_s) for a virtual clock to advance by.

An engine on a simulated device is built by worker/sim/build.py.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from worker.api import RunnerOutput
from worker.api import TokenLogprob
from worker.scheduling.scheduler import SchedulerOutput
from worker.sequence import Sequence, SequenceStatus
from worker.costs.cost_model import StepCostModel, StepFeatures
from worker.sim.lora import SimAdapter, SimLoRA
from worker.sim.spec import verify_rows

_MASK = (1 << 64) - 1
_BASE = 0x100000001B3  # odd: the polynomial hash below is a bijection per step
_BULK = 32  # from this many new tokens on, the history is folded in with numpy


def _mix64(x: int) -> int:
    """splitmix64's finaliser: every input bit flips about half of the output bits."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


class _Powers:
    """_BASE**k mod 2**64 for k < len, grown on demand (numpy uint64 arithmetic wraps)."""

    def __init__(self) -> None:
        self.table = np.ones(1, dtype=np.uint64)

    def upto(self, n: int) -> np.ndarray:
        if len(self.table) < n:
            size = max(n, 2 * len(self.table))
            factors = np.full(size, _BASE, dtype=np.uint64)
            factors[0] = 1
            with np.errstate(over="ignore"):
                self.table = np.cumprod(factors, dtype=np.uint64)
        return self.table[:n]


_POWERS = _Powers()


def history_hash(token_ids: list[int], start: int = 0, state: int = 0) -> int:
    """h(t_0..t_n-1) = sum (t_i + 1) * B**(n-1-i) mod 2**64, continued from the state of
    token_ids[:start]. Incremental and from-scratch give the same value (a migrated
    request hashes its whole history once; a running one adds one token per step)."""
    new = token_ids[start:]
    if len(new) < _BULK:
        for t in new:
            state = (state * _BASE + t + 1) & _MASK
        return state
    values = np.asarray(new, dtype=np.uint64) + np.uint64(1)
    powers = _POWERS.upto(len(new))[::-1]
    with np.errstate(over="ignore"):
        folded = int(np.dot(values, powers))  # wraps mod 2**64, as the loop does
    return (state * pow(_BASE, len(new), 1 << 64) + folded) & _MASK


@dataclass
class SimStep:
    """A launched step: its output, ready when the clock reaches `done_at` (perf_counter)."""

    output: RunnerOutput
    done_at: float
    # Launched ahead (worker/scheduling/async_scheduler.py): its rows' tokens are drawn at wait, once
    # the previous step's tokens are in token_ids.
    pending: SchedulerOutput | None = None


class SimRunner:
    """Satisfies the engine's Runner protocol (worker/runner/protocols.py): `num_blocks` and
    `execute(plan) -> RunnerOutput`; and, sleeping, OverlappingRunner's launch / wait
    (worker/scheduling/async_scheduler.py)."""

    def __init__(
        self,
        cost: StepCostModel,
        num_blocks: int,
        block_size: int,
        vocab_size: int,
        time_dilation: float = 1.0,
        sleep: bool = True,
        avoid_token_ids: frozenset[int] = frozenset(),
        lora: SimLoRA | None = None,
        spec_acceptance: float = 0.0,
    ) -> None:
        """`spec_acceptance`: with speculative decoding on the engine, the chance each draft
        is accepted (worker/sim/spec.py)."""
        if time_dilation <= 0:
            raise ValueError(f"time_dilation must be > 0, got {time_dilation}")
        if vocab_size <= len(avoid_token_ids):
            raise ValueError("the sampled vocabulary must hold a token that is not avoided")
        self.cost = cost
        self.num_blocks = num_blocks
        self.block_size = block_size
        # The model's KV groups: the engine's KV manager releases sliding-window blocks
        # as on a real device (kv/kv_groups.py), and the routing report says so.
        self.kv_layout = cost.shape.kv_layout()
        self.kv_bytes_per_block = cost.shape.kv_block_bytes(block_size)
        self.vocab_size = vocab_size  # tokens are drawn from [0, vocab_size)
        self.time_dilation = time_dilation
        self.sleep = sleep
        self.avoid_token_ids = avoid_token_ids
        self.last_step_s = 0.0  # modelled seconds of the latest step (not dilated)
        self.total_step_s = 0.0
        self.num_steps = 0
        self._last_return: float | None = None  # perf_counter when execute last returned
        self._busy_until = 0.0  # perf_counter when the last launched step is done
        self._last_had_prompt = False  # the latest step carried prompt rows (StepFeatures.follows_prompt)
        # Multi-LoRA (worker/sim/lora.py): the engine's registry reads adapters with
        # lora_loader and sets lora_adapters (name -> the host copy) to price slot writes.
        self.lora = lora
        self.lora_loader = lora.loader if lora is not None else None
        self.lora_adapters: Callable[[str], SimAdapter] | None = None
        if not 0.0 <= spec_acceptance <= 1.0:
            raise ValueError(f"spec_acceptance must be in [0, 1], got {spec_acceptance}")
        self.spec_acceptance = spec_acceptance

    @property
    def forward_time_dilation(self) -> float:
        """How much longer than the device's time each RunnerOutput.forward_s is: the
        dilation when this runner sleeps, 1 when it only models (forward_s = modelled)."""
        return self.time_dilation if self.sleep else 1.0

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """The serial device (Engine.step): returns once the step's time has passed, the
        engine's host work since the previous step counted against the modelled overheads."""
        start = time.perf_counter()
        verified = (verify_rows(plan, self.spec_acceptance, self.next_token, self._token_from_state)
                    if plan.draft_token_ids else None)
        token_ids, logprobs, features, modelled = self._model_step(plan)
        forward_s = modelled
        if self.sleep:
            forward_s = self._wait(start, modelled, self.cost.overhead_s(features))
        self._last_return = time.perf_counter()
        if verified is not None:
            for i, tokens in verified.items():
                token_ids[i] = tokens[0]
        return RunnerOutput(token_ids, logprobs, forward_s, verified)

    # -- the overlapping device (worker/scheduling/async_scheduler.py) ------------------------------------------
    @property
    def overlaps_device(self) -> bool:
        """A sleeping runner is a device beside the host: launch returns at once and the step
        runs on the clock meanwhile. Without sleep there is no wall time to overlap."""
        return self.sleep

    def launch(self, plan: SchedulerOutput) -> SimStep:
        """Start the step: the device is busy from now for the modelled time x dilation.

        The modelled time, overheads included, is the device's busy time here; the engine's
        host work is not taken off it (unlike `execute`), because it runs beside the step.
        So host work done while no step is in flight (the engine's update and schedule)
        adds to the wall time, and host work done while one is in flight (outputs, stats)
        adds nothing until it outgrows the step. The pricing and the token hashing below are
        the device's own work (sampling), inside its time."""
        start = time.perf_counter()
        token_ids, logprobs, _, modelled = self._model_step(plan)
        device_s = modelled * self.time_dilation if self.sleep else 0.0
        # A step launched ahead queues behind the one still on the device.
        done_at = max(start, self._busy_until) + device_s
        self._busy_until = done_at
        pending = plan if plan.pending_inputs else None
        return SimStep(RunnerOutput(token_ids, logprobs, device_s or modelled), done_at, pending)

    @property
    def launches_ahead(self) -> bool:
        """A pending input is only a token the device has not drawn yet: launch prices the
        step by its rows, and wait draws its tokens (worker/scheduling/async_scheduler.py)."""
        return self.sleep

    def wait(self, step: SimStep) -> RunnerOutput:
        """The step's output once its time has passed (at once if it already has: the host
        spent longer in between than the device needed)."""
        if self.sleep:
            remaining = step.done_at - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)  # the device's work, not synchronisation
        self._last_return = time.perf_counter()
        if step.pending is not None:
            self._draw_pending(step.pending, step.output)
        return step.output

    def _draw_pending(self, plan: SchedulerOutput, output: RunnerOutput) -> None:
        """The tokens of a step launched ahead, for the rows still running: token_ids now
        ends with the input the step took, so each is the token the serial step draws."""
        next_token, running = self.next_token, SequenceStatus.RUNNING
        token_ids, logprobs = output.token_ids, output.logprobs
        for i, seq in enumerate(plan.seqs):
            if seq.status is running:
                token_ids[i] = token = next_token(seq)
                if seq.params.logprobs is not None:
                    logprobs[i] = self._logprob(token, seq.params.logprobs)

    def _model_step(self, plan: SchedulerOutput) -> tuple[list[int | None], list[TokenLogprob | None], StepFeatures, float]:
        """The step's sampled tokens, logprobs, cost features and modelled seconds."""
        seqs = plan.seqs
        token_ids: list[int | None] = [None] * len(seqs)
        logprobs: list[TokenLogprob | None] = [None] * len(seqs)
        # One pass over the plan: the cost model's rows (new tokens, context, samples) and
        # the sampled tokens (the simulator's hot loop, once per token: no helper calls).
        rows = []
        next_token = self.next_token
        if plan.pending_inputs:  # every row samples; wait draws the tokens
            rows = [(1, seq.num_computed_tokens, True) for seq in seqs]
            seqs = []
        drafts = plan.draft_token_ids
        for i, (seq, n) in enumerate(zip(seqs, plan.num_new_tokens)):
            context = seq.num_computed_tokens
            if drafts and seq.request_id in drafts:  # a verify row: logits at each token; _verify drew them
                rows.append((n, context, n))
                continue
            samples = context + n == len(seq.token_ids)
            rows.append((n, context, samples))
            if samples:
                token_ids[i] = token = next_token(seq)
                if seq.params.logprobs is not None:
                    logprobs[i] = self._logprob(token, seq.params.logprobs)
        features = self.cost.rows_features(rows, self._last_had_prompt)
        self._last_had_prompt = features.num_prompt_seqs > 0
        modelled = self.cost.predict(features)
        if self.lora is not None and self.lora_adapters is not None:
            modelled += self.lora.step_seconds(plan, features.num_tokens, self.lora_adapters)
        self.last_step_s = modelled
        self.total_step_s += modelled
        self.num_steps += 1
        return token_ids, logprobs, features, modelled

    @property
    def step_predictor(self) -> StepCostModel:
        """The step-time prediction of the engine's step-time budget (worker/scheduling/step_budget.py):
        the cost model this device waits by, exact here, so the budget needs no correction."""
        return self.cost

    def _wait(self, start: float, modelled: float, overhead: float) -> float:
        """Sleep so that the step takes modelled * dilation of wall time, counting the
        engine's own host work since the previous step against the modelled overheads."""
        wall = modelled * self.time_dilation
        host = 0.0 if self._last_return is None else start - self._last_return
        deadline = start + wall - min(host, overhead * self.time_dilation)
        remaining = deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        return time.perf_counter() - start

    # -- deterministic tokens -------------------------------------------------------------------
    def next_token(self, seq: Sequence) -> int:
        """A pure function of seq.token_ids (and params.seed); the running hash is cached
        on the sequence (the slot a sampler owns; this runner is its sampler)."""
        cached = seq.sampler_state
        token_ids = seq.token_ids
        num_tokens = len(token_ids)
        if isinstance(cached, tuple) and len(cached) == 2 and cached[0] <= num_tokens:
            if cached[0] == num_tokens - 1:  # a running decode: one token since the last step (history_hash inlined)
                state = (cached[1] * _BASE + token_ids[-1] + 1) & _MASK
            else:
                state = history_hash(token_ids, cached[0], cached[1])
        else:
            state = history_hash(token_ids)
        seq.sampler_state = (num_tokens, state)
        return self._token_from_state(state, seq)

    def _token_from_state(self, state: int, seq: Sequence) -> int:
        """The token drawn after a history whose hash is `state`."""
        seed = seq.params.seed
        x = state if seed is None else state ^ _mix64(seed + 1)
        # _mix64 inlined (a call per token is a visible share of what a simulated token costs)
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
        token = (x ^ (x >> 31)) % self.vocab_size
        if self.avoid_token_ids:
            while token in self.avoid_token_ids:
                token = (token + 1) % self.vocab_size
        return token

    def _logprob(self, token: int, top_n: int) -> TokenLogprob:
        """A uniform distribution over the vocabulary: the chosen token and the next
        top_n ids, each at log(1/V). (No model, so no real probabilities.)"""
        lp = -math.log(self.vocab_size)
        top = tuple(((token + j) % self.vocab_size, lp) for j in range(top_n))
        return TokenLogprob(token, lp, top)
