"""Tier-aware headroom scoring: a prefix a replica holds in its host tier or on its disk
is credited as a load (less than a device hit, more than nothing) and its predicted TTFT
counts the load time instead of the recompute."""
from __future__ import annotations

import random

from kv.block_hash import hash_full_blocks
from router.routing.policies.headroom import rank_replicas
from router.routing.scoring import score_replica
from router.routing.types import ReplicaReport, ReplicaView, RequestProfile, RoutingParams

BS = 16
NOW = 1_000.0
PARAMS = RoutingParams(expected_output_tokens=16)
PROMPT = list(range(100, 100 + 64 * BS + 5))  # 64 full blocks and a tail
HASHES = hash_full_blocks(PROMPT, BS)


def view(key: str, device: list[int] = (), host: list[int] = (), disk: list[int] = ()) -> ReplicaView:
    report = ReplicaReport.from_stats({
        "free_blocks": 500, "total_blocks": 1000, "block_size": BS, "num_running": 0, "num_waiting": 0,
        "num_waiting_prompt_tokens": 0, "reserved_blocks": 0, "prefix_hashes": list(device),
        "host_prefix_hashes": list(host), "disk_prefix_hashes": list(disk), "timestamp": NOW - 0.5,
    })
    assert report is not None
    return ReplicaView(key, report, 0, 0)


def test_tier_blocks_follow_the_chain_past_the_device_hits() -> None:
    request = RequestProfile(prompt_token_ids=PROMPT, max_tokens=16)
    host, disk = frozenset(HASHES[10:40]), frozenset(HASHES[40:50] + HASHES[55:60])
    assert request.tier_blocks(BS, 10, host, disk) == (30, 10)  # stops at block 50
    assert request.tier_blocks(BS, 0, host, disk) == (0, 0)  # the chain starts on the device
    assert request.tier_blocks(BS, 10, frozenset(), frozenset()) == (0, 0)


def test_a_tier_hit_scores_between_a_device_hit_and_nothing() -> None:
    request = RequestProfile(prompt_token_ids=PROMPT, max_tokens=16)
    scores = {key: score_replica(request, v, PARAMS) for key, v in {
        "device": view("device", device=HASHES),
        "host": view("host", host=HASHES),
        "disk": view("disk", disk=HASHES),
        "cold": view("cold"),
    }.items()}
    credits = [scores[k].credit for k in ("device", "host", "disk", "cold")]
    assert credits == sorted(credits, reverse=True) and credits[-1] == 0.0
    assert scores["host"].credit == PARAMS.prefix_weight * PARAMS.host_hit_weight
    # Loaded, not recomputed: only the tail is prefill work, plus the load time.
    assert scores["host"].uncached_tokens == scores["device"].uncached_tokens == len(PROMPT) - 64 * BS
    assert scores["cold"].uncached_tokens == len(PROMPT)
    load_s = 64 * BS / PARAMS.host_load_tokens_per_s
    assert abs(scores["host"].ttft_s - (scores["device"].ttft_s + load_s)) < 1e-9
    assert scores["device"].ttft_s < scores["host"].ttft_s < scores["disk"].ttft_s
    # A disk read is no faster than a recompute at the default rates: the credit still ranks it.
    assert scores["disk"].ttft_s <= scores["cold"].ttft_s and scores["disk"].rank_key > scores["cold"].rank_key
    # Tier blocks still need device blocks: the need is the cold replica's.
    assert scores["host"].need_blocks == scores["cold"].need_blocks > scores["device"].need_blocks


def test_the_router_sends_a_request_to_the_replica_whose_host_tier_holds_its_prefix() -> None:
    request = RequestProfile(prompt_token_ids=PROMPT, max_tokens=16)
    views = [view("cold-a"), view("host", host=HASHES), view("cold-b")]
    ranking = rank_replicas(request, views, PARAMS, NOW, random.Random(0))
    assert ranking.order[0] == "host"
