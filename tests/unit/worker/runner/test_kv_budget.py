"""KV sizing on a GPU from its memory figures (injected: no GPU needed), and the forward
timer's wall-clock mode on CPU."""
from __future__ import annotations

import pytest
import torch

from kv.kv_cache import KVCacheSpec, kv_budget_from_memory, num_blocks_for_budget
from worker.runner.forward_timer import ForwardTimer

GIB = 2**30


def test_budget_is_utilization_share_minus_used_minus_activation_peak() -> None:
    # 141 GiB card, 16 GiB weights + 1 GiB context/other in use, 3 GiB activation peak
    budget = kv_budget_from_memory(141 * GIB, 124 * GIB, 0.9, 3 * GIB)
    assert budget == int(141 * GIB * 0.9) - 17 * GIB - 3 * GIB


def test_other_processes_memory_counts_as_used() -> None:
    alone = kv_budget_from_memory(80 * GIB, 64 * GIB, 0.9)
    shared = kv_budget_from_memory(80 * GIB, 54 * GIB, 0.9)  # 10 GiB taken by someone else
    assert alone - shared == 10 * GIB


def test_no_room_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="leaves no memory for the KV cache"):
        kv_budget_from_memory(24 * GIB, 4 * GIB, 0.8, 1 * GIB)


def test_llama3_8b_blocks_from_budget() -> None:
    spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
    assert spec.bytes_per_block == 2 * 32 * 16 * 8 * 128 * 2  # 2 MiB: 128 KiB per token
    assert num_blocks_for_budget(spec, 100 * GIB) == 100 * 512


def test_forward_timer_on_cpu_is_wall_clock() -> None:
    timer = ForwardTimer(torch.device("cpu"))
    timer.start()
    torch.ones(256, 256) @ torch.ones(256, 256)
    timer.stop()
    assert 0.0 < timer.elapsed_s() < 5.0
