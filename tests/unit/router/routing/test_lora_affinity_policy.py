"""The Gateway API Inference Extension's LoRA-aware scheduler as a baseline
(router/routing/policies/lora_affinity.py): its decision tree over reported queues, KV usage
and adapters, then a random pick among what is left."""
from __future__ import annotations

import pytest

from router.routing.policies import POLICY_NAMES, SIM_POLICY_NAMES, make_policy
from router.routing.policies.base import RoutingRequest
from router.routing.policies.lora_affinity import LoraAffinityOptions, LoraAffinityPolicy
from router.routing.types import ReplicaReport, ReplicaView

PROMPT = list(range(1, 33))


def view(key: str, active: tuple[str, ...] = (), waiting: int = 0, used: int = 0) -> ReplicaView:
    report = ReplicaReport.from_stats({
        "free_blocks": 100 - used, "total_blocks": 100, "block_size": 16, "num_running": 0,
        "num_waiting": waiting, "num_waiting_prompt_tokens": 0, "reserved_blocks": 0, "prefix_hashes": [],
        "lora_resident": list(active), "timestamp": 0.0,
    })
    assert report is not None
    return ReplicaView(key, report)


def request(lora: str | None = "sql") -> RoutingRequest:
    return RoutingRequest("q", PROMPT, 8, lora_name=lora)


def firsts(policy: LoraAffinityPolicy, req: RoutingRequest, views: list[ReplicaView], n: int = 200) -> set[str]:
    return {policy.rank(req, views, 1.0)[0] for _ in range(n)}


def test_the_replicas_holding_the_adapter_win_then_least_queue_then_least_kv() -> None:
    policy = LoraAffinityPolicy(LoraAffinityOptions(max_loras=2, affinity_threshold=1.0), seed=0)
    views = [view("a", ("sql",), waiting=3), view("b", ("sql",), waiting=0, used=50),
             view("c", ("sql",), waiting=0, used=10), view("d", (), waiting=0)]
    # affinity {a, b, c}; least queue within (3 - 0) / 3 of 0: {b, c}; least KV within
    # (50 - 10) / 2 points of 10%: {c}.
    assert firsts(policy, request(), views) == {"c"}
    order = policy.rank(request(), views, 1.0)
    assert sorted(order) == ["a", "b", "c", "d"] and order[1:] == ["d", "b", "a"]  # then by queue, KV


def test_without_affinity_a_replica_with_room_for_another_adapter_is_preferred() -> None:
    policy = LoraAffinityPolicy(LoraAffinityOptions(max_loras=2), seed=0)
    views = [view("full", ("x", "y")), view("room", ("x",), waiting=5)]
    assert firsts(policy, request(), views) == {"room"}
    # Nobody has it or room for it: the filter passes everything on (least queue decides).
    views = [view("a", ("x", "y"), waiting=4), view("b", ("x", "z"), waiting=1)]
    assert firsts(policy, request(), views) == {"b"}


def test_the_soft_affinity_sends_a_share_to_replicas_with_room() -> None:
    policy = LoraAffinityPolicy(LoraAffinityOptions(max_loras=2, affinity_threshold=0.5), seed=1)
    views = [view("has", ("sql",)), view("room", ())]
    picks = [policy.rank(request(), views, 1.0)[0] for _ in range(400)]
    assert 150 < picks.count("room") < 250


def test_above_the_queueing_threshold_least_queue_comes_before_affinity() -> None:
    policy = LoraAffinityPolicy(LoraAffinityOptions(max_loras=2, queueing_threshold=4, affinity_threshold=1.0))
    views = [view("has", ("sql",), waiting=40), view("short", (), waiting=5)]
    assert firsts(policy, request(), views) == {"short"}
    # Below it, affinity first, however long the queue within the threshold.
    views = [view("has", ("sql",), waiting=4), view("short", (), waiting=0)]
    assert firsts(policy, request(), views) == {"has"}


def test_base_model_requests_skip_affinity_and_unreported_replicas_count_as_empty() -> None:
    policy = LoraAffinityPolicy(LoraAffinityOptions(max_loras=2, affinity_threshold=1.0))
    views = [view("has", ("sql",), waiting=2), view("idle", (), waiting=0)]
    assert firsts(policy, request(None), views) == {"idle"}
    assert firsts(policy, request(), [ReplicaView("new", None), view("busy", (), waiting=9)]) == {"new"}


def test_built_by_name_for_the_simulator_only_and_needs_max_loras() -> None:
    assert "lora_affinity" in SIM_POLICY_NAMES and "lora_affinity" not in POLICY_NAMES
    assert isinstance(make_policy("lora_affinity", max_loras=4), LoraAffinityPolicy)
    with pytest.raises(ValueError, match="max_loras"):
        make_policy("lora_affinity")
    with pytest.raises(ValueError, match="unknown option"):
        make_policy("lora_affinity", max_loras=4, bogus=1)
