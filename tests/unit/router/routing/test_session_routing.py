"""Sessions in the headroom ranking: the session table's counts (router/routing/sessions.py), new
sessions spread by them, and the load gate's move cost (router/routing/scoring.py), without Ray."""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest

from kv.block_hash import hash_full_blocks
from router.routing.types import ReplicaView, RequestProfile
from router.routing.policies.base import RoutingRequest
from router.routing.policies.headroom import HeadroomPolicy
from router.routing.scoring import Ranking, move_costs, score_replica
from router.routing.policies.headroom import MODE_AFFINITY, MODE_HEADROOM, MODE_LOAD_GATE, MODE_SPREAD, RankContext, rank_replicas
from router.routing.reservations import ReservationLedger
from router.routing.routing_view import LocalRoutingView
from router.routing.sessions import MAX_SESSION_ID_CHARS, SessionTable, client_session_id
from tests.unit.router.routing.test_headroom_policy import BS, NOW, PARAMS, report, views_for


# ---------------------------------------------------------------- the session table


def test_session_table_counts_each_session_on_its_last_replica() -> None:
    table = SessionTable(idle_s=10.0)
    table.touch("s1", "a", 0.0)
    table.touch("s2", "a", 1.0)
    table.touch("s3", "b", 2.0)
    assert dict(table.active_counts(2.0)) == {"a": 2, "b": 1}
    table.touch("s1", "b", 3.0)  # s1's next turn went to b: it moves, it is not counted twice
    assert dict(table.active_counts(3.0)) == {"a": 1, "b": 2}
    assert table.replica_of("s1") == "b" and table.replica_of("nope") is None


def test_sessions_idle_longer_than_idle_s_expire_oldest_first() -> None:
    table = SessionTable(idle_s=10.0)
    table.touch("s1", "a", 0.0)
    table.touch("s2", "b", 5.0)
    table.touch("s1", "a", 8.0)  # a turn refreshes s1
    assert dict(table.active_counts(15.5)) == {"a": 1}  # s2 last seen 10.5 s ago
    assert table.replica_of("s2") is None and len(table) == 1
    assert dict(table.active_counts(18.5)) == {}
    assert len(table) == 0


def test_session_table_is_bounded_least_recently_used_first() -> None:
    table = SessionTable(idle_s=100.0, max_sessions=2)
    for i, replica in enumerate("abc"):
        table.touch(f"s{i}", replica, float(i))
    assert len(table) == 2 and table.replica_of("s0") is None
    assert dict(table.active_counts(3.0)) == {"b": 1, "c": 1}
    with pytest.raises(ValueError):
        SessionTable(idle_s=0.0)


def test_the_client_names_its_session_by_header_else_user() -> None:
    assert client_session_id("s-1", "alice") == "s-1"
    assert client_session_id(None, "alice") == client_session_id("", "alice") == "alice"
    assert client_session_id(None, None) is None and client_session_id("", "") is None
    long = "x" * (MAX_SESSION_ID_CHARS + 1)
    digest = client_session_id(long, None)
    assert digest is not None and digest.startswith("sha256:") and len(digest) == 7 + 64
    assert digest == client_session_id(None, long) != client_session_id(None, long + "y")
    assert client_session_id("x" * MAX_SESSION_ID_CHARS, None) == "x" * MAX_SESSION_ID_CHARS


# ---------------------------------------------------------------- spread


def session_request(i: int, prefix: list[int] | None = None) -> RequestProfile:
    return RequestProfile(prompt_token_ids=(prefix or []) + [2000 + i] * 40, max_tokens=8)


