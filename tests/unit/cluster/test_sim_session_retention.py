"""KV kept across tool pauses in the simulator (cluster/sim/): the simulated engines run the
real retention (kv/retention.py) on the virtual clock, and the headroom router sends a
session's next turn to the replica that holds its retained prefix, even through another
ingress router that never saw the session (the replicas' KV events show it)."""
from __future__ import annotations

import numpy as np

from cluster.sim.run import SimConfig, simulate
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


def test_agentic_tool_pauses_are_drawn_between_turns() -> None:
    reqs = make_workload("agentic", 48, 2.0, 3, pause_s=(1.0, 120.0))
    by_session: dict[str, list[SimRequest]] = {}
    for r in reqs:
        by_session.setdefault(r.session_id or "", []).append(r)
    gaps = [b.arrival_s - a.arrival_s for turns in by_session.values() for a, b in zip(turns, turns[1:])]
    assert gaps and all(1.0 <= g <= 120.0 for g in gaps)
    assert min(gaps) < 10.0 < max(gaps)  # seconds to minutes
