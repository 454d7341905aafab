"""The engine core with a fake runner: random load (arrivals, aborts, preemption) leaves no
block or request behind; request and sampling-parameter validation; a failing runner step."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from tests.support.fake_runner import EOS, VOCAB, FakeRunner
from tests.support.fault_runner import install_failing_runner
from worker.config import CacheConfig, SchedulerConfig
from worker.engine.core import Engine
from worker.api import RequestError
from worker.api import RequestOutput
from worker.api import (
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
    SamplingParamsError,
)


def make_engine(
    num_blocks: int = 256,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 128,
    runner: FakeRunner | None = None,
) -> Engine:
    runner = runner if runner is not None else FakeRunner(num_blocks, token=7)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len
    )
    runner.check_plans(config, block_size)
    return Engine(config, CacheConfig(block_size=block_size), runner, VOCAB, frozenset({EOS}))


def check_block_accounting(engine: Engine) -> None:
    """Every block's ref count equals the number of running block tables holding it;
    free blocks are exactly those with ref count 0; waiting sequences hold nothing."""
    pool = engine.kv.pool
    holders: Counter[int] = Counter()
    for seq in engine.scheduler.running:
        holders.update(engine.kv.block_ids(seq.request_id))
    for block in pool.blocks:
        assert block.ref_count == holders[block.block_id], block
    assert pool.num_free_blocks == sum(1 for b in pool.blocks if b.ref_count == 0)
    for seq in engine.scheduler.waiting:
        assert engine.kv.block_ids(seq.request_id) == []
        assert seq.num_computed_tokens == 0


def assert_clean(engine: Engine) -> None:
    assert engine.seqs == {}
    assert not engine.has_unfinished()
    assert engine.scheduler.running == [] and len(engine.scheduler.waiting) == 0
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    assert all(b.ref_count == 0 for b in engine.kv.pool.blocks)
    # no per-request bookkeeping left behind in the cache manager
    assert engine.kv._blocks == {} and engine.kv._tables == {}
    assert engine.kv._hashes == {} and engine.kv._num_registered == {}


# ---------------------------------------------------------------- random load


def run_random_load(
    num_requests: int, seed: int, num_blocks: int, max_model_len: int, max_num_batched_tokens: int
) -> Engine:
    rng = random.Random(seed)
    runner = FakeRunner(num_blocks, token=None, seed=seed + 1, eos_prob=0.03)
    engine = make_engine(
        num_blocks=num_blocks,
        max_num_seqs=12,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        runner=runner,
    )
    # A few shared prefixes so that prefix-cache hits and shared blocks happen.
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 17))] for _ in range(4)]

    abort_at: dict[str, int] = {}  # request id -> step at which to abort it
    streams: dict[str, list[RequestOutput]] = {}
    max_tokens_of: dict[str, int] = {}
    num_added = 0
    num_steps = 0
    num_aborted = 0
    while num_added < num_requests or engine.has_unfinished():
        # arrivals, in bursts while the queue is short (so that aborts hit running, waiting
        # and preempted requests alike)
        burst = rng.choice([0, 1, 1, 2, 3]) if engine.scheduler.num_waiting < 3 else 0
        for _ in range(min(burst, num_requests - num_added)):
            rid = f"req-{num_added}"
            num_added += 1
            prompt_len = rng.randrange(1, max_model_len // 2)
            prompt = [rng.randrange(3, VOCAB) for _ in range(prompt_len)]
            if rng.random() < 0.4:
                prompt = (rng.choice(prefixes) + prompt)[: max_model_len - 1]
            max_tokens = rng.randrange(1, max_model_len)
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=rng.random() < 0.3)
            engine.add_request(rid, prompt, params)
            max_tokens_of[rid] = max_tokens
            streams[rid] = []
            if rng.random() < 0.2:
                abort_at[rid] = num_steps + rng.randrange(0, 30)
        # aborts due now (the request may have finished already)
        for rid, at in list(abort_at.items()):
            if at <= num_steps:
                del abort_at[rid]
                out = engine.abort_request(rid)
                if out is not None:
                    num_aborted += 1
                    assert out.finished and out.finish_reason == "abort"
                    streams[rid].append(out)
                    assert rid not in engine.seqs
                    assert engine.kv.block_ids(rid) == []
        for out in engine.step():
            streams[out.request_id].append(out)
        num_steps += 1
        check_block_accounting(engine)
        assert num_steps < 50 * num_requests, "no progress"

    assert num_added == num_requests
    # Every request ended exactly once, with its last update, and never overran max_tokens.
    reasons: Counter[str] = Counter()
    for rid, outs in streams.items():
        assert outs, rid
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True], rid
        last = outs[-1]
        reasons[last.finish_reason] += 1
        num_tokens = sum(len(o.new_token_ids) for o in outs)
        assert num_tokens == last.num_output_tokens or last.finish_reason == "abort"
        assert num_tokens <= max_tokens_of[rid]
        if last.finish_reason == "length":
            assert last.num_output_tokens == max_tokens_of[rid] or (
                last.num_prompt_tokens + last.num_output_tokens == max_model_len
            )
    assert set(reasons) <= {"stop", "length", "abort"}
    assert reasons["abort"] == num_aborted
    assert 0.05 * num_requests < num_aborted < 0.25 * num_requests
    assert sum(reasons.values()) == num_requests
    return engine


def test_random_load_roomy_pool_leaves_nothing_behind() -> None:
    engine = run_random_load(500, seed=1, num_blocks=256, max_model_len=64, max_num_batched_tokens=48)
    assert_clean(engine)
    assert engine.kv.stats().prefix_cache_hits > 0
    assert engine.scheduler.num_preemptions == 0


def test_random_load_tiny_pool_preempts_and_leaves_nothing_behind() -> None:
    # 12 blocks of 4 = 48 tokens = max_model_len: one max-length request fills the pool.
    engine = run_random_load(500, seed=2, num_blocks=12, max_model_len=48, max_num_batched_tokens=32)
    assert_clean(engine)
    assert engine.scheduler.num_preemptions > 20


def test_engine_step_with_nothing_to_do() -> None:
    engine = make_engine()
    assert engine.step() == []
    assert engine.counters.num_steps == 0
    assert engine.abort_request("nope") is None


# ---------------------------------------------------------------- request validation


def test_validate_rejects_bad_requests() -> None:
    engine = make_engine(num_blocks=8, block_size=4, max_model_len=32)  # pool: 32 tokens
    ok = SamplingParams(max_tokens=4)
    with pytest.raises(RequestError, match="empty"):
        engine.validate([], ok)
    with pytest.raises(RequestError, match="max_model_len"):
        engine.validate([5] * 32, ok)  # == max_model_len
    with pytest.raises(RequestError, match="max_model_len"):
        engine.validate([5] * 40, ok)
    engine.validate([5] * 31, SamplingParams(max_tokens=1))  # one output token fits
    with pytest.raises(RequestError, match=r"\[0, 64\)"):
        engine.validate([5, VOCAB], ok)
    with pytest.raises(RequestError, match=r"\[0, 64\)"):
        engine.validate([-1, 5], ok)
    engine.validate([0, VOCAB - 1], ok)
    with pytest.raises(RequestError, match="stop_token_ids"):
        engine.validate([5], SamplingParams(stop_token_ids=(VOCAB,)))
    assert issubclass(RequestError, ValueError)
    assert engine.seqs == {}


def test_validate_rejects_request_needing_more_blocks_than_the_pool() -> None:
    engine = make_engine(num_blocks=8, block_size=4, max_model_len=128)  # pool: 32 tokens
    with pytest.raises(RequestError, match="needs 10 KV blocks but the pool has 8"):
        engine.validate([5] * 10, SamplingParams(max_tokens=30))  # 40 tokens
    engine.validate([5] * 10, SamplingParams(max_tokens=22))  # 32 tokens: exactly the pool
    with pytest.raises(RequestError, match="needs 9 KV blocks"):
        engine.add_request("big", [5] * 10, SamplingParams(max_tokens=23))
    assert "big" not in engine.seqs
    assert not engine.has_unfinished()
    # A request the pool fits exactly is served to the end (no deadlock).
    engine.add_request("fits", [5] * 10, SamplingParams(max_tokens=22, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert outs[-1].finished and outs[-1].num_output_tokens == 22
    assert_clean(engine)


def test_add_request_duplicate_id_rejected() -> None:
    engine = make_engine()
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("a", [4, 5], SamplingParams(max_tokens=2))
    assert engine.seqs["a"].token_ids == [1, 2, 3]
    assert engine.abort_request("a").finish_reason == "abort"  # type: ignore[union-attr]
    assert_clean(engine)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1.0},
        {"temperature": 2.5},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"min_p": 1.5},
        {"max_tokens": 0},
        {"seed": -1},
        {"repetition_penalty": 0.0},
        {"presence_penalty": 3.0},
        {"frequency_penalty": -3.0},
        {"logprobs": MAX_LOGPROBS + 1},
        {"logprobs": -1},
        {"stop": tuple(f"s{i}" for i in range(MAX_STOP_STRINGS + 1))},
        {"stop": ("",)},
        {"stop": ("x" * 257,)},
        {"stop_token_ids": tuple(range(MAX_STOP_TOKEN_IDS + 1))},
        {"stop_token_ids": (-1,)},
        {"min_tokens": 5, "max_tokens": 4},
    ],
)
def test_sampling_params_rejects_out_of_range(kwargs: dict) -> None:
    with pytest.raises(SamplingParamsError):
        SamplingParams(**kwargs)


def test_sampling_params_accepts_edges() -> None:
    SamplingParams(temperature=0.0, top_p=1.0, logprobs=MAX_LOGPROBS, min_tokens=16, max_tokens=16)
    SamplingParams(temperature=2.0, top_p=1e-6, logprobs=0, stop=tuple(f"s{i}" for i in range(MAX_STOP_STRINGS)))
    SamplingParams(stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS)), seed=2**63 - 1)
    assert issubclass(SamplingParamsError, ValueError)


# ---------------------------------------------------------------- a failing runner step


def test_failing_step_fails_only_its_requests() -> None:
    engine = make_engine(num_blocks=64, max_num_seqs=2, runner=FakeRunner(64, token=7))
    runner = install_failing_runner(engine, fail_on_step=None, message="boom")
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    engine.add_request("a", [1, 2, 3, 4, 5], params)
    engine.add_request("b", [6, 7, 8], params)
    engine.add_request("c", [9, 10], params)  # waits: max_num_seqs=2
    first = engine.step()
    assert [o.request_id for o in first] == ["a", "b"]
    assert engine.kv.num_free_blocks == 64 - 2 - 1

    runner.fail_on_step = 2
    failed = engine.step()
    assert [o.request_id for o in failed] == ["a", "b"]
    for o in failed:
        assert o.finished
        assert o.finish_reason == "error"
        assert o.error == "engine step failed: RuntimeError: boom"
        assert o.new_token_ids == []
        assert o.num_output_tokens == 1
    assert "a" not in engine.seqs and "b" not in engine.seqs
    assert engine.kv.block_ids("a") == [] and engine.kv.block_ids("b") == []
    assert engine.kv.num_free_blocks == 64
    assert engine.scheduler.running == []
    assert [s.request_id for s in engine.scheduler.waiting] == ["c"]

    # The engine keeps serving: c (queued before) and d (added after) run to the end.
    engine.add_request("d", [11, 12, 13], params)
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    assert sorted(outs) == ["c", "d"]
    for rid in ("c", "d"):
        assert [t for o in outs[rid] for t in o.new_token_ids] == [7] * 5
        assert outs[rid][-1].finish_reason == "length"
        assert all(o.error is None for o in outs[rid])
    assert_clean(engine)


def test_failing_first_step_of_a_chunked_prefill() -> None:
    engine = make_engine(num_blocks=64, max_num_batched_tokens=8, runner=FakeRunner(64, token=7))
    install_failing_runner(engine, fail_on_step=1, message="boom")
    engine.add_request("a", list(range(3, 23)), SamplingParams(max_tokens=3))  # 20 tokens: 3 chunks
    (out,) = engine.step()
    assert out.finish_reason == "error" and out.num_output_tokens == 0
    assert_clean(engine)
    engine.add_request("a", list(range(3, 23)), SamplingParams(max_tokens=3))  # id reusable
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert [t for o in outs for t in o.new_token_ids] == [7, 7, 7]
    assert_clean(engine)