def test_a_new_session_goes_where_the_fewest_sessions_are() -> None:
    # "a" has the most headroom; by headroom alone the new session would go there.
    reports = {"a": report(900), "b": report(500), "c": report(500)}
    plain = rank_replicas(session_request(0), views_for(reports, ReservationLedger()), PARAMS, NOW, random.Random(0))
    assert (plain.mode, plain.order[0]) == (MODE_HEADROOM, "a")
    ranking = rank_replicas(session_request(0), views_for(reports, ReservationLedger()), PARAMS, NOW,
                            random.Random(0), RankContext(session_counts={"a": 5, "b": 3, "c": 4}))
    assert ranking.mode == MODE_SPREAD
    assert ranking.order == ("b", "a", "c")  # the rest by rank_key, as before
    # Ties on sessions: the higher rank_key first.
    tie = rank_replicas(session_request(0), views_for(reports, ReservationLedger()), PARAMS, NOW,
                        random.Random(0), RankContext(session_counts={"a": 3, "b": 3, "c": 4}))
    assert tie.order[0] == "a"


def test_spread_counts_sessions_per_unit_of_capacity() -> None:
    reports = {"fast": replace(report(500), capacity_weight=2.0), "slow": report(500)}
    # 3 sessions on a replica twice as fast weigh 1.5: less than the slow one's 2.
    ranking = rank_replicas(session_request(0), views_for(reports, ReservationLedger()), PARAMS, NOW,
                            random.Random(0), RankContext(session_counts={"fast": 3, "slow": 2}))
    assert (ranking.mode, ranking.order[0]) == (MODE_SPREAD, "fast")


def test_a_new_session_sharing_a_prefix_with_one_replica_goes_to_it() -> None:
    """A tenant's system prompt cached on one replica keeps its new sessions there; a prompt
    cached everywhere (a system prompt every replica holds) spreads them by count."""
    prefix = list(range(512))
    hashes = hash_full_blocks(prefix, BS)
    one_owner = {"owner": report(500, prefix_hashes=hashes), "b": report(500), "c": report(500)}
    ranking = rank_replicas(session_request(0, prefix), views_for(one_owner, ReservationLedger()), PARAMS, NOW,
                            random.Random(0), RankContext(session_counts={"owner": 9, "b": 0, "c": 0}))
    assert ranking.order[0] == "owner"
    everywhere = {k: report(500, prefix_hashes=hashes) for k in ("a", "b", "c")}
    ranking = rank_replicas(session_request(0, prefix), views_for(everywhere, ReservationLedger()), PARAMS, NOW,
                            random.Random(0), RankContext(session_counts={"a": 9, "b": 2, "c": 4}))
    assert (ranking.mode, ranking.order[0]) == (MODE_SPREAD, "b")


def test_spread_skips_a_replica_that_cannot_prefill_in_time() -> None:
    # "idle" has no sessions but 200k prompt tokens queued: past 2 s at 40k tokens/s.
    reports = {"idle": replace(report(500, num_waiting=1), num_waiting_prompt_tokens=200_000), "b": report(500)}
    ranking = rank_replicas(session_request(0), views_for(reports, ReservationLedger()), PARAMS, NOW,
                            random.Random(0), RankContext(session_counts={"b": 7}))
    assert ranking.order[0] == "b"


def test_policy_spreads_new_sessions_and_keeps_the_old_ones() -> None:
    policy = HeadroomPolicy(PARAMS)
    reports = {"a": report(900), "b": report(500)}
    views = [ReplicaView(k, r) for k, r in reports.items()]
    for k, r in reports.items():
        policy.on_report(k, r, NOW)
    placed: Counter[str] = Counter()
    for s in range(6):  # six new sessions: dealt 3 and 3, though "a" has the most headroom
        request = RoutingRequest(f"first-{s}", [3000 + s] * 40, 8, session_id=f"s{s}")
        top = policy.rank(request, views, NOW)[0]
        assert policy.last_mode == MODE_SPREAD
        policy.on_dispatch(request, top, NOW)
        placed[top] += 1
    assert placed == {"a": 3, "b": 3}
    # A second turn follows its session, whatever the counts.
    turn = RoutingRequest("turn-2", [3000] * 60, 8, session_id="s0")
    owner = policy.sessions.replica_of("s0")
    assert policy.rank(turn, views, NOW)[0] == owner and policy.last_mode == MODE_AFFINITY


