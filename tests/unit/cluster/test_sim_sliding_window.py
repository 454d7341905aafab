"""The simulator's cost model on a shape with sliding-window layers (worker/sim/): the
sliding layers' attention reads at most their window, the global ones the whole context."""
from __future__ import annotations

from dataclasses import replace

import pytest

from worker.costs.cost_model import StepCostModel, _clipped_pairs
from worker.costs.profiles import load_profile
from worker.costs.shapes import load_shape


def test_the_cost_model_prices_sliding_layers_by_their_window() -> None:
    """gpt-oss: half the layers read at most 128 keys a query, so a long-context decode
    costs well under the all-global model's attention, and a short one the same."""
    assert _clipped_pairs(0, 5, 3) == 1 + 2 + 3 + 3 + 3
    assert _clipped_pairs(10, 4, 3) == 12
    assert _clipped_pairs(0, 3, 10) == 1 + 2 + 3
    shape = load_shape("gpt-oss-20b")
    sliding = StepCostModel(shape, load_profile("h200"))
    full = StepCostModel(replace(shape, layer_windows=()), load_profile("h200"))
    long_rows = [(1, 32_000, True)] * 64
    short_rows = [(1, 100, True)] * 64
    assert sliding.predict_rows(long_rows) < 0.75 * full.predict_rows(long_rows)
    assert sliding.predict_rows(short_rows) == pytest.approx(full.predict_rows(short_rows))
    beside = sliding.predict_beside(long_rows)
    assert beside((512, 0, True)) == pytest.approx(sliding.predict_rows([*long_rows, (512, 0, True)]))
