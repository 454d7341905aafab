"""The overlapped step's records and the runner capability it needs: a runner that returns
from `launch` while the device works. The timeline and its rules are async scheduling's
(worker/scheduling/async_scheduler.py); Engine.launch_step and Engine.complete_step run it.
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
