"""The simulated device's runner under the real engine: deterministic tokens, token-exact
continuation after a migration, KV sizing, the modelled step time, and its sleep."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from worker.default_model import default_model_path
from worker.engine.core import Engine
from worker.api import SamplingParams
from worker.sim import runner as sim_runner
from worker.costs.cost_model import SeqWork, StepCostModel
from worker.costs.profiles import load_profile
from worker.sim.device import parse_sim_device
from worker.sim.build import build_sim_engine
from worker.sim.runner import SimRunner, history_hash
from worker.costs.shapes import load_shape
from worker.engine.build import build_engine

SCHED = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=4096)


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    """Add every request, step until all finish; each request's output tokens."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return out


def prompts(seed: int, n: int = 6) -> dict[str, tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    return {f"r{i}": ([rng.randrange(128000) for _ in range(rng.randrange(5, 150))],
                      SamplingParams(max_tokens=rng.randrange(1, 40))) for i in range(n)}


def test_history_hash_is_the_same_incremental_bulk_or_from_scratch() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(150000) for _ in range(300)]
    whole = history_hash(tokens)
    for split in (0, 1, 31, 32, 33, 200, 299, 300):
        assert history_hash(tokens, split, history_hash(tokens[:split])) == whole
    state = 0
    for t in tokens:  # one token at a time, as decode steps add them
        state = (state * 0x100000001B3 + t + 1) % 2**64
    assert state == whole


def test_token_is_mix64_of_the_history_hash_and_the_seed() -> None:
    """next_token inlines _mix64: it must stay the function the docstring names."""
    from worker.sequence import Sequence

    runner = SimRunner(StepCostModel(load_shape("llama-3-8b"), load_profile("h200")), 64, 16, 128000)
    rng = random.Random(3)
    for seed in (None, 0, 7):
        seq = Sequence("r", [rng.randrange(128000) for _ in range(40)], SamplingParams(seed=seed))
        for _ in range(5):  # from scratch, then incremental
            state = history_hash(seq.token_ids)
            x = state if seed is None else state ^ sim_runner._mix64(seed + 1)
            token = runner.next_token(seq)
            assert token == sim_runner._mix64(x) % 128000
            seq.token_ids.append(token)


def test_same_requests_same_tokens_and_eos_never_sampled() -> None:
    a = run(build_sim_engine("llama-3-8b", "h200", SCHED), prompts(1))
    b = run(build_sim_engine("llama-3-8b", "h100", replace(SCHED, max_num_batched_tokens=16)), prompts(1))
    assert a == b  # another device and another chunking: tokens are a function of the history
    assert all(len(v) == prompts(1)[k][1].max_tokens for k, v in a.items())  # never stopped by EOS
    small = build_sim_engine("llama-3-8b", "h200", SCHED, token_vocab_size=4, eos_token_ids=frozenset({1, 2}))
    tokens = run(small, {"x": ([5, 6, 7], SamplingParams(max_tokens=50))})["x"]
    assert set(tokens) <= {0, 3} and len(tokens) == 50


def test_migrated_request_continues_token_for_token() -> None:
    """The ingress resumes a request on another replica with prompt + streamed tokens."""
    prompt = list(range(1000, 1100))
    full = run(build_sim_engine("llama-3-8b", "h200", SCHED), {"r": (prompt, SamplingParams(max_tokens=30))})["r"]
    for streamed in (1, 7, 29):
        resumed = run(build_sim_engine("llama-3-8b", "a100-80gb", SCHED),
                      {"r": (prompt + full[:streamed], SamplingParams(max_tokens=30 - streamed))})["r"]
        assert resumed == full[streamed:]


def test_seed_selects_a_stream_reproducibly() -> None:
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    engine = build_sim_engine("llama-3-8b", "h200", SCHED)
    out = run(engine, {f"s{seed}-{k}": (prompt, SamplingParams(max_tokens=10, seed=seed))
                       for seed in (None, 1, 2) for k in range(2)})
    assert out["s1-0"] == out["s1-1"] and out["s2-0"] == out["s2-1"] and out["sNone-0"] == out["sNone-1"]
    assert len({tuple(out["sNone-0"]), tuple(out["s1-0"]), tuple(out["s2-0"])}) == 3


