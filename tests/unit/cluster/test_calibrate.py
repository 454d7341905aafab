"""`kvserve calibrate`'s fit (worker/costs/fit.py) on synthetic step times whose true
profile is known, and the command's wiring."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from cluster.cli import build_parser
from worker.costs.cost_model import SeqWork, StepCostModel, predict
from worker.costs.fit import fit_profile
from worker.costs.profiles import load_profile
from worker.costs.shapes import load_shape

TRUE = replace(load_profile("h100"), flops_efficiency=0.55, bandwidth_efficiency=0.72,
               step_overhead_s=1.5e-3, per_seq_overhead_s=30e-6, per_token_overhead_s=2e-7)


def grid() -> list[list[SeqWork]]:
    """What calibrate runs: decode batches x contexts, prefill chunks x contexts."""
    decodes = [[SeqWork(1, c)] * b for b in (1, 8, 64, 256) for c in (128, 2048, 8192)]
    prefills = [[SeqWork(p, k * p, k == 3)] for p in (256, 1024, 4096) for k in range(4)]
    return decodes + prefills


def points(noise: float, seed: int = 0) -> list:
    rng = random.Random(seed)
    model = StepCostModel(load_shape("llama-3-8b"), TRUE)
    return [(f, predict(f, TRUE) * (1 + rng.uniform(-noise, noise))) for f in map(model.features, grid())]


def test_fit_recovers_known_parameters_from_exact_times() -> None:
    start = replace(TRUE, flops_efficiency=0.6, bandwidth_efficiency=0.8, step_overhead_s=0.0,
                    per_seq_overhead_s=0.0, per_token_overhead_s=0.0)
    fitted, report = fit_profile(start, points(noise=0.0))
    assert fitted.flops_efficiency == pytest.approx(0.55, rel=1e-3)
    assert fitted.bandwidth_efficiency == pytest.approx(0.72, rel=1e-3)
    assert fitted.step_overhead_s == pytest.approx(1.5e-3, rel=1e-2)
    assert fitted.per_seq_overhead_s == pytest.approx(30e-6, rel=1e-2)
    assert fitted.per_token_overhead_s == pytest.approx(2e-7, rel=0.1)
    assert report.max_rel_error < 1e-4 and report.num_points == len(grid())
    assert (fitted.peak_flops, fitted.hbm_bandwidth) == (TRUE.peak_flops, TRUE.hbm_bandwidth)  # peaks stay given


def test_fit_error_reflects_measurement_noise() -> None:
    fitted, report = fit_profile(load_profile("h100"), points(noise=0.05, seed=3))
    assert report.max_rel_error < 0.1 and report.mean_rel_error < 0.05
    assert fitted.bandwidth_efficiency == pytest.approx(0.72, rel=0.05)
    assert fitted.flops_efficiency == pytest.approx(0.55, rel=0.05)


def test_fit_recovers_a_prompt_rows_own_overhead() -> None:
    """A backend whose prompt rows cost more host work than its decode rows (the CPU one:
    an attention call per prompt row per layer, one per decode group): with decode points
    (no prompt row) beside prefill and mixed ones (one each), the fit tells that overhead
    from the step's and the per-sequence one, and prices a step of two prompt rows with
    both. A grid whose every point carries a prompt row cannot tell it from the step
    overhead: it stays 0 there, as it does for a GPU fit that is told not to fit it."""
    true = replace(TRUE, per_prompt_seq_overhead_s=400e-6)
    model = StepCostModel(load_shape("llama-3-8b"), true)
    mixed = [[SeqWork(p, 0)] + [SeqWork(1, 2048)] * b for p in (256, 1024) for b in (8, 64)]
    pts = [(f, predict(f, true)) for f in map(model.features, grid() + mixed)]
    fitted, report = fit_profile(load_profile("h100"), pts)
    assert fitted.per_prompt_seq_overhead_s == pytest.approx(400e-6, rel=1e-2)
    assert fitted.per_seq_overhead_s == pytest.approx(30e-6, rel=1e-2)
    assert fitted.step_overhead_s == pytest.approx(1.5e-3, rel=1e-2)
    assert report.max_rel_error < 1e-3
    two_prompts = model.features([SeqWork(256, 0), SeqWork(512, 0), SeqWork(1, 2048)])
    assert two_prompts.num_prompt_seqs == 2
    assert predict(two_prompts, fitted) == pytest.approx(predict(two_prompts, true), rel=1e-3)
    prompts_only = [(f, t) for f, t in pts if f.num_prompt_seqs]
    assert fit_profile(load_profile("h100"), prompts_only)[0].per_prompt_seq_overhead_s == 0.0
    assert fit_profile(load_profile("h100"), pts, fit_per_prompt_seq=False)[0].per_prompt_seq_overhead_s == 0.0


def test_fit_recovers_what_a_decode_after_a_prompt_pays() -> None:
    """A CPU's decode step right after a prompt chunk refills the caches the chunk took:
    with the decode steps after each mixed point beside the plain decode points, the fit
    finds that overhead (and only for decode-only steps that follow a prompt); without
    such points it stays 0, and a GPU profile prices consecutive steps alike."""
    true = replace(TRUE, after_prompt_overhead_s=700e-6)
    model = StepCostModel(load_shape("llama-3-8b"), true)
    after = [model.rows_features([(1, 2048, True)] * b, follows_prompt=True) for b in (8, 64, 256)]
    pts = [(f, predict(f, true)) for f in [*map(model.features, grid()), *after]]
    fitted, report = fit_profile(load_profile("h100"), pts)
    assert fitted.after_prompt_overhead_s == pytest.approx(700e-6, rel=1e-2)
    assert fitted.step_overhead_s == pytest.approx(1.5e-3, rel=1e-2)
    assert report.max_rel_error < 1e-3
    decode = model.rows_features([(1, 2048, True)] * 8)
    assert predict(after[0], true) - predict(decode, true) == pytest.approx(700e-6)
    prompt = model.rows_features([(256, 0, True)], follows_prompt=True)  # a prompt after a prompt: no refill
    assert predict(prompt, true) == predict(model.rows_features([(256, 0, True)]), true)
    assert fit_profile(load_profile("h100"), points(0.0))[0].after_prompt_overhead_s == 0.0
    assert predict(after[0], load_profile("h200")) == predict(decode, load_profile("h200"))


def test_the_simulated_device_prices_a_decode_after_a_prompt_step() -> None:
    """SimRunner knows the step before: a decode-only step after one with prompt rows pays
    the profile's after-prompt overhead, the next decode does not."""
    from types import SimpleNamespace

    from worker.sim.runner import SimRunner

    true = replace(TRUE, after_prompt_overhead_s=700e-6)
    runner = SimRunner(StepCostModel(load_shape("llama-3-8b"), true), 64, 16, 1000, sleep=False)

    def plan(*rows: tuple[int, int]) -> SimpleNamespace:
        seqs = [SimpleNamespace(num_computed_tokens=c, token_ids=list(range(c + n)), params=SimpleNamespace(
            logprobs=None, seed=None), sampler_state=None) for n, c in rows]
        return SimpleNamespace(seqs=seqs, num_new_tokens=[n for n, _ in rows], pending_inputs=False, draft_token_ids={})

    times = [runner.execute(p).forward_s for p in (plan((1, 100)), plan((64, 0), (1, 100)), plan((1, 64), (1, 101)),
                                                    plan((1, 65), (1, 102)))]
    assert times[2] - times[3] == pytest.approx(700e-6, rel=1e-3)


