"""The ideal partition's pieces (benchmarks/routing/partition.py): sessions dealt to
replicas in order of first arrival, and the replicas' simulations merged into one result."""
from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.routing.partition import deal_shares, merge_results
from benchmarks.routing.setup import HEADROOM, sim_config
from cluster.sim.run import simulate
from cluster.sim.setup import SimDevice
from cluster.workload.sim_kinds import SimRequest, make_workload


def req(request_id: str, t: float, session: str | None) -> SimRequest:
    return SimRequest(request_id, t, (1, 2, 3), 4, session_id=session)


def test_sessions_are_dealt_round_robin_by_first_arrival_and_stay_put() -> None:
    requests = [req("d", 5.0, "D"), req("a2", 2.0, "A"), req("b", 1.0, "B"), req("a0", 0.0, "A"),
                req("c", 3.0, "C"), req("x", 4.0, None), req("b2", 6.0, "B")]
    shares = deal_shares(requests, 2)
    assert [[r.request_id for r in share] for share in shares] == [["a0", "a2", "c", "d"], ["b", "x", "b2"]]
    assert deal_shares(requests, 8)[7] == []  # more replicas than sessions: some shares stay empty


def test_merged_result_covers_every_share() -> None:
    config = replace(sim_config(HEADROOM, 1), seed=0)
    device = SimDevice.from_config(config)
    requests = make_workload("agentic", 24, 4.0, 0)
    shares = deal_shares(requests, 2)
    results = [simulate(config, share, device) for share in shares]
    merged = merge_results(results)
    summary = merged.summary()
    assert summary["num_requests"] == len(requests) == sum(len(s) for s in shares)
    assert len(merged.itl) == sum(len(r.itl) for r in results)
    assert summary["output_tokens"] == sum(r.summary()["output_tokens"] for r in results)
    busy = [r.replicas[0].busy_s for r in results]
    assert summary["load_imbalance"] == pytest.approx(max(busy) / (sum(busy) / 2))
    # Every turn of a session ran on the replica its session was dealt to.
    for share, result in zip(shares, results):
        assert {rec.request_id for rec in result.records} == {r.request_id for r in share}
