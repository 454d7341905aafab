"""The fault hook of the tests: a runner wrapper whose n-th `execute` raises, once, as a
runner bug would. Only tests install it (shipped code has no fault switch): unit tests wrap
an engine's runner directly; tests/integration/failing_worker.py deploys a worker replica
that wraps its engine's runner. Everything but `execute` is the inner runner's, so the
engine sees the same capabilities (KV transfer, health checks) as without the wrapper."""
from __future__ import annotations

from typing import Any

from worker.scheduling.scheduler import SchedulerOutput


class FailingRunner:
    def __init__(self, inner: Any, fail_on_step: int | None, message: str | None = None) -> None:
        self.inner = inner
        self.fail_on_step = fail_on_step  # 1-based count of execute calls; None: never
        self.message = message
        self.num_executed = 0

    @property
    def num_blocks(self) -> int:
        return self.inner.num_blocks

    def execute(self, plan: SchedulerOutput) -> Any:
        self.num_executed += 1
        if self.num_executed == self.fail_on_step:
            raise RuntimeError(self.message or f"injected fault (step {self.num_executed})")
        return self.inner.execute(plan)

    def __getattr__(self, name: str) -> Any:
        # Only reached for what this class does not define: the inner runner's capabilities.
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


def install_failing_runner(engine: Any, fail_on_step: int | None, message: str | None = None) -> FailingRunner:
    """Wrap `engine.runner` (an Engine) so that its `fail_on_step`-th execute raises."""
    runner = FailingRunner(engine.runner, fail_on_step, message)
    engine.runner = runner
    return runner