def test_fit_needs_enough_positive_points() -> None:
    with pytest.raises(ValueError, match="at least 8"):
        fit_profile(TRUE, points(0.0)[:3])
    bad = points(0.0)
    bad[0] = (bad[0][0], 0.0)
    with pytest.raises(ValueError, match="> 0"):
        fit_profile(TRUE, bad)


def test_calibrate_is_a_kvserve_command() -> None:
    args = build_parser().parse_args(["calibrate", "--name", "my-cpu", "--num-threads", "1"])
    assert (args.name, args.num_threads, args.model) == ("my-cpu", 1, None)


def test_calibrate_runs_the_real_engine_over_a_small_grid(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The embedded model on this CPU, a 2x2 decode grid, two chunk sizes and one mixed
    step (and the decode after it): every point is a real engine step of the asked shape,
    and the fitted profile is marked calibrated with what it was fitted on."""
    from cluster import calibrate

    monkeypatch.setattr(calibrate, "DECODE_BATCHES", (1, 3))
    monkeypatch.setattr(calibrate, "DECODE_CONTEXTS", (8, 40))
    monkeypatch.setattr(calibrate, "PREFILL_CHUNKS", (8, 24))
    monkeypatch.setattr(calibrate, "MIXED", ((24, 3, 40),))
    monkeypatch.setattr(calibrate, "NUM_REPEATS", 2)
    profile, report, points = calibrate.calibrate(None, "cpu-test", 1, 16)
    assert report.num_points == len(points) == 4 + 2 * calibrate.PREFILL_CHUNKS_PER_PROMPT + 2
    mixed = next(p for p in points if p.label == "mixed chunk=24 + decode b=3 ctx=40")
    assert (mixed.features.num_seqs, mixed.features.num_tokens) == (4, 27) and mixed.seconds > 0
    after = next(p for p in points if p.label == "decode b=3 ctx=40 after chunk=24")
    assert (after.features.num_seqs, after.features.num_tokens, after.features.follows_prompt) == (3, 3, True)
    decode = next(p for p in points if p.label == "decode b=3 ctx=40")
    assert (decode.features.num_seqs, decode.features.num_tokens) == (3, 3) and decode.seconds > 0
    chunk = next(p for p in points if p.label == "prefill chunk=24 ctx=48")
    assert (chunk.features.num_seqs, chunk.features.num_tokens) == (1, 24)
    assert profile.calibrated and profile.name == "cpu-test"
    assert profile.fit["dtype_bytes"] == 4 and profile.fit["num_points"] == report.num_points
    assert profile.fit["mean_rel_error"] == report.mean_rel_error
    path = tmp_path / "cpu.json"
    profile.save(path)
    assert load_profile(str(path)) == profile


def test_fit_recovers_attentions_own_efficiency() -> None:
    """A device whose attention runs far below its GEMMs' rate (the CPU backend's unfused
    attention): the fit finds both efficiencies; a device without a separate one gets
    attention at the GEMMs' rate."""
    true = replace(TRUE, attention_flops_efficiency=0.08)
    model = StepCostModel(load_shape("llama-3-8b"), true)
    pts = [(f, predict(f, true)) for f in map(model.features, grid())]
    fitted, report = fit_profile(load_profile("h100"), pts)
    assert fitted.attention_flops_efficiency == pytest.approx(0.08, rel=1e-2)
    assert fitted.flops_efficiency == pytest.approx(0.55, rel=1e-2)
    assert report.max_rel_error < 1e-3
    same, _ = fit_profile(load_profile("h100"), points(noise=0.0))
    assert same.attention_efficiency == pytest.approx(0.55, rel=1e-2)


