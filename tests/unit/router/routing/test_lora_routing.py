"""LoRA-aware headroom scoring: a replica's adapter residency (its routing report's
lora_resident / lora_loaded, worker/serving/routing_report.py) prices the adapter's load into the
request's predicted TTFT. A replica holding the adapter wins while its queue is shorter than
the load; as its queue grows the adapter spreads to another replica, and base-model
requests ignore residency."""
from __future__ import annotations

import random

from router.routing.policies.headroom import rank_replicas
from router.routing.scoring import adapter_load_s, score_replica
from router.routing.types import ReplicaReport, ReplicaView, RequestProfile, RoutingParams

BS = 16
NOW = 1_000.0
PARAMS = RoutingParams(expected_output_tokens=16)
PROMPT = list(range(100, 100 + 8 * BS))


def view(key: str, resident: tuple[str, ...] = (), loaded: tuple[str, ...] = (),
         waiting_tokens: int = 0) -> ReplicaView:
    report = ReplicaReport.from_stats({
        "free_blocks": 500, "total_blocks": 1000, "block_size": BS, "num_running": 0,
        "num_waiting": 1 if waiting_tokens else 0, "num_waiting_prompt_tokens": waiting_tokens,
        "reserved_blocks": 0, "prefix_hashes": [], "lora_resident": list(resident),
        "lora_loaded": list(loaded), "timestamp": NOW - 0.5,
    })
    assert report is not None
    return ReplicaView(key, report, 0, 0)


def test_the_load_priced_by_residency() -> None:
    request = RequestProfile(PROMPT, 16, lora_name="sql")
    base = RequestProfile(PROMPT, 16)
    resident, loaded, cold = (view("r", resident=("sql",)), view("l", loaded=("sql",)), view("c", resident=("chat",)))
    assert adapter_load_s(request, resident.report, PARAMS) == 0.0
    assert adapter_load_s(request, loaded.report, PARAMS) == PARAMS.lora_swap_s
    assert adapter_load_s(request, cold.report, PARAMS) == PARAMS.lora_load_s
    assert adapter_load_s(base, cold.report, PARAMS) == 0.0  # the base model needs no adapter
    ttft = {v.key: score_replica(request, v, PARAMS).ttft_s for v in (resident, loaded, cold)}
    assert abs(ttft["c"] - ttft["r"] - PARAMS.lora_load_s) < 1e-9
    assert ttft["r"] < ttft["l"] < ttft["c"]


def test_a_request_goes_where_its_adapter_is_resident() -> None:
    request = RequestProfile(PROMPT, 16, lora_name="sql")
    views = [view("a", resident=("chat",)), view("b", resident=("sql",)), view("c")]
    assert rank_replicas(request, views, PARAMS, NOW, random.Random(0)).order[0] == "b"
    # Host memory beats storage when no replica has it in a slot.
    views = [view("a"), view("b", loaded=("sql",)), view("c")]
    assert rank_replicas(request, views, PARAMS, NOW, random.Random(0)).order[0] == "b"


def test_a_hot_adapter_spreads_once_its_replica_queues_longer_than_a_load() -> None:
    request = RequestProfile(PROMPT, 16, lora_name="sql")
    rate = PARAMS.prefill_tokens_per_s
    # The owner's queue is worth less than a load: it keeps the adapter's requests.
    short = int(0.5 * PARAMS.lora_load_s * rate)
    views = [view("owner", resident=("sql",), waiting_tokens=short), view("other")]
    assert rank_replicas(request, views, PARAMS, NOW, random.Random(0)).order[0] == "owner"
    # Worth several loads: loading the adapter on another replica is faster.
    long = int(4 * PARAMS.lora_load_s * rate)
    views = [view("owner", resident=("sql",), waiting_tokens=long), view("other")]
    assert rank_replicas(request, views, PARAMS, NOW, random.Random(0)).order[0] == "other"


def test_base_model_requests_ignore_residency() -> None:
    base = RequestProfile(PROMPT, 16)
    a, b = view("a", resident=("sql", "chat")), view("b")
    assert score_replica(base, a, PARAMS).ttft_s == score_replica(base, b, PARAMS).ttft_s


def held(key: str, active: tuple[str, ...], max_loras: int, timestamp: float = NOW - 0.5) -> ReplicaView:
    report = ReplicaReport.from_stats({
        "free_blocks": 500, "total_blocks": 1000, "block_size": BS, "num_running": len(active),
        "num_waiting": 0, "num_waiting_prompt_tokens": 0, "reserved_blocks": 0, "prefix_hashes": [],
        "lora_resident": list(active), "lora_active": list(active), "max_loras": max_loras, "timestamp": timestamp,
    })
    assert report is not None
    return ReplicaView(key, report, 0, 0)


def test_every_slot_held_adds_the_wait_for_one_to_drain() -> None:
    request = RequestProfile(PROMPT, 16, lora_name="sql")
    full, room = held("full", ("a", "b"), 2), held("room", ("a",), 2)
    assert adapter_load_s(request, full.report, PARAMS) == PARAMS.lora_load_s + PARAMS.lora_slot_wait_s
    assert adapter_load_s(request, room.report, PARAMS) == PARAMS.lora_load_s
    assert adapter_load_s(RequestProfile(PROMPT, 16, lora_name="a"), full.report, PARAMS) == 0.0
    assert rank_replicas(request, [full, room], PARAMS, NOW, random.Random(0)).order[0] == "room"


def test_negative_lora_prices_are_refused() -> None:
    import pytest

    with pytest.raises(ValueError, match="lora_slot_wait_s"):
        RoutingParams(lora_slot_wait_s=-1.0)


def test_adapters_sent_since_the_report_count_as_resident_and_held() -> None:
    from router.routing.policies.base import RoutingRequest
    from router.routing.policies.headroom import HeadroomPolicy

    policy = HeadroomPolicy(PARAMS, seed=0)
    views = [held("x", ("a",), 2), held("y", ("b",), 2)]
    first = RoutingRequest("1", PROMPT, 16, lora_name="sql")
    target = policy.rank(first, views, NOW)[0]
    policy.on_dispatch(first, target, NOW)
    # The same adapter again: no load where it was just sent, though no report shows it.
    again = RoutingRequest("2", PROMPT, 16, lora_name="sql")
    assert policy.rank(again, views, NOW)[0] == target
    # That replica's slots are now all taken: another new adapter goes to the other one.
    other = RoutingRequest("3", [t + 5000 for t in PROMPT], 16, lora_name="math")  # no prefix in common
    assert policy.rank(other, views, NOW)[0] != target
    # A report taken after the dispatch is the truth again (the request may have finished).
    fresh = [held(v.key, v.report.lora_resident, 2, timestamp=NOW + 0.5) for v in views]
    assert policy.sent_adapters.unseen(target, fresh[0].report) == frozenset()
