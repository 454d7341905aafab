"""The step-cost model prices a verify step (1 + k query tokens a row, 1 + k logits rows,
the weights read once) and says when speculation pays, checked against numbers worked out
by hand on a toy shape and device."""
from __future__ import annotations

import pytest

from worker.costs.cost_model import StepCostModel
from worker.costs.profiles import DeviceProfile, load_profile
from worker.costs.shapes import ModelShape, load_shape
from worker.costs.speculation import best_num_tokens, expected_tokens_per_row, speculation_gain, step_times

# One layer, hidden 8, one head of 8 (and one KV head), MLP 8, vocab 16, 1 byte a value.
TOY = ModelShape("toy", num_layers=1, hidden_size=8, num_heads=1, num_kv_heads=1, head_dim=8,
                 intermediate_size=8, vocab_size=16, dtype_bytes=1, max_position_embeddings=4096)
# Memory-bound by construction: 1 byte/s at full efficiency, compute free, no host overheads.
BYTES_ONLY = DeviceProfile("bytes", hbm_bandwidth=1.0, peak_flops=1e30, memory_bytes=10**9, flops_efficiency=1.0,
                           bandwidth_efficiency=1.0, step_overhead_s=0.0, per_seq_overhead_s=0.0)


def test_expected_tokens_per_row() -> None:
    assert expected_tokens_per_row(0.5, 3) == 1 + 0.5 + 0.25 + 0.125 == 1.875
    assert expected_tokens_per_row(1.0, 4) == 5.0
    assert expected_tokens_per_row(0.0, 4) == 1.0
    assert expected_tokens_per_row(0.8, 0) == 1.0
    with pytest.raises(ValueError):
        expected_tokens_per_row(1.2, 2)


def test_verify_step_bytes_by_hand() -> None:
    """With time = bytes, one row at context 10, k = 3 drafts:
    weights W = matmul_params (1 byte each); activations per token 4h + 2q + 2kv + 3i =
    32 + 16 + 16 + 24 = 88; LM head 16 x 8 = 128 bytes of weights, 8 + 2 x 16 x 4 = 136 per
    logits row; KV 2 x 8 = 16 per token, Q and O 2 x 8 = 16 per new token.
    plain:  W + 88 + 128 + 136 + 16 x (11 + 1) + 16                 = W + 560
    verify: W + 4 x 88 + 128 + 4 x 136 + 16 x (14 + 4) + 4 x 16    = W + 1376"""
    model = StepCostModel(TOY, BYTES_ONLY)
    w = TOY.matmul_params
    plain, verify = step_times(model, batch=1, context=10, num_tokens=3)
    assert plain == pytest.approx(w + 560)
    assert verify == pytest.approx(w + 1376)
    # gain = E * plain / verify, E(3, 0.5) = 1.875
    assert speculation_gain(model, 1, 10, 3, 0.5) == pytest.approx(1.875 * (w + 560) / (w + 1376))


def test_batch_of_verify_rows_reads_the_weights_once() -> None:
    """Four rows: every per-row part four times, the weights and the head's weights once.
    plain:  W + 4 x (88 + 136 + 16 x 12 + 16) + 128 = W + 1856
    verify: W + 4 x (4 x 88 + 4 x 136 + 16 x 18 + 4 x 16) + 128 = W + 5120"""
    model = StepCostModel(TOY, BYTES_ONLY)
    w = TOY.matmul_params
    assert step_times(model, batch=4, context=10, num_tokens=3) == (pytest.approx(w + 1856), pytest.approx(w + 5120))


def test_speculation_pays_at_small_batches_and_not_at_large_ones() -> None:
    """llama-3-8b on an H100 at context 1024: a decode step at batch 1 reads 16 GB of
    weights for one token a row, so drafts are nearly free and the gain approaches E; at
    batch 512 the step is bound by compute and KV reads, and long drafts cost more than
    they return."""
    model = StepCostModel(load_shape("llama-3-8b"), load_profile("h100"))
    small = speculation_gain(model, 1, 1024, 4, 0.7)
    assert expected_tokens_per_row(0.7, 4) * 0.9 < small < expected_tokens_per_row(0.7, 4)
    assert speculation_gain(model, 512, 1024, 8, 0.5) < 1.0
    k, gain = best_num_tokens(model, 1, 1024, 0.7)
    assert k >= 4 and gain > small
    k_large, gain_large = best_num_tokens(model, 512, 1024, 0.5)
    assert k_large < k and gain_large < gain
    assert best_num_tokens(model, 512, 1024, 0.0) == (0, 1.0)  # nothing accepted: never pays