def test_a_measurement_runs_one_plan_at_a_time_alternating_kinds(monkeypatch: pytest.MonkeyPatch) -> None:
    """What validation 1 spreads over its real run: the grid's plans one per call, decode,
    prefill and mixed in turn (every kind sampled across the whole stretch), then the rest;
    the fit of a finished measurement is calibrate's."""
    from cluster import calibrate

    monkeypatch.setattr(calibrate, "NUM_REPEATS", 2)
    spec = calibrate.GridSpec(decode_batches=(1, 3), decode_contexts=(8,), prefill_chunks=(8, 24),
                              mixed=((24, 3, 8),))
    measurement = calibrate.start_measurement(None, 1, 16, "process", spec)
    assert (len(measurement.tasks), measurement.progress, measurement.done) == (5, 0.0, False)
    for _ in range(3):
        measurement.measure_next()
    assert measurement.progress == pytest.approx(0.6)
    assert [p.label for p in measurement.points] == [
        "decode b=1 ctx=8", *(f"prefill chunk=8 ctx={8 * k}" for k in range(calibrate.PREFILL_CHUNKS_PER_PROMPT)),
        "mixed chunk=24 + decode b=3 ctx=8", "decode b=3 ctx=8 after chunk=24"]
    points = measurement.finish()
    assert measurement.done and len(points) == 4 + 2 * calibrate.PREFILL_CHUNKS_PER_PROMPT
    assert [p.label for p in points[-1 - calibrate.PREFILL_CHUNKS_PER_PROMPT:]][:2] == [
        "decode b=3 ctx=8", "prefill chunk=24 ctx=0"]
    profile, report, fitted_points = calibrate.fit_measurement(measurement, "cpu-beside")
    assert fitted_points == points and report.num_points == len(points)
    assert profile.calibrated and profile.name == "cpu-beside" and profile.fit["clock"] == "process"


