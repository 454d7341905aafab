"""The step's block table, built from the plan's per-row lists in one masked assignment:
the same tensor the padded-rows construction gave (rows padded with block 0)."""
from __future__ import annotations

import random

import torch

from worker.runner.inputs import padded_table


def test_padded_table_equals_padded_rows() -> None:
    rng = random.Random(0)
    for num_rows in (1, 2, 7, 64):
        tables = [[rng.randrange(1, 10_000) for _ in range(rng.randint(1, 70))] for _ in range(num_rows)]
        width = max(len(t) for t in tables)
        expected = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        got = padded_table(tables)
        assert got.dtype == torch.long and torch.equal(got, expected)


def test_rows_of_equal_length_and_single_blocks() -> None:
    assert torch.equal(padded_table([[5], [3]]), torch.tensor([[5], [3]]))
    assert torch.equal(padded_table([[1, 2, 3]]), torch.tensor([[1, 2, 3]]))
