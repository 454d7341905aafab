"""The simulated device's numbers: model shapes, device profiles, and the step-cost model
against rooflines computed by hand here (worker/sim/)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tests.support.scheduler_helpers import make_scheduler, make_seq
from worker.runner.decode_groups import decode_group_bounds, padded_decode_tokens
from worker.default_model import default_model_path
from worker.costs.cost_model import SeqWork, StepCostModel
from worker.costs.profiles import BUILTIN_PROFILES, DeviceProfile, load_profile
from worker.costs.shapes import load_shape, named_shapes

# Llama-3-8B by hand: per layer q 4096^2, k and v 4096*1024 each, o 4096^2, MLP 3*4096*14336.
L8_LAYER_MATMUL = 4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336  # 218,103,808
L8_MATMUL = 32 * L8_LAYER_MATMUL  # 6,979,321,856
L8_HEAD = 128256 * 4096
L8_KV_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 heads of 128, bf16: 128 KiB


def ideal(profile: str) -> DeviceProfile:
    """A profile at its peak, without overheads: the bare roofline."""
    return replace(load_profile(profile), flops_efficiency=1.0, bandwidth_efficiency=1.0,
                   step_overhead_s=0.0, per_seq_overhead_s=0.0, per_token_overhead_s=0.0)


# ---------------------------------------------------------------- shapes


def test_named_shapes_match_published_parameter_counts() -> None:
    assert named_shapes() == ["deepseek-v3", "gpt-oss-20b", "llama-3-70b", "llama-3-8b", "qwen3-30b-a3b", "qwen3-32b"]
    l8, l70, q32 = load_shape("llama-3-8b"), load_shape("llama-3-70b"), load_shape("qwen3-32b")
    assert l8.num_params == 8_030_261_248  # Meta's published count
    assert l8.matmul_params == L8_MATMUL
    assert l8.kv_bytes_per_token() == L8_KV_PER_TOKEN
    assert round(l70.num_params / 1e9, 1) == 70.6
    assert round(q32.num_params / 1e9, 1) == 32.8  # Qwen's "32.8B"
    # Qwen3-32B: 64 heads of 128 = 8192 wide queries on a 5120 hidden size.
    assert (q32.q_size, q32.hidden_size, q32.kv_bytes_per_token()) == (8192, 5120, 2 * 64 * 8 * 128 * 2)
    assert (l8.dtype_bytes, l8.max_position_embeddings, l8.eos_token_ids) == (2, 8192, (128001, 128009))


def test_shape_from_a_model_directory_reads_its_dtype_and_tied_head() -> None:
    shape = load_shape(default_model_path())
    info = json.loads((Path(default_model_path()) / "build_info.json").read_text())
    assert shape.num_params == info["num_parameters"]  # the tiny model's own count
    assert shape.tie_word_embeddings and shape.dtype_bytes == 4  # config says float32
    assert load_shape(default_model_path(), dtype_bytes=2).dtype_bytes == 2


def test_unknown_shape_names_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="llama-3-8b"):
        load_shape("llama-9")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="lacks"):
        load_shape(str(tmp_path))


# ---------------------------------------------------------------- profiles


def test_builtin_profiles_are_spec_sheet_figures_and_uncalibrated() -> None:
    assert set(BUILTIN_PROFILES) == {"h200", "h100", "a100-80gb", "l4"}
    for profile in BUILTIN_PROFILES.values():
        assert not profile.calibrated and "datasheet" in profile.source
    h200 = load_profile("H200")
    assert (h200.hbm_bandwidth, h200.peak_flops, h200.memory_bytes) == (4.8e12, 989e12, 141 * 10**9)
    assert load_profile("l4").peak_flops == 121e12  # dense, not the 242 with sparsity


def test_profile_json_round_trip_and_errors(tmp_path: Path) -> None:
    fitted = replace(load_profile("h100"), name="h100-fit", calibrated=True, fit={"mean_rel_error": 0.03})
    path = tmp_path / "p.json"
    fitted.save(path)
    assert load_profile(str(path)) == fitted
    path.write_text(json.dumps({**fitted.to_dict(), "bandwith": 1}))
    with pytest.raises(ValueError, match="unknown keys"):
        load_profile(str(path))
    with pytest.raises(FileNotFoundError, match="h200"):
        load_profile("tpu-v9")
    with pytest.raises(ValueError, match="efficiencies"):
        replace(fitted, flops_efficiency=1.5)


# ---------------------------------------------------------------- the roofline, by hand


def test_decode_batch_one_is_the_weights_over_bandwidth() -> None:
    """H200, Llama-3-8B, one decode: every layer weight and the LM head once (the
    embedding is a row lookup): 15.0 GB / 4.8 TB/s = 3.13 ms at peak."""
    model = StepCostModel(load_shape("llama-3-8b"), ideal("h200"))
    weights = (L8_MATMUL + L8_HEAD) * 2
    assert weights == 15_009_316_864
    t = model.step_time_s([SeqWork(1, 0)])
    # Activations, one token's KV and logits add ~6 MB on top of 15 GB.
    assert t == pytest.approx(weights / 4.8e12, rel=1e-3)
    # With the default 80% bandwidth efficiency and overheads.
    default = StepCostModel(load_shape("llama-3-8b"), load_profile("h200"))
    assert default.step_time_s([SeqWork(1, 0)]) == pytest.approx(weights / (4.8e12 * 0.8) + 1e-3 + 20e-6, rel=1e-3)


def test_decode_batch_reads_weights_once_and_each_context_once() -> None:
    model = StepCostModel(load_shape("llama-3-8b"), ideal("h200"))
    one = model.step_time_s([SeqWork(1, 0)])
    batch = model.step_time_s([SeqWork(1, 0)] * 64)
    assert batch < 1.05 * one  # still memory-bound on the weights
    long = model.step_time_s([SeqWork(1, 4096)] * 64)
    # 64 contexts of 4096 more tokens, each read once: 64 * 4096 * 128 KiB = 34.4 GB more.
    assert long - batch == pytest.approx(64 * 4096 * L8_KV_PER_TOKEN / 4.8e12, rel=1e-6)


def test_big_prefill_is_compute_bound() -> None:
    """8192 prompt tokens from scratch: layer GEMMs 2 * 6.98e9 FLOPs per token, causal
    attention over 8192*8193/2 pairs at 4 * 32 heads * 128 * 32 layers FLOPs each: ~133 ms
    at 989 TFLOP/s. The one sampled row's LM head stays memory-bound (its 1.05 GB of
    weights, 0.22 ms), a kernel of its own."""
    model = StepCostModel(load_shape("llama-3-8b"), ideal("h200"))
    n = 8192
    flops = 2 * L8_MATMUL * n + 4 * 32 * 128 * 32 * (n * (n + 1) // 2)
    head_bytes = L8_HEAD * 2 + 4096 * 2 + 2 * 128256 * 4  # weights, the row in, logits out and back
    t = model.step_time_s([SeqWork(n, 0)])
    assert t == pytest.approx(flops / 989e12 + head_bytes / 4.8e12, rel=1e-6)
    assert 0.13 < t < 0.14
    features = model.features([SeqWork(n, 0)])
    dense_memory_s = features.bytes[0] / 4.8e12
    assert dense_memory_s < 0.1 * t


def test_lm_head_only_for_rows_that_sample() -> None:
    model = StepCostModel(load_shape("llama-3-8b"), ideal("h200"))
    chunk = model.features([SeqWork(512, 0, samples=False)])
    last = model.features([SeqWork(512, 512, samples=True)])
    assert chunk.flops[1] == 0 and chunk.bytes[1] == 0
    assert last.flops[1] == 2 * L8_HEAD


def test_components_add_so_decode_kv_is_not_hidden_by_a_prefill() -> None:
    model = StepCostModel(load_shape("llama-3-8b"), ideal("h200"))
    prefill = [SeqWork(2048, 0)]
    decodes = [SeqWork(1, 8000)] * 32
    mixed = model.step_time_s(prefill + decodes)
    kv_read_s = 32 * 8001 * L8_KV_PER_TOKEN / 4.8e12
    assert mixed - model.step_time_s(prefill) >= kv_read_s


def test_overheads_add_per_step_sequence_and_token() -> None:
    base = ideal("h100")
    with_overheads = replace(base, step_overhead_s=1e-3, per_seq_overhead_s=1e-5, per_token_overhead_s=1e-6)
    shape = load_shape("llama-3-8b")
    work = [SeqWork(1, 100)] * 10 + [SeqWork(300, 0)]
    extra = StepCostModel(shape, with_overheads).step_time_s(work) - StepCostModel(shape, base).step_time_s(work)
    assert extra == pytest.approx(1e-3 + 11 * 1e-5 + 310 * 1e-6)
    assert StepCostModel(shape, with_overheads).step_time_s([]) == 0.0


def test_prompt_rows_carry_their_own_overhead_zero_on_every_shipped_profile() -> None:
    """per_prompt_seq_overhead_s adds per row of more than one new token (a prompt chunk),
    on top of the per-sequence overhead; every built-in and shipped JSON profile leaves it
    at 0, so their step times are what they were."""
    from worker.costs.profiles import profile_names

    base = ideal("h100")
    shape = load_shape("llama-3-8b")
    work = [SeqWork(1, 100)] * 10 + [SeqWork(300, 0), SeqWork(2, 50, False)]
    with_prompt = replace(base, per_prompt_seq_overhead_s=1e-4)
    model = StepCostModel(shape, with_prompt)
    assert model.features(work).num_prompt_seqs == 2
    assert model.step_time_s(work) - StepCostModel(shape, base).step_time_s(work) == pytest.approx(2e-4)
    assert model.overhead_s(model.features(work)) == pytest.approx(2e-4)
    assert model.predict_beside([(1, 100, True)] * 10)((300, 0, True)) == pytest.approx(
        model.step_time_s([SeqWork(1, 100)] * 10 + [SeqWork(300, 0)]))
    assert all(load_profile(name).per_prompt_seq_overhead_s == 0.0 for name in profile_names())


def test_plan_work_reads_a_real_scheduler_plan() -> None:
    sched = make_scheduler(max_num_batched_tokens=10, block_size=4)
    sched.add(make_seq("a", 6))
    sched.add(make_seq("b", 9))
    plan = sched.schedule()  # a: whole prompt (samples), b: a 4-token chunk (does not)
    work = StepCostModel.plan_work(plan)
    assert work == [SeqWork(6, 0, True), SeqWork(4, 0, False)]
    model = StepCostModel(load_shape("llama-3-8b"), load_profile("h200"))
    assert model.plan_time_s(plan) == model.step_time_s(work)


def test_kv_blocks_are_the_memory_left_after_the_weights() -> None:
    model = StepCostModel(load_shape("llama-3-8b"), load_profile("h200"))
    expected = int((141e9 * 0.9 - 8_030_261_248 * 2) // (16 * L8_KV_PER_TOKEN))
    assert model.num_kv_blocks(16) == expected == 52_852
    with pytest.raises(ValueError, match="no room"):
        StepCostModel(load_shape("llama-3-70b"), load_profile("l4")).num_kv_blocks(16)


def test_shipped_fitted_cpu_profile_loads_by_name() -> None:
    """worker/costs/profiles/cpu-calibrated.json: `kvserve calibrate` on this project's
    machine (benchmarks/results/calibrate_cpu.log), fitted on the embedded model in FP32."""
    cpu = load_profile("cpu-calibrated")
    assert cpu.calibrated and cpu.fit is not None
    assert cpu.fit["model"] == "kvserve-tiny" and cpu.fit["dtype_bytes"] == 4
    assert cpu.fit["num_points"] >= 20 and cpu.fit["mean_rel_error"] < 0.15
    # The shape it was fitted on prices a decode step in milliseconds, as measured there.
    step = StepCostModel(load_shape(default_model_path()), cpu).step_time_s([SeqWork(1, 16)])
    assert 1e-3 < step < 50e-3


def test_decode_groups_split_when_the_context_doubles_after_min_group() -> None:
    # 8 short decodes make a group; the 9th (context 40 > 2 x 11) starts the next one.
    contexts = [4, 5, 6, 7, 8, 9, 10, 10, 40, 41]
    assert decode_group_bounds(contexts) == [(0, 8), (8, 10)]
    assert decode_group_bounds([1, 100, 1000]) == [(0, 3)]  # under min_group: one group
    # Each attends its group's longest context + its own token: 8 x 11 + 2 x 42.
    assert padded_decode_tokens(contexts) == 8 * 11 + 2 * 42
    assert padded_decode_tokens([]) == 0


def test_a_padding_backend_prices_decodes_at_their_groups_longest_context() -> None:
    """The CPU torch backend pads decodes to their group's longest context: a profile that
    says so prices the padded attention pairs and gathered KV; uniform batches (what
    calibration runs) cost the same either way."""
    shape = load_shape("llama-3-8b")
    plain = StepCostModel(shape, ideal("h200"))
    padded = StepCostModel(shape, replace(ideal("h200"), padded_decode_attention=True))
    uniform = [SeqWork(1, 512)] * 4
    assert padded.step_time_s(uniform) == plain.step_time_s(uniform)
    mixed = [SeqWork(1, 0), SeqWork(1, 0), SeqWork(1, 0), SeqWork(1, 4095)]
    extra = padded.step_time_s(mixed) - plain.step_time_s(mixed)
    # Three decodes of context 0 read 4096 KV tokens each instead of 1: 3 x 4095 x 128 KiB more
    # (memory-bound at batch 4).
    assert extra == pytest.approx(3 * 4095 * L8_KV_PER_TOKEN / 4.8e12, rel=1e-6)
    assert load_profile("cpu-calibrated").padded_decode_attention  # fitted on the torch backend
    assert not load_profile("h200").padded_decode_attention


@pytest.mark.parametrize("profile", ["h200", "cpu-calibrated"])  # cpu-calibrated pads decode groups
def test_predict_beside_is_predict_rows_with_one_more_row(profile: str) -> None:
    """The step-time budget's search (worker/scheduling/step_budget.py) sums the planned rows once and
    prices each candidate row beside them: the same seconds to the last bit, for a prefill
    chunk, a one-token row (a decode to the model) and an empty plan."""
    cost = StepCostModel(load_shape("llama-3-8b"), load_profile(profile))
    planned = [(1, 100 + 37 * i, True) for i in range(70)] + [(512, 4096, False), (300, 0, True)]
    for base in (planned, []):
        with_row = cost.predict_beside(base)
        for row in ((2048, 8192, True), (64, 0, False), (1, 9000, True), (1, 5, True)):
            assert with_row(row) == cost.predict_rows(base + [row])
    assert cost.predict_beside(planned)((1, 0, True)) != cost.predict_beside([])((1, 0, True))
