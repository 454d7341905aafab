"""The hold queue's weighted fair shares between keys (router/routing/fair_queue.py), with
exact orders: a key of weight w is served up to w times in a row before the next key's
turn, and when the queue is full a key under its weighted share of places takes the
newest place of the key furthest over its share."""
from __future__ import annotations

import pytest

from router.routing.fair_queue import BandedQueue, FairQueue


def fill(queue: FairQueue, key: str, n: int) -> None:
    for i in range(n):
        assert queue.push(key, f"{key}{i}")


def drain(queue: FairQueue) -> list[str]:
    return [queue.pop() for _ in range(len(queue))]


def test_equal_weights_alternate() -> None:
    q = FairQueue(16)
    fill(q, "a", 3)
    fill(q, "b", 3)
    assert drain(q) == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_a_key_of_weight_three_is_served_three_times_a_turn() -> None:
    q = FairQueue(16, {"gold": 3})
    fill(q, "gold", 7)
    fill(q, "free", 3)
    assert drain(q) == ["gold0", "gold1", "gold2", "free0", "gold3", "gold4", "gold5", "free1", "gold6", "free2"]


def test_serving_another_key_out_of_turn_keeps_the_rotation() -> None:
    # Admission may take a later key's head when the first one does not fit (pop_key).
    q = FairQueue(16, {"gold": 2})
    fill(q, "gold", 4)
    fill(q, "free", 2)
    assert q.pop_key("free") == "free0"  # free's turn used: back of the rotation
    assert [key for key, _ in q.heads()] == ["gold", "free"]
    assert drain(q) == ["gold0", "gold1", "free1", "gold2", "gold3"]


def test_a_full_queue_keeps_places_in_proportion_to_weight() -> None:
    q = FairQueue(8, {"gold": 3})
    fill(q, "gold", 6)
    fill(q, "free", 2)
    # Both hold their share (6 places at weight 3, 2 at weight 1): free's third is refused.
    assert q.evict_for("free") is None
    q = FairQueue(8, {"gold": 3})
    fill(q, "gold", 5)
    fill(q, "free", 3)
    # A new key takes the newest place of the key furthest over its share: free's 3 at
    # weight 1, not gold's 5 at weight 3 (unweighted, gold's would go).
    assert q.evict_for("new") == "free2"
    assert (q.depth("gold"), q.depth("free")) == (5, 2)


def test_weights_apply_within_every_band() -> None:
    q = BandedQueue(16, {"gold": 2})
    for i in range(3):
        q.push(1, "gold", f"g{i}")
        q.push(1, "free", f"f{i}")
    q.push(0, "free", "urgent")
    order = []
    while len(q):
        band, key, item = q.heads()[0]
        order.append(q.pop_key(band, key))
    assert order == ["urgent", "g0", "g1", "f0", "g2", "f1", "f2"]


def test_weights_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="weights must be >= 1"):
        FairQueue(4, {"k": 0})
