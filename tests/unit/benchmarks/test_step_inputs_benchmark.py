"""benchmarks.step_inputs runs both sides on a small batch and prints its RESULT line."""
from __future__ import annotations

import sys

import pytest

from benchmarks import step_inputs


def test_small_run_prints_the_result_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["step_inputs", "--batch", "4", "--context", "40", "--steps", "20", "--repeats", "2"])
    step_inputs.main()
    last = capsys.readouterr().out.strip().splitlines()[-1]
    fields = dict(kv.split("=") for kv in last.removeprefix("RESULT ").split())
    assert set(fields) == {"step_inputs_us_padded", "step_inputs_us_persistent", "persistent_vs_padded"}
    assert all(float(v) > 0 for v in fields.values())