def test_modelled_time_is_the_cost_models_and_logprobs_are_uniform() -> None:
    engine = build_sim_engine("llama-3-8b", "h200", SCHED)
    cost = StepCostModel(load_shape("llama-3-8b"), load_profile("h200"))
    engine.add_request("a", list(range(100)), SamplingParams(max_tokens=3, logprobs=2))
    plan_time = cost.step_time_s([SeqWork(64, 0, False)])  # first chunk of 64
    outputs = engine.step()
    assert outputs == [] and engine.runner.last_step_s == pytest.approx(plan_time)
    outputs = engine.step()  # the rest of the prompt: samples, with logprobs
    lp = outputs[0].logprobs[0]
    assert lp.token_id == outputs[0].new_token_ids[0] and len(lp.top) == 2
    assert lp.logprob == pytest.approx(-11.76, abs=0.01)  # log(1 / 128256)
    assert engine.runner.num_steps == 2


def test_kv_blocks_from_device_memory_unless_given() -> None:
    engine = build_sim_engine("llama-3-8b", "h200", SCHED)
    assert engine.kv.num_total_blocks == 52_852  # (0.9 * 141 GB - 16.06 GB) / 2 MiB per block
    engine = build_sim_engine("llama-3-8b", "h200", SCHED, CacheConfig(gpu_memory_utilization=0.5))
    assert engine.kv.num_total_blocks == int((0.5 * 141e9 - 8_030_261_248 * 2) // (16 * 131072))
    engine = build_sim_engine("llama-3-8b", "h200", SCHED, CacheConfig(num_blocks_override=100))
    assert engine.kv.num_total_blocks == 100
    assert build_sim_engine("llama-3-8b", "h200", replace(SCHED, max_model_len=100_000)).max_model_len == 8192


class FakeClock:
    """Stands in for the runner's `time` module: perf_counter reads it, sleep advances it."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_sleep_waits_dilated_time_less_the_engines_own_host_work(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(sim_runner, "time", clock)
    profile = replace(load_profile("h200"), step_overhead_s=2e-3)
    engine = build_sim_engine("llama-3-8b", profile, SCHED, sleep=True, time_dilation=10.0)
    runner = engine.runner
    assert isinstance(runner, SimRunner)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=5))
    engine.step()
    assert clock.sleeps == [pytest.approx(runner.last_step_s * 10)]  # no previous step: all of it
    clock.now += 5e-3  # the engine's host work between steps (update, outputs, schedule)
    engine.step()
    assert clock.sleeps[-1] == pytest.approx(runner.last_step_s * 10 - 5e-3)
    clock.now += 1.0  # idle far longer than the modelled host overhead: only that is taken off
    engine.step()
    overhead = runner.cost.overhead_s(runner.cost.features([SeqWork(1, 4)]))
    assert clock.sleeps[-1] == pytest.approx((runner.last_step_s - overhead) * 10)


def test_engine_from_config_on_a_sim_device_reads_no_weights() -> None:
    config = EngineConfig(
        model=ModelConfig(model=default_model_path(), device="sim:h200", model_shape="llama-3-8b"),
        scheduler=SCHED,
    )
    engine = build_engine(config)
    assert isinstance(engine.runner, SimRunner) and str(engine.model_path) == default_model_path()
    assert engine.vocab_size == 128256 and engine.runner.vocab_size == 1460  # the tokenizer's ids
    assert {1, 128001, 128009} <= engine.eos_token_ids  # the tokenizer's EOS and the shape's
    tokens = run(engine, {"a": ([5, 6, 7], SamplingParams(max_tokens=40))})["a"]
    assert len(tokens) == 40 and max(tokens) < 1460 and 1 not in tokens
    assert parse_sim_device("cuda") is None and parse_sim_device("sim:/p.json") == "/p.json"
    with pytest.raises(ValueError, match="names a profile"):
        parse_sim_device("sim:")
