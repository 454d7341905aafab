"""A worker replica whose engine runner fails once (tests/support/fault_runner.py), for the fault
test that deploys through Serve. It is worker/serving/replica.py's `WorkerReplica` over the real
engine and model; only the runner is wrapped, after the engine is built. Shipped code has no
fault switch: a test deploys this class instead of `WorkerReplica` (the Serve replica needs
the repository on its PYTHONPATH to import it)."""
from __future__ import annotations

from tests.support.fault_runner import install_failing_runner
from worker.engine.async_engine import AsyncEngine
from worker.config import EngineConfig
from worker.serving.replica import WorkerReplica


class FailingStepWorker(WorkerReplica):
    def __init__(self, engine_config: EngineConfig, fail_on_step: int, drain_timeout_s: float = 60.0) -> None:
        engine = AsyncEngine.from_config(engine_config)
        install_failing_runner(engine.engine, fail_on_step)
        self._attach(engine, engine_config.cache.block_size, drain_timeout_s)
