"""Host work under device work: the engine step split at the device, so that while the
device runs step N the host publishes step N-1's outputs (vLLM v1's async scheduling and
SGLang's overlap scheduler do the same; in the decode steady state worker/scheduling/launch_ahead.py
goes one step further, as they do).

A runner that overlaps (`overlaps()` below) splits `execute(plan)` into `launch(plan)`,
which returns as soon as the step is on the device, and `wait(handle)`, which returns its
RunnerOutput once the device is done. The async engine's step thread then runs:

    host    ..| wait N-1 | update N-1 | schedule N | launch N | advance N, outputs N-1, publish, stats, inbox, plan N+1 | wait N |...
    device  ..== N-1 ===|          (idle)                     |=================== step N ===================|

    exposed host time per step: update (the sampled tokens: append, stop checks, frees) +
            schedule (taking the plan made ahead, when there is one) + launch's host part
    hidden: advancing step N's sequences past its tokens and registering the blocks they
            fill (Scheduler.advance: the plan alone decides it), building step N-1's
            RequestOutputs, publishing them, the stats and prefix-hash snapshots, draining
            the inbox (adds, aborts, KV releases), and, when step N+1 can only be decodes,
            its plan (worker/scheduling/decode_ahead.py); beyond the device step they become
            exposed too (wait then finds the device already done)

The rules, and why:
- update N-1 stays on the critical path, and so does schedule N unless it was made ahead:
  step N's decodes take as input the tokens step N-1 sampled, and which sequences still
  run depends on N-1's stop checks. When nothing waits or loads and every running
  sequence decodes next, the plan is known but for those stops: it is made under step
  N-1, and schedule N only leaves out the sequences that stopped (worker/scheduling/decode_ahead.py;
  not while a KV export is due, whose pin would hold the block grown ahead). On a runner
  that can take those tokens from the device, that plan is launched before N-1 is even
  waited for, and update and schedule leave the critical path too (worker/scheduling/launch_ahead.py).
- advance N runs right after launch N: the runner has taken the plan's inputs by then,
  and nothing before wait N reads a planned sequence's num_computed_tokens (outputs and
  stats read tokens and counts). Blocks it registers in the prefix cache are still being
  written by the device, but only schedule N+1, after wait N, can admit against them.
- Step N-1's outputs are built after schedule N has run, from the state update N-1 left:
  nothing on the step thread touches a sequence in between except schedule N, whose
  preemptions only show in an output's num_preemptions (the count when it is published).
- The inbox is drained while step N is on the device. An abort frees the sequence's blocks
  while a plan that holds them is in flight; that is safe because no plan can take them
  before schedule N+1, which follows wait N, and update N skips the finished sequence (its
  token is dropped).
- A launch that fails is reported by complete_step, after step N-1's outputs are built,
  so that no request receives its error before the token it sampled the step before.
- A runner that computes on the host itself (a CPU device, a test's fake) does not
  overlap: there, step N+1's launch would run the whole step before step N's outputs
  leave, delaying every output by a step. The engine's serial `step()` serves them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from worker.api import RequestOutput, RunnerOutput, TokenLogprob
    from worker.scheduling.scheduler import SchedulerOutput
    from worker.sequence import Sequence


@runtime_checkable
class OverlappingRunner(Protocol):
    @property
    def overlaps_device(self) -> bool:
        """Whether launch returns while the device still works (False: launch computes the
        step on the host, and the engine steps serially)."""
        ...

    def launch(self, plan: SchedulerOutput) -> object:
        """Start the plan's step on the device; the handle goes to `wait`."""
        ...

    def wait(self, handle: object) -> RunnerOutput:
        """The step's RunnerOutput, once the device has finished it."""
        ...


def overlaps(runner: object) -> bool:
    return isinstance(runner, OverlappingRunner) and runner.overlaps_device


@dataclass
class LaunchedStep:
    """A step planned and (unless empty or failed) on the device."""

    plan: SchedulerOutput
    # Produced while planning (a failed grammar compile, a failed KV import); they leave
    # with the previous step's outputs.
    outputs: list[RequestOutput] = field(default_factory=list)
    handle: object = None  # the runner's, while the step is on the device
    error: Exception | None = None  # the launch failed: complete_step fails the plan
    start_s: float = 0.0  # perf_counter when planning began


@dataclass
class AppliedStep:
    """A step whose result the scheduler has applied; its RequestOutputs are built from
    `changed` by Engine.step_outputs (under the next step's device time)."""

    plan: SchedulerOutput
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    changed: list[Sequence] = field(default_factory=list)
    saved: dict = field(default_factory=dict)  # the KV connector's exports (SavedKV)
    failed: list[RequestOutput] | None = None  # the step failed: these are its outputs
