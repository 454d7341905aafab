"""The simulator's workloads: seeded, the advertised shapes, prefixes really shared."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from cluster.workload.sim_kinds import (
    B2B_PREFIX_LEN,
    CODE_REPO_LEN,
    MOONCAKE_BLOCK_TOKENS,
    SimRequest,
    make_workload,
)


def test_same_seed_same_workload_other_seed_differs() -> None:
    for kind in ("sharegpt", "b2b", "agentic", "code", "bursty"):
        a = make_workload(kind, 50, 5.0, seed=3)
        assert a == make_workload(kind, 50, 5.0, seed=3)
        assert a != make_workload(kind, 50, 5.0, seed=4)
        assert len(a) == 50
        assert [r.arrival_s for r in a] == sorted(r.arrival_s for r in a)
        assert len({r.request_id for r in a}) == 50


def test_sharegpt_lengths_follow_the_published_means_with_a_long_tail() -> None:
    reqs = make_workload("sharegpt", 4000, 10.0, seed=0)
    inputs = np.array([len(r.prompt_token_ids) for r in reqs])
    outputs = np.array([r.max_tokens for r in reqs])
    assert 255 < inputs.mean() < 345 and 170 < outputs.mean() < 230
    assert np.median(inputs) < 0.8 * inputs.mean()  # skewed: a long tail
    assert np.percentile(inputs, 99) > 4 * inputs.mean()
    # Poisson at 10/s
    gaps = np.diff([r.arrival_s for r in reqs])
    assert 0.09 < gaps.mean() < 0.11 and 0.9 < gaps.std() / gaps.mean() < 1.1
    # no deliberate sharing: first blocks all differ
    assert len({r.prompt_token_ids[:16] for r in reqs if len(r.prompt_token_ids) >= 16}) == sum(
        len(r.prompt_token_ids) >= 16 for r in reqs)


def test_b2b_requests_share_their_group_prefix_and_differ_after_it() -> None:
    reqs = make_workload("b2b", 200, 10.0, seed=1, num_groups=4)
    groups: dict[str, list[SimRequest]] = {}
    for r in reqs:
        groups.setdefault(r.session_id, []).append(r)
    assert len(groups) == 4
    prefixes = set()
    for members in groups.values():
        heads = {m.prompt_token_ids[:B2B_PREFIX_LEN] for m in members}
        assert len(heads) == 1
        prefixes |= heads
        assert len({m.prompt_token_ids[B2B_PREFIX_LEN:] for m in members}) == len(members)
    assert len(prefixes) == 4


def test_agentic_turns_resend_the_growing_history() -> None:
    reqs = make_workload("agentic", 40, 4.0, seed=2, turns=5)
    sessions: dict[str, list[SimRequest]] = {}
    for r in reqs:
        sessions.setdefault(r.session_id, []).append(r)
    assert len(sessions) == 8
    for turns in sessions.values():
        turns.sort(key=lambda r: int(r.request_id.rsplit("-", 1)[1]))
        for prev, nxt in itertools.pairwise(turns):
            assert nxt.arrival_s >= prev.arrival_s
            # history = previous prompt + its answer + the new message
            assert nxt.prompt_token_ids[: len(prev.prompt_token_ids)] == prev.prompt_token_ids
            assert len(nxt.prompt_token_ids) > len(prev.prompt_token_ids) + prev.max_tokens


def test_agentic_warmup_turns_put_sessions_in_flight_before_the_measured_window() -> None:
    """warmup_s: turns before it are warm-up; n counts the measured ones; with warmup_s 0 the
    workload is the one it always was (the same draws)."""
    plain = make_workload("agentic", 60, 6.0, seed=4, turns=6)
    assert plain == make_workload("agentic", 60, 6.0, seed=4, turns=6, warmup_s=0.0)
    reqs = make_workload("agentic", 60, 6.0, seed=4, turns=6, warmup_s=5.0)
    measured = [r for r in reqs if not r.warmup]
    warm = [r for r in reqs if r.warmup]
    assert len(measured) == 60 and warm
    assert all(r.arrival_s < 5.0 for r in warm) and all(r.arrival_s >= 5.0 for r in measured)
    # Some measured turns continue sessions that started in the warm-up (a later turn).
    warm_sessions = {r.session_id for r in warm}
    assert any(r.session_id in warm_sessions for r in measured)


def test_code_prompts_are_long_outputs_short() -> None:
    reqs = make_workload("code", 100, 1.0, seed=0)
    inputs = np.array([len(r.prompt_token_ids) for r in reqs])
    outputs = np.array([r.max_tokens for r in reqs])
    assert inputs.min() > CODE_REPO_LEN and inputs.mean() > 20000
    assert outputs.mean() < 150


def test_bursty_arrivals_are_burstier_than_poisson_at_the_same_mean_rate() -> None:
    reqs = make_workload("bursty", 4000, 10.0, seed=0)
    gaps = np.diff([r.arrival_s for r in reqs])
    assert 0.08 < gaps.mean() < 0.12
    assert gaps.std() / gaps.mean() > 2.0  # Poisson would give 1


def test_trace_replays_timestamps_lengths_and_shared_hash_blocks(tmp_path) -> None:
    path = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 1000, "input_length": 1100, "output_length": 20, "hash_ids": [7, 8, 9]},
        {"timestamp": 1500, "input_length": 700, "output_length": 5, "hash_ids": [7, 10]},
        {"timestamp": 4000, "input_length": 600, "output_length": 1, "hash_ids": [11, 12]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    reqs = make_workload("trace", 10, 0.0, seed=0, path=str(path))
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 3.0]
    assert [len(r.prompt_token_ids) for r in reqs] == [1100, 700, 600]
    assert [r.max_tokens for r in reqs] == [20, 5, 1]
    b = MOONCAKE_BLOCK_TOKENS
    assert reqs[0].prompt_token_ids[:b] == reqs[1].prompt_token_ids[:b]  # hash id 7
    assert reqs[0].prompt_token_ids[b:2 * b] != reqs[1].prompt_token_ids[b:2 * b]
    assert reqs[2].prompt_token_ids[:b] != reqs[0].prompt_token_ids[:b]
    assert make_workload("trace", 2, 0.0, seed=0, path=str(path)) == reqs[:2]


def test_bad_arguments_are_clear_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("nope", 1, 1.0, 0)
    with pytest.raises(ValueError, match="rate_rps"):
        make_workload("sharegpt", 1, 0.0, 0)
    with pytest.raises(ValueError, match="path="):
        make_workload("trace", 1, 1.0, 0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        make_workload("trace", 1, 1.0, 0, path=str(bad))


def test_b2b_warm_up_answers_can_be_capped_without_changing_anything_else() -> None:
    """warmup_max_tokens caps only the warm-up requests' max_tokens: same prompts, times,
    measured requests (the draws are the same)."""
    full = make_workload("b2b", 30, 5.0, seed=2, num_groups=6, prefix_len=64, question_len=16, warmup_s=3.0)
    capped = make_workload("b2b", 30, 5.0, seed=2, num_groups=6, prefix_len=64, question_len=16, warmup_s=3.0,
                           warmup_max_tokens=4)
    assert [r for r in full if not r.warmup] == [r for r in capped if not r.warmup]
    warm_full, warm_capped = [r for r in full if r.warmup], [r for r in capped if r.warmup]
    assert len(warm_capped) == 6
    assert [(r.prompt_token_ids, r.arrival_s) for r in warm_full] == [(r.prompt_token_ids, r.arrival_s) for r in warm_capped]
    assert [r.max_tokens for r in warm_capped] == [min(r.max_tokens, 4) for r in warm_full]
    assert max(r.max_tokens for r in warm_full) > 4