def test_policy_keeps_the_mean_uncached_prompt_per_dispatch() -> None:
    policy = HeadroomPolicy(PARAMS)
    views = [ReplicaView("a", report(900))]
    policy.on_report("a", views[0].report, NOW)
    policy.rank(RoutingRequest("1", [1] * 1000, 8), views, NOW)
    assert policy.request_tokens == 1000  # the first dispatch sets it
    policy.rank(RoutingRequest("2", [2] * 2000, 8), views, NOW)
    assert policy.request_tokens == pytest.approx(1000 + 0.02 * 1000)


# ---------------------------------------------------------------- the gate's move cost


def test_move_cost_is_what_a_move_recomputes_in_mean_requests() -> None:
    prefix = list(range(1024))  # 64 blocks
    hashes = hash_full_blocks(prefix, BS)
    reports = {"owner": report(500, prefix_hashes=hashes), "half": report(500, prefix_hashes=hashes[:32]),
               "cold": report(500)}
    request = session_request(0, prefix)  # 1064 tokens
    scores = [score_replica(request, ReplicaView(k, r), PARAMS) for k, r in reports.items()]
    # Leaving the owner recomputes the 512 tokens only it holds; leaving the others, nothing.
    assert move_costs(scores, 128.0) == {"owner": 4.0, "half": 0.0, "cold": 0.0}
    assert move_costs(scores, 0.0) == {"owner": 0.0, "half": 0.0, "cold": 0.0}  # no dispatch seen yet


def test_the_gate_keeps_a_long_history_on_its_replica_and_releases_a_short_one() -> None:
    """The owner is 12 requests over a share of 6 (limit 8). A 1,024-token cached history
    is 8 mean requests' worth of prefill (128 tokens each): moving it costs more than the
    excess relieves, so it stays; a 64-token cached prefix costs 0.5 and moves."""
    def ranking(prefix_len: int) -> Ranking:
        prefix = list(range(prefix_len))
        reports = {"owner": report(500, num_waiting=18, prefix_hashes=hash_full_blocks(prefix, BS)),
                   "a": report(500), "b": report(500)}
        return rank_replicas(session_request(0, prefix), views_for(reports, ReservationLedger()), PARAMS, NOW,
                             random.Random(0), RankContext(session_replica="owner", request_tokens=128.0))

    long, short = ranking(1024), ranking(64)
    assert (long.mode, long.order[0]) == (MODE_AFFINITY, "owner")
    assert (short.mode, short.order[-1]) == (MODE_LOAD_GATE, "owner")


# ---------------------------------------------------------------- in the simulator


def test_headroom_deals_agentic_sessions_evenly_and_keeps_each_on_its_replica() -> None:
    """The real policy in the simulated cluster: 24 sessions of 4 turns arrive at replicas
    of changing headroom; each replica gets 6 (dealt by count) and no turn leaves its
    session's replica (the gate's move cost keeps the histories where they are cached)."""
    from cluster.sim.run import simulate
    from cluster.sim.setup import SimConfig
    from cluster.workload.sim_kinds import make_workload

    requests = make_workload("agentic", 96, 12.0, seed=0, turns=4, system_len=512, turn_len=128, output_len=16)
    result = simulate(SimConfig(num_replicas=4, router="headroom", seed=0, max_model_len=8192), requests)
    session = {r.request_id: r.session_id for r in requests}
    replicas: dict[str, set] = {}
    for record in result.ok_records():
        replicas.setdefault(session[record.request_id], set()).add(record.replica_keys[-1])
    assert len(replicas) == 24 and all(len(r) == 1 for r in replicas.values())
    per_replica = Counter(next(iter(r)) for r in replicas.values())
    assert sorted(per_replica.values()) == [6, 6, 6, 6]
    modes = result.summary()["routers"][0]["modes"]
    assert modes["pow2"] == 1 and modes["spread"] == 23  # the first request comes before any report


