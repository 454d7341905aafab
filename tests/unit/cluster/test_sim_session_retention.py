"""KV kept across tool pauses in the simulator (cluster/sim/): the simulated engines run the
real retention (kv/retention.py) on the virtual clock, and the headroom router sends a
session's next turn to the replica that holds its retained prefix, even through another
ingress router that never saw the session (the replicas' KV events show it). Tool pauses
run closed loop (cluster/sim/follow_ups.py), and the answer a turn re-sends is the one the
simulated engine gave (cluster/sim/answers.py)."""
from __future__ import annotations

import numpy as np

from cluster.sim.answers import engine_answers
from cluster.sim.run import simulate
from cluster.sim.setup import SimConfig, SimDevice
from cluster.workload.sim_kinds import SimRequest, make_workload

BLOCK = 16
FIRST_LEN = 2048


def _requests() -> list[SimRequest]:
    rng = np.random.default_rng(5)
    first = tuple(int(t) for t in rng.integers(1, 32000, FIRST_LEN))
    out = [SimRequest("turn1", 0.0, first, 16, session_id="s")]
    for i in range(20):  # other clients' cold prompts while the session's tool runs
        prompt = tuple(int(t) for t in rng.integers(1, 32000, 1024))
        out.append(SimRequest(f"cold{i}", 5.0 + 2.5 * i, prompt, 16))
    later = first + tuple(int(t) for t in rng.integers(1, 32000, 528))  # answer + tool result
    out.append(SimRequest("turn2", 60.0, later, 16, session_id="s"))  # index 21: the other router
    return out


def _config(ttl_s: float) -> SimConfig:
    return SimConfig(num_replicas=2, num_ingress=2, router="headroom", num_blocks=256, block_size=BLOCK,
                     session_kv_ttl_s=ttl_s, seed=0)


def test_next_turn_goes_where_its_retained_prefix_is_and_hits() -> None:
    result = simulate(_config(300.0), _requests())
    by_id = {r.request_id: r for r in result.records}
    first, later = by_id["turn1"], by_id["turn2"]
    assert later.replica_keys == first.replica_keys  # the replica holding the prefix
    assert later.num_cached_tokens == FIRST_LEN  # every full block of turn 1
    assert all(r.error is None for r in result.records)


def test_without_retention_lru_loses_the_prefix_over_the_pause() -> None:
    result = simulate(_config(0.0), _requests())
    later = {r.request_id: r for r in result.records}["turn2"]
    assert later.num_cached_tokens < FIRST_LEN


def test_agentic_tool_pauses_follow_each_answer() -> None:
    reqs = make_workload("agentic", 48, 2.0, 3, pause_s=(1.0, 120.0), turns=4, system_len=256, turn_len=64)
    by_session: dict[str, list[SimRequest]] = {}
    for r in reqs:
        by_session.setdefault(r.session_id or "", []).append(r)
    pairs = [(a, b) for turns in by_session.values() for a, b in zip(turns, turns[1:])]
    assert pairs and all(b.after == a.request_id and 1.0 <= b.pause_s <= 120.0 for a, b in pairs)
    assert min(b.pause_s for _, b in pairs) < 10.0 < max(b.pause_s for _, b in pairs)  # seconds to minutes
    # Closed loop: each later turn arrives its pause after the previous turn finished.
    result = simulate(SimConfig(num_replicas=2, router="headroom", seed=0), reqs)
    rec = {r.request_id: r for r in result.records}
    for a, b in pairs:
        assert rec[b.request_id].arrival_s == rec[a.request_id].finish_s + b.pause_s


def test_a_re_sent_answer_is_the_engines_own_and_hits() -> None:
    config = SimConfig(num_replicas=1, router="headroom", block_size=BLOCK, seed=0)
    answer = engine_answers(SimDevice.from_config(config))
    rng = np.random.default_rng(9)
    first = tuple(int(t) for t in rng.integers(1, 32000, 1000))
    n = 40
    later = first + answer(first, n) + tuple(int(t) for t in rng.integers(1, 32000, 200))
    reqs = [SimRequest("t1", 0.0, first, n, session_id="s"),
            SimRequest("t2", 5.0, later, 8, session_id="s", after="t1", pause_s=5.0)]
    rec = {r.request_id: r for r in simulate(config, reqs).records}
    # Every full block of turn 1's prompt and answer (its last token is never computed).
    assert rec["t2"].num_cached_tokens == (len(first) + n - 1) // BLOCK * BLOCK
