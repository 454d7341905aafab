"""Routing policies (router/routing/policies/): exact rankings on hand-built views, no Ray."""
from __future__ import annotations

import pytest

from kv.block_hash import hash_full_blocks
from router.routing.types import RoutingParams, ReplicaReport, ReplicaView
from router.routing.policies import (
    POLICY_NAMES,
    RoutingPolicy,
    RoutingRequest,
    make_policy,
    split_policy_kwargs,
)
from router.routing.policies.prefix_index import PrefixIndex
from router.routing.reservations import Unreflected

BS = 16


def report(free: int = 100, total: int = 100, *, waiting: int = 0, waiting_tokens: int = 0,
           prefix: tuple[int, ...] = (), ts: float = 0.0, healthy: bool = True) -> ReplicaReport:
    return ReplicaReport(free_blocks=free, total_blocks=total, block_size=BS, num_running=0,
                         num_waiting=waiting, num_waiting_prompt_tokens=waiting_tokens,
                         reserved_blocks=-(-waiting_tokens // BS), prefix_hashes=frozenset(prefix),
                         timestamp=ts, healthy=healthy)


def view(key: str, rep: ReplicaReport | None = None, queue: int = 0) -> ReplicaView:
    return ReplicaView(key, rep, queue_len=queue)


def req(rid: str, tokens: list[int], max_tokens: int = 0) -> RoutingRequest:
    return RoutingRequest(rid, tokens, max_tokens)


def test_registry_names_and_protocol() -> None:
    assert POLICY_NAMES == ("round_robin", "pow2", "least_kv", "prefix_affinity", "sticky", "headroom")
    for name in POLICY_NAMES:
        policy = make_policy(name)
        assert isinstance(policy, RoutingPolicy)
        assert policy.name == name


def test_registry_rejects_unknown_names_and_options() -> None:
    with pytest.raises(ValueError, match="unknown routing policy 'nope'"):
        make_policy("nope")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['target_s'\]"):
        make_policy("round_robin", target_s=3.0)
    with pytest.raises(ValueError, match="unknown option"):
        make_policy("prefix_affinity", balance_abs=3)
    assert make_policy("sticky", target_s=3.0).options.target_s == 3.0


def test_split_policy_kwargs() -> None:
    name, params, options = split_policy_kwargs({"policy": "sticky", "stats_period_s": 2.0, "target_s": 10.0})
    assert (name, params, options) == ("sticky", RoutingParams(stats_period_s=2.0), {"target_s": 10.0})
    assert split_policy_kwargs({})[0] == "headroom"


def test_round_robin_rotates_and_skips_unhealthy() -> None:
    policy = make_policy("round_robin")
    views = [view("a"), view("b"), view("c")]
    r = req("r", [1, 2])
    assert [policy.rank(r, views, 0.0) for _ in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    sick = [view("a"), view("b", report(healthy=False)), view("c")]
    assert policy.rank(r, sick, 0.0) == ["a", "c"]  # 5th request: 4 % 2 healthy = start at 0
    assert policy.rank(r, sick, 0.0) == ["c", "a"]


def test_pow2_shorter_queue_of_two_random_seeded() -> None:
    views = [view(k, queue=q) for k, q in zip("abcd", [3, 1, 2, 0])]
    r = req("r", [1])
    first = make_policy("pow2", seed=0)
    orders = [first.rank(r, views, 0.0) for _ in range(4)]
    # Python's Random(0) shuffles: pairs (c, a) and (b, a); the shorter queue leads each pair.
    assert orders == [["c", "a", "b", "d"], ["b", "a", "d", "c"], ["c", "a", "b", "d"], ["b", "a", "d", "c"]]
    again = make_policy("pow2", seed=0)
    assert [again.rank(r, views, 0.0) for _ in range(4)] == orders


def test_least_kv_orders_by_usage_then_queue() -> None:
    policy = make_policy("least_kv")
    views = [view("a", report(free=50)), view("b", report(free=80), queue=3),
             view("c", report(free=80), queue=1), view("d", None, queue=9)]
    # usage a 0.5, b 0.2, c 0.2, d unknown (0.0: a new replica looks empty)
    assert policy.rank(req("r", [1]), views, 0.0) == ["d", "c", "b", "a"]


def test_prefix_index_longest_leading_match_and_leaf_first_eviction() -> None:
    index = PrefixIndex(max_blocks_per_replica=3)
    chain = [11, 12, 13]
    index.insert("a", chain)
    index.insert("b", chain[:1])
    assert index.match([11, 12, 13, 14], ["a", "b", "c"]) == {"a": 3, "b": 1, "c": 0}
    assert index.match([99, 12], ["a"]) == {"a": 0}
    index.insert("a", [21])  # over the cap: the oldest entry, leaf 13, goes
    assert index.size("a") == 3
    assert index.match(chain, ["a"]) == {"a": 2}
    index.forget("a")
    assert index.match(chain, ["a", "b"]) == {"a": 0, "b": 1}


def test_prefix_affinity_follows_its_own_record() -> None:
    policy = make_policy("prefix_affinity")
    shared = list(range(64))  # 4 blocks
    views = [view("a", queue=2), view("b", queue=0), view("c", queue=1)]
    # Cold: every record is empty, the smallest record (tie: shortest queue) first, rest by load.
    assert policy.rank(req("1", shared + [100]), views, 0.0) == ["b", "c", "a"]
    assert policy.last_mode == "spread"
    # The same prefix again: b matches 4 of 4.06 blocks > 0.5, so b, although now the busiest.
    busy_b = [view("a", queue=2), view("b", queue=5), view("c", queue=1)]
    assert policy.rank(req("2", shared + [200]), busy_b, 0.0) == ["b", "c", "a"]
    assert policy.last_mode == "cache"
    # Another prompt matching under half of itself: the smallest record (a and c hold
    # nothing; c has the shorter queue), then the rest by load.
    other = list(range(16)) + list(range(500, 548))  # 1 of 4 blocks matched
    assert policy.rank(req("3", other), views, 0.0) == ["c", "b", "a"]
    assert policy.last_mode == "spread"


def test_prefix_affinity_load_imbalance_goes_to_shortest_queue() -> None:
    policy = make_policy("prefix_affinity")
    shared = list(range(64))
    policy.rank(req("1", shared), [view("a"), view("b", queue=1)], 0.0)  # a records the prefix
    # |40 - 5| > 32 and 40 > 5 * 1.0001: shortest queue, the cache is ignored.
    hot = [view("a", queue=40), view("b", queue=5), view("c", queue=7)]
    assert policy.rank(req("2", list(range(1000, 1064))), hot, 0.0) == ["b", "c", "a"]
    assert policy.last_mode == "balance"
    # |36 - 5| = 31 <= 32: balanced enough, a's cache wins.
    warm = [view("a", queue=36), view("b", queue=5), view("c", queue=7)]
    assert policy.rank(req("3", list(range(64)) + [2]), warm, 0.0) == ["a", "b", "c"]
    assert policy.last_mode == "cache"
    # Request 2's prompt went to b (chosen by load): b holds it now.
    assert policy.rank(req("5", list(range(1000, 1064))), warm, 0.0) == ["b", "c", "a"]
    # Both hold a prefix: the shorter queue of the two.
    policy.on_dispatch(req("6", shared), "c", 0.0)
    assert policy.rank(req("7", shared), warm, 0.0) == ["c", "b", "a"]
    # A dispatch below the first rank is recorded too (on_dispatch).
    policy.on_dispatch(req("4", list(range(900, 964))), "c", 0.0)
    assert policy.index.match(hash_full_blocks(list(range(900, 964)), BS), ["c"]) == {"c": 4}


def test_sticky_stays_warm_until_backlog_exceeds_target() -> None:
    # Saturation at 100 tokens/s * 2 s = 200 uncached tokens of backlog.
    policy = make_policy("sticky", prefill_tokens_per_s=100.0, target_s=2.0)
    prompt = list(range(64)) + [7] * 40  # 104 tokens, 6 full blocks
    hashes = hash_full_blocks(prompt, BS)
    cold, warm = report(ts=0.0), report(prefix=tuple(hashes[:4]), ts=0.0)
    views = [view("a", cold, queue=0), view("b", warm, queue=3), view("c", cold, queue=1)]
    # b caches 64 tokens: 40 uncached, backlog 0 -> stay on b, the rest by load.
    assert policy.rank(req("1", prompt), views, 1.0) == ["b", "a", "c"]
    assert policy.last_mode == "sticky"
    # Its reservation (40 tokens) counts until b reports; b's own queue holds 130 more.
    busy = [view("a", cold, queue=0), view("b", report(prefix=tuple(hashes[:4]), waiting_tokens=130, ts=0.5), queue=3),
            view("c", cold, queue=1)]
    assert policy.backlog(busy[1]) == 170
    # A prompt sharing b's 4 cached blocks (request 1's own 6 are in the router's record,
    # so repeating it would count 96 cached tokens): 170 + 40 > 200, saturated, least-loaded.
    prompt2 = list(range(64)) + [9] * 40
    assert policy.rank(req("2", prompt2), busy, 1.0) == ["a", "c", "b"]
    assert policy.last_mode == "saturated"
    # A report taken after both dispatches shows them: backlog back to the reported 130.
    policy.on_report("b", report(waiting_tokens=130, ts=2.0), 2.0)
    assert policy.backlog(busy[1]) == 130


def test_sticky_cold_request_goes_least_loaded() -> None:
    policy = make_policy("sticky")
    views = [view("a", report(waiting_tokens=500), queue=1), view("b", report(), queue=1), view("c", report(), queue=2)]
    assert policy.rank(req("1", list(range(40))), views, 0.0) == ["b", "a", "c"]
    assert policy.last_mode == "cold"
    # The router's own record makes b warm for the same prompt (reports show nothing yet).
    assert policy.rank(req("2", list(range(40))), [view("a", queue=0), view("b", queue=2)], 0.0) == ["b", "a"]
    assert policy.last_mode == "sticky"


def test_headroom_spreads_a_burst_by_reservations_and_forgets_them_on_report() -> None:
    params = RoutingParams(stats_period_s=1.0, report_lag_s=0.05)
    policy = make_policy("headroom", params)
    views = [view("a", report(free=10, ts=0.0)), view("b", report(free=20, ts=0.0))]
    prompt = list(range(32))  # 2 blocks, max_tokens 0
    # rank_key = fill - predicted prefill seconds / 2 s: a (10-2)/10 - 32/80k, b (20-2)/20 - 32/80k
    assert policy.rank(req("1", prompt), views, 0.1) == ["b", "a"]
    # Fills tie at 0.8; b's 32 tokens sent since its report delay its prefill: a
    assert policy.rank(req("2", prompt), views, 0.1) == ["a", "b"]
    # a: (10-2-2)/10 = 0.6 < b's 0.8
    assert policy.rank(req("3", prompt), views, 0.1) == ["b", "a"]
    assert policy.last_mode == "headroom"
    # The ledger counts blocks, requests and uncached prompt tokens (no decode: max_tokens 0).
    assert policy.ledger.unreflected("b") == Unreflected(4, 2, 64, 0)
    policy.on_dispatch(req("2", prompt), "b", 0.1)  # Serve sent #2 to b after all
    assert policy.ledger.unreflected("b") == Unreflected(6, 3, 96, 0)
    assert policy.ledger.unreflected("a") == Unreflected(0, 0, 0, 0)
    policy.on_complete("1", "b", 0.2)
    assert policy.ledger.unreflected("b") == Unreflected(4, 2, 64, 0)
    policy.on_report("b", report(free=14, ts=0.2), 0.2)
    assert policy.ledger.unreflected("b") == Unreflected(0, 0, 0, 0)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_is_deterministic_for_a_seed(name: str) -> None:
    def run() -> list[list[str]]:
        policy = make_policy(name, seed=3)
        out = []
        for i in range(30):
            views = [view(k, report(free=100 - (i * (j + 1)) % 50, waiting=j, ts=float(i)), queue=(i + j) % 4)
                     for j, k in enumerate("abcd")]
            r = req(str(i), list(range(i % 3 * 16, i % 3 * 16 + 40)), 8)
            order = policy.rank(r, views, float(i))
            assert sorted(order) == ["a", "b", "c", "d"]
            policy.on_dispatch(r, order[0], float(i))
            if i % 2:
                policy.on_complete(str(i - 1), order[-1], float(i))
            out.append(order)
        return out

    assert run() == run()
