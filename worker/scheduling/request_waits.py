"""Requests that wait on something before they can run: their grammar's compile, their
adapter's load into host memory, their prefix blocks' read from a tier below the device,
their imported KV's write into their blocks.

The first two wait outside the scheduler (worker/structured/compile_waits.py,
worker/lora/engine_lora.py) and enter it when done; tier reads and KV imports are for
requests the scheduler has admitted already. A failed wait fails its request. All of it
runs on the engine thread: the admissions as each step's plan starts, the wait when a
step has nothing else to do.
"""
from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, wait
from typing import TYPE_CHECKING

from worker.api import RequestOutput
from worker.scheduling.plan import SchedulerOutput
from worker.sequence import Sequence, SequenceStatus
from worker.scheduling.step_results import fail_request

if TYPE_CHECKING:  # the engine imports this module
    from worker.engine.core import Engine

# How long an otherwise idle step waits for a grammar compile (new requests wait at most
# this long in the inbox meanwhile).
GRAMMAR_POLL_S = 0.005


def admit_or_compile(engine: Engine, seq: Sequence) -> None:
    """A request with all it needs but its grammar goes to the scheduler, or waits for
    the grammar's compile (at most the compiler's timeout)."""
    if not engine.compiles.submit(seq):
        engine.scheduler.add(seq)


def admit_compiled(engine: Engine) -> list[RequestOutput]:
    """Requests whose grammar has compiled enter the scheduler (in arrival order); a
    failed compile fails its request."""
    ready, failed = engine.compiles.take_compiled()
    for seq in ready:
        engine.scheduler.add(seq)
    outputs = []
    for seq, error in failed:
        seq.status = SequenceStatus.FINISHED
        outputs.append(fail_request(engine, seq, error))
    return outputs


def admit_lora_loaded(engine: Engine) -> list[RequestOutput]:
    """Requests whose adapter reached host memory go on (to the grammar compile or the
    scheduler); a failed adapter load fails its requests."""
    assert engine.lora is not None
    ready, failed = engine.lora.take_loaded()
    outputs = []
    for seq in ready:
        admit_or_compile(engine, seq)
    for seq, message in failed:
        seq.status = SequenceStatus.FINISHED
        outputs.append(fail_request(engine, seq, f"LoRA adapter {seq.lora_name!r}: {message}"))
    return outputs


def finish_tier_loads(engine: Engine, done: list[tuple[Sequence, int]]) -> None:
    """Sequences whose blocks a tier has read back may run now."""
    for seq, num_blocks in done:
        engine.scheduler.finish_load(seq, num_blocks)


def load_kv(engine: Engine, plan: SchedulerOutput) -> list[RequestOutput]:
    """Let the connector write imported KV; a failed import leaves the plan and fails."""
    if not plan.kv_imports:
        return []
    outputs = []
    for seq, message in engine.connector.load_kv(plan):
        plan.remove(seq)
        outputs.append(fail_request(engine, seq, message))
    return outputs


def wait_for_any(engine: Engine) -> None:
    """Nothing to run but grammar compiles, adapter loads or tier reads: wait for one, briefly."""
    futures = engine.compiles.futures()
    if engine.lora is not None:
        futures += engine.lora.futures()
    if engine.tiers is not None:
        futures += engine.tiers.pending_futures()
    if futures:
        wait(futures, GRAMMAR_POLL_S, FIRST_COMPLETED)
