"""The test-only fault hook (tests/support/fault_runner.py): a runner wrapper whose n-th execute
raises once; only that step's requests fail, blocks are freed, the rest go on. Shipped
code has no fault switch: the old environment variable does nothing."""
from __future__ import annotations

import pytest

from tests.support.fault_runner import install_failing_runner
from tests.unit.worker.engine.test_engine_core_fake import make_engine
from worker.api import SamplingParams


def test_injected_step_failure_fails_that_step_only() -> None:
    engine = make_engine()
    install_failing_runner(engine, fail_on_step=2)
    engine.add_request("a", [3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True))
    assert engine.step()[0].finish_reason is None  # step 1: fine
    [failed] = engine.step()  # step 2: injected
    assert failed.finish_reason == "error" and "injected fault" in (failed.error or "")
    engine.add_request("b", [3, 4, 5], SamplingParams(max_tokens=3, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].request_id == "b" and outs[-1].finish_reason == "length"
    assert engine.kv.stats().free_blocks == engine.kv.stats().total_blocks


def test_the_old_environment_switch_injects_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_FAULT_INJECT_STEP_FAILURE", "1")
    engine = make_engine()
    engine.add_request("a", [3, 4, 5], SamplingParams(max_tokens=3, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert all(o.error is None for o in outs) and outs[-1].finish_reason == "length"


def test_the_wrapper_keeps_the_runners_capabilities() -> None:
    from tests.unit.kv.test_kv_transfer import _engine
    from worker.kvcache.connector import KVTransferConnector
    from worker.runner.protocols import KVTransferRunner

    engine = _engine()
    runner = install_failing_runner(engine, fail_on_step=None)
    assert isinstance(runner, KVTransferRunner) and isinstance(engine.connector, KVTransferConnector)