def test_passes_pool_each_points_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two passes: the grid's plans twice, each with half of every point's steps, one point
    per label over both."""
    from cluster import calibrate

    monkeypatch.setattr(calibrate, "NUM_REPEATS", 2)
    monkeypatch.setattr(calibrate, "NUM_DECODE_STEPS", 4)
    spec = calibrate.GridSpec(decode_batches=(2,), decode_contexts=(8,), prefill_chunks=(8,), mixed=((8, 2, 8),),
                              passes=2)
    measurement = calibrate.start_measurement(None, 1, 16, "process", spec)
    assert len(measurement.tasks) == 6
    for _ in range(3):
        measurement.measure_next()
    assert {label: len(steps) for label, steps in measurement.grid.samples.items()} == {
        "decode b=2 ctx=8": 2, **{f"prefill chunk=8 ctx={8 * k}": 1 for k in range(4)},
        "mixed chunk=8 + decode b=2 ctx=8": 1, "decode b=2 ctx=8 after chunk=8": 1}
    points = measurement.finish()
    assert {label: len(steps) for label, steps in measurement.grid.samples.items()} == {
        "decode b=2 ctx=8": 4, **{f"prefill chunk=8 ctx={8 * k}": 2 for k in range(4)},
        "mixed chunk=8 + decode b=2 ctx=8": 2, "decode b=2 ctx=8 after chunk=8": 2}
    decode = measurement.grid.samples["decode b=2 ctx=8"]
    assert points[0].label == "decode b=2 ctx=8" and points[0].seconds == pytest.approx(
        sum(t for _, t in decode) / 4)  # the mean of both passes' steps


def test_decode_and_mixed_points_are_timed_past_the_batchs_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A live engine's decode and mixed steps follow decode steps, not a fresh batch's
    prefill: a decode point times its batch's steps from the (WARMUP_DECODE_STEPS + 1)th
    decode on, and a mixed point's first fresh prompt joins decodes that are that many
    steps past their prefill (each later one after a mixed step and a decode step). The
    timed steps' features say which steps they were: a decode's context is its prompt plus
    the tokens decoded before it."""
    from cluster import calibrate

    monkeypatch.setattr(calibrate, "NUM_REPEATS", 2)
    monkeypatch.setattr(calibrate, "NUM_DECODE_STEPS", 4)
    warm = calibrate.WARMUP_DECODE_STEPS
    assert warm > 0
    spec = calibrate.GridSpec(decode_batches=(1,), decode_contexts=(8,), prefill_chunks=(8,), mixed=((8, 2, 8),))
    measurement = calibrate.start_measurement(None, 1, 16, "process", spec)
    measurement.finish()
    samples, cost = measurement.grid.samples, measurement.grid.recorder.cost
    assert [f for f, _ in samples["decode b=1 ctx=8"]] == [cost.rows_features([(1, 8 + warm + k, True)])
                                                           for k in range(4)]
    mixed = [f for f, _ in samples["mixed chunk=8 + decode b=2 ctx=8"]]
    assert mixed == [cost.rows_features([(1, c, True), (1, c, True), (8, 0, True)]) for c in (8 + warm, 8 + warm + 2)]
    # The decode right after each mixed step, one token further, priced as following a prompt.
    after = [f for f, _ in samples["decode b=2 ctx=8 after chunk=8"]]
    assert after == [cost.rows_features([(1, c + 1, True), (1, c + 1, True)], follows_prompt=True)
                     for c in (8 + warm, 8 + warm + 2)]
    assert not any(f.follows_prompt for f in mixed) and not any(f.follows_prompt for f, _ in samples["decode b=1 ctx=8"])


def test_an_aged_pool_hands_out_every_block_in_a_seeded_order() -> None:
    """`age_pool`: the calibration's plans (and validation 1's real engine) take their KV
    blocks as a pool that has served a while hands them out, in no order, not a fresh
    pool's id order; every block stays free and the order is the seed's."""
    import random as stdlib_random

    from cluster.calibrate import age_pool
    from kv.block_pool import BlockPool

    pool = BlockPool(8)
    age_pool(pool, seed=3)
    assert pool.num_free_blocks == 8
    expected = list(range(8))
    stdlib_random.Random(3).shuffle(expected)
    assert [b.block_id for b in pool.allocate(8)] == expected != list(range(8))
