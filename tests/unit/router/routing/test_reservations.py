"""The reservation ledger's work counters: uncached prefill tokens and decode blocks are
counted from dispatch time, follow a request moved to another replica, and stop counting
once a report reflects the dispatch."""
from __future__ import annotations

from router.routing.reservations import ReservationLedger, Unreflected

NOW = 1000.0


def test_work_is_counted_from_dispatch_until_a_report_reflects_it() -> None:
    ledger = ReservationLedger(report_lag_s=0.05)
    ledger.reserve("x", "r", {"r": 3}, NOW, prefill_tokens=500, decode_blocks=4)
    ledger.reserve("y", "r", {"r": 2}, NOW + 1, prefill_tokens=100, decode_blocks=1)
    assert ledger.unreflected("r") == Unreflected(blocks=5, requests=2, prefill_tokens=600, decode_blocks=5)
    ledger.observe_report("r", NOW + 0.5)  # shows x, not y
    assert ledger.unreflected("r") == Unreflected(2, 1, 100, 1)
    ledger.complete("y", "r")
    assert ledger.unreflected("r") == Unreflected()


def test_per_replica_prefill_follows_a_moved_request() -> None:
    """Uncached prefill depends on where the prefix is cached: a request Serve sent to a
    lower rank counts that replica's figure there, and nothing on the top rank."""
    ledger = ReservationLedger()
    ledger.reserve("x", "owner", {"owner": 1, "cold": 8}, NOW, prefill_tokens={"owner": 16, "cold": 128}, decode_blocks=2)
    assert ledger.unreflected("owner") == Unreflected(1, 1, 16, 2)
    ledger.routed("x", "cold")
    assert ledger.unreflected("owner") == Unreflected()
    assert ledger.unreflected("cold") == Unreflected(8, 1, 128, 2)
    ledger.complete("x", "cold")
    assert ledger.unreflected("cold") == Unreflected() and len(ledger) == 0


def test_rechoice_replaces_the_earlier_reservation() -> None:
    ledger = ReservationLedger()
    ledger.reserve("x", "a", {"a": 1, "b": 1}, NOW, prefill_tokens=50)
    ledger.reserve("x", "b", {"a": 1, "b": 1}, NOW + 0.1, prefill_tokens=60, decode_blocks=3)
    assert ledger.unreflected("a") == Unreflected()
    assert ledger.unreflected("b") == Unreflected(1, 1, 60, 3)


def test_prune_drops_the_work_of_gone_replicas() -> None:
    ledger = ReservationLedger()
    ledger.reserve("x", "dead", {"dead": 2}, NOW, prefill_tokens=70, decode_blocks=1)
    ledger.reserve("y", "a", {"a": 2}, NOW, prefill_tokens=30, decode_blocks=1)
    ledger.routed("y", "a")
    assert ledger.prune(NOW, {"a"}, unconfirmed_ttl_s=60, ttl_s=3600) == 1
    assert ledger.unreflected("dead") == Unreflected()
    assert ledger.unreflected("a") == Unreflected(2, 1, 30, 1)
