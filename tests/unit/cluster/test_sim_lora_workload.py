"""The simulator's `lora` workload: ShareGPT requests, each for one of 64 adapters with
Zipf popularity, seeded, with an optional warm-up of the same traffic."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from cluster.workload.sim_kinds import LORA_NUM_ADAPTERS, lora_adapter_name, make_workload, zipf_probabilities


def test_zipf_probabilities_fall_as_one_over_the_rank() -> None:
    p = zipf_probabilities(64, 1.0)
    assert p.sum() == pytest.approx(1.0)
    assert p[0] / p[1] == pytest.approx(2.0) and p[0] / p[63] == pytest.approx(64.0)
    assert p[0] == pytest.approx(1.0 / sum(1.0 / k for k in range(1, 65)))
    assert np.allclose(zipf_probabilities(8, 0.0), 1 / 8)  # s = 0: uniform


def test_adapters_are_drawn_with_zipf_popularity_over_64_names() -> None:
    n = 4000
    reqs = make_workload("lora", n, 50.0, seed=0, input_mean=16, output_mean=8)
    assert len(reqs) == n and len({r.request_id for r in reqs}) == n
    counts = Counter(r.lora_name for r in reqs)
    assert set(counts) <= {lora_adapter_name(k) for k in range(LORA_NUM_ADAPTERS)}
    assert len(counts) == LORA_NUM_ADAPTERS  # at this size every adapter is drawn
    p = zipf_probabilities(LORA_NUM_ADAPTERS, 1.0)
    for k in (0, 1, 3, 15):
        expected = n * p[k]
        assert abs(counts[lora_adapter_name(k)] - expected) < 4 * np.sqrt(expected)  # binomial, 4 sigma
    assert counts[lora_adapter_name(0)] > counts[lora_adapter_name(1)] > counts[lora_adapter_name(7)]


def test_seeded_and_the_warm_up_comes_first_unmeasured() -> None:
    a = make_workload("lora", 100, 20.0, seed=3, warmup_s=2.0)
    assert a == make_workload("lora", 100, 20.0, seed=3, warmup_s=2.0)
    assert a != make_workload("lora", 100, 20.0, seed=4, warmup_s=2.0)
    warm = [r for r in a if r.warmup]
    assert len(warm) == 40 and len(a) == 140  # rate x warm-up more requests
    assert max(r.arrival_s for r in warm) < min(r.arrival_s for r in a if not r.warmup)
    assert all(r.lora_name is not None for r in a)
    with pytest.raises(ValueError, match="num_adapters"):
        make_workload("lora", 10, 1.0, seed=0, num_adapters=0)
