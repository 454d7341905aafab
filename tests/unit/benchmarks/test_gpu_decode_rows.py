"""benchmarks.gpu's decode windows hold exactly their batch in every timed step, in the
serial and the launch-ahead loop, even when prompts take several steps to prefill (the
first ones decoding meanwhile): the `--tiny` CPU run, as CI runs it."""
from __future__ import annotations

import re

import pytest

from benchmarks import gpu
from benchmarks.decode_window import prefill_steps_bound


def result_fields(out: str) -> dict[str, float]:
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")][-1]
    return {k: float(v) for k, v in re.findall(r"(\w+)=([-\d.]+)", line)}


def test_tiny_run_every_timed_step_holds_its_batch(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu.main(["--tiny", "--decode-only"]) == 0
    out = capsys.readouterr().out
    fields = result_fields(out)
    cfg = gpu.settings(True, None, None, 0)
    for b in cfg.decode_batches:
        assert fields[f"rows_min_b{b}"] == b
        assert f"roofline_pct_b{b}" in fields and f"serial_pct_b{b}" in fields and f"ahead_pct_b{b}" in fields
    # The largest batch's prompts do not fit one step: its first rows decode while the
    # rest prefill, the case a window that starts right after the last prompt loses rows in.
    top = max(cfg.decode_batches)
    assert top * cfg.context_len > cfg.max_num_batched_tokens
    assert prefill_steps_bound(top, cfg.context_len, cfg.max_num_batched_tokens) >= 3
    # Both loops printed a row per batch, each with its fewest rows equal to the batch.
    table = [ln.split() for ln in out.splitlines() if re.match(r"\s+\d+\s+(serial|ahead)\s", ln)]
    assert sorted((int(r[0]), r[1]) for r in table) == sorted((b, lp) for b in cfg.decode_batches
                                                              for lp in ("serial", "ahead"))
    assert all(int(r[2]) == int(r[0]) for r in table)