def test_the_move_cost_adds_at_most_one_more_gate_limit() -> None:
    """Small cached requests make the mean tiny (8 tokens): a 1,024-token history would cost
    128 requests and its owner would never be gated. Capped at one limit (8), the owner that
    is 17 over its share is gated all the same, and one 15 over is not."""
    prefix = list(range(1024))

    def ranking(num_waiting: int) -> Ranking:
        reports = {"owner": report(500, num_waiting=num_waiting, prefix_hashes=hash_full_blocks(prefix, BS)),
                   "a": report(500), "b": report(500)}
        return rank_replicas(session_request(0, prefix), views_for(reports, ReservationLedger()), PARAMS, NOW,
                             random.Random(0), RankContext(request_tokens=8.0))

    assert ranking(23).order[0] == "owner"  # share 23/3: excess 15.3 <= 8 + 8
    gated = ranking(26)  # share 26/3: excess 17.3 > 16
    assert (gated.mode, gated.order[-1]) == (MODE_LOAD_GATE, "owner")


# ---------------------------------------------------------------- sessions other routers served


def test_an_unseen_session_whose_prefix_one_replica_caches_is_ranked_as_a_known_one() -> None:
    """The owner caches the prompt's history but is past target; the cold replicas hold fewer
    sessions. A count would deal the turn to a cold replica and recompute the history: the
    ranking is the one the router makes for a session it knows (no spread)."""
    prefix = list(range(1024))
    reports = {"owner": replace(report(500, prefix_hashes=hash_full_blocks(prefix, BS)),
                                num_running_prompt_tokens=90_000),
               "b": report(500), "c": report(500)}
    request = session_request(0, prefix)
    known = rank_replicas(request, views_for(reports, ReservationLedger()), PARAMS, NOW, random.Random(0))
    unseen = rank_replicas(request, views_for(reports, ReservationLedger()), PARAMS, NOW, random.Random(0),
                           RankContext(session_counts={"owner": 9, "b": 0, "c": 1}))
    assert unseen.mode != MODE_SPREAD
    assert (unseen.mode, unseen.order) == (known.mode, known.order)


def test_routers_sharing_a_view_rank_a_session_alike_whichever_saw_it() -> None:
    """Two ingress routers share one routing view (Redis); router A served a b2b-like group's
    first request on the replica with the most headroom, which then gets busy. Router B has
    never seen the session: it ranks the next request as A does."""
    params = replace(PARAMS, session_weight=0.0)  # A's session credit aside, the two must agree
    shared = LocalRoutingView(params.report_lag_s)
    a, b = HeadroomPolicy(params, view=shared), HeadroomPolicy(params, view=shared)
    prefix = list(range(2048))
    first = RoutingRequest("g-1", prefix + [7] * 40, 8, session_id="group-7")
    views = [ReplicaView(k, report(f)) for k, f in (("x", 900), ("y", 600), ("z", 600))]
    for policy in (a, b):
        for v in views:
            policy.on_report(v.key, v.report, NOW)
    top = a.rank(first, views, NOW)[0]
    a.on_dispatch(first, top, NOW)
    # Later, by reports: the owner caches the prefix and is busy, the others are idle.
    later = NOW + 1.0
    busy = {k: report(500, timestamp=later - 0.5) for k in ("x", "y", "z")}
    busy[top] = replace(report(500, prefix_hashes=hash_full_blocks(prefix, BS), timestamp=later - 0.5),
                        num_running_prompt_tokens=70_000)
    views = [ReplicaView(k, r) for k, r in busy.items()]
    for policy in (a, b):
        for v in views:
            policy.on_report(v.key, v.report, later)
    for other in ("y", "z"):  # B has dealt other sessions to the idle replicas
        b.sessions.touch(f"other-{other}", other, later)
    second = RoutingRequest("g-2", prefix + [8] * 40, 8, session_id="group-7")
    order_a = a.rank(second, views, later)
    mode_a = a.last_mode
    order_b = b.rank(RoutingRequest("g-2b", prefix + [8] * 40, 8, session_id="group-7"), views, later)
    assert (b.last_mode, order_b) == (mode_a, order_a)
    assert order_b[0] == top  # the prefix's 2,048 tokens outweigh the busy owner's queue
