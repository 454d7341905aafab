"""The test-only fault hook: KVSERVE_FAULT_INJECT_STEP_FAILURE=n makes the n-th executed
engine step raise once; only that step's requests fail, blocks are freed, the rest go on."""
from __future__ import annotations

import pytest

from tests.unit.test_engine_core_fake import make_engine
from worker.sampling_params import SamplingParams


def test_injected_step_failure_fails_that_step_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_FAULT_INJECT_STEP_FAILURE", "2")
    engine = make_engine()
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


def test_no_fault_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSERVE_FAULT_INJECT_STEP_FAILURE", raising=False)
    engine = make_engine()
    engine.add_request("a", [3, 4, 5], SamplingParams(max_tokens=3, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert all(o.error is None for o in outs) and outs[-1].finish_reason == "length"
