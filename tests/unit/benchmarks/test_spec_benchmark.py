"""benchmarks.spec end to end on a short workload: its answers are the plain engine's and
the model's own continuation, and its RESULT line carries the three keys."""
from __future__ import annotations

import re

import pytest

from benchmarks import spec


def test_short_run_is_exact_and_reports(capsys: pytest.CaptureFixture[str]) -> None:
    assert spec.main(["--repeats", "1", "--prefix-tokens", "24", "--max-tokens", "12"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    match = re.fullmatch(r"RESULT spec_exact=1 ngram_tokens_per_step=([\d.]+) spec_itl_ratio_b1=([\d.]+)", last)
    assert match is not None, last
    assert float(match.group(1)) >= 1.0
