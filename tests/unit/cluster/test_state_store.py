"""The Redis state store (cluster/state_store.py) against a real redis-server, no Ray.

Two store instances on one Redis play two ingress replicas. Covered: slots and token
budgets are shared and atomic; refunds; a dead replica's slots expire while a live
one's are renewed; a hung or password-protected Redis; and Redis down and back (calls
answer from the local fallback at once, one log line each way, Redis used again after).
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from cluster.state_store import RedisLimitStore, RedisStoreSpec
from router.errors import APIError
from router.frontend.key_limits import KeyLimits
from tests.support.redis_server import RedisServer

KEY = "0123456789ab"  # a key_id: 12 hex digits of the key's digest


@pytest.fixture
def prefix() -> str:
    return f"kvserve-test:{uuid.uuid4().hex[:8]}"  # each test its own keys


def store(server: RedisServer, prefix: str, **fields: Any) -> RedisLimitStore:
    # 1 s, not the default 0.2 s: a loaded CI machine must not look like an outage here.
    return RedisStoreSpec(url=server.url, key_prefix=prefix, **{"socket_timeout_s": 1.0, **fields}).build()


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


async def eventually(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Polls `condition` on the running loop (the store's background tasks run meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def close(*stores: RedisLimitStore) -> None:
    for s in stores:
        await s.aclose()


def test_slots_are_counted_across_replicas_atomically(redis_server: RedisServer, prefix: str) -> None:
    async def scenario() -> None:
        a, b = store(redis_server, prefix), store(redis_server, prefix)
        # 20 concurrent acquires through both replicas, limit 5: exactly 5 get a slot.
        grants = await asyncio.gather(*(s.acquire_slot(KEY, 5) for s in [a, b] * 10))
        taken = [g for g in grants if g.slot is not None]
        assert len(taken) == 5
        assert all(g.in_flight == 5 for g in grants if g.slot is None)
        assert redis_server.client().zcard(f"{prefix}:key:{KEY}:slots") == 5
        # Another key is not affected.
        assert (await b.acquire_slot("fedcba987654", 5)).slot is not None
        # Released on one replica: the other may take it.
        owner = a if taken[0].slot.member.startswith(a.replica_id) else b
        owner.release_slot(taken[0].slot)
        await eventually(lambda: redis_server.client().zcard(f"{prefix}:key:{KEY}:slots") == 4, "the release")
        other = b if owner is a else a
        assert (await other.acquire_slot(KEY, 5)).slot is not None
        assert (await owner.acquire_slot(KEY, 5)).slot is None
        await close(a, b)

    run(scenario())


def test_the_next_acquire_carries_a_release_still_on_its_way(redis_server: RedisServer, prefix: str) -> None:
    """A client at its limit that sends its next request the moment the last one ended:
    the release's own ZREM may land after the next acquire; that acquire removes it."""

    async def scenario() -> None:
        s = store(redis_server, prefix)
        first = await s.acquire_slot(KEY, 1)
        s._spawn = lambda make: None  # type: ignore[method-assign]  # the ZREM never runs on its own
        s.release_slot(first.slot)
        assert redis_server.client().zcard(f"{prefix}:key:{KEY}:slots") == 1  # still there
        second = await s.acquire_slot(KEY, 1)
        assert second.slot is not None and second.in_flight == 1
        assert redis_server.client().zrange(f"{prefix}:key:{KEY}:slots", 0, -1) == [second.slot.member]
        assert not s._releasing  # landed: not sent again
        await s.aclose()

    run(scenario())


def test_token_budget_is_shared_and_refunded(redis_server: RedisServer, prefix: str) -> None:
    async def scenario() -> None:
        a, b = store(redis_server, prefix), store(redis_server, prefix)
        limits_a = KeyLimits(tokens_per_minute=600, store=a)  # 10 tokens per second
        limits_b = KeyLimits(tokens_per_minute=600, store=b)
        # 12 concurrent charges of 100 through both replicas: the 600 fit 6 of them.
        leases = [await (limits_a if i % 2 else limits_b).acquire(KEY) for i in range(12)]
        results = await asyncio.gather(*(lease.charge(100) for lease in leases), return_exceptions=True)
        refused = [r for r in results if isinstance(r, APIError)]
        assert len(refused) == 6 and all(e.status == 429 and e.code == "tokens_per_minute_exceeded" for e in refused)
        assert "retry in" in refused[0].message
        # A request larger than the whole budget never fits.
        with pytest.raises(APIError, match="more than this API key's limit of 600"):
            await (await limits_b.acquire(KEY)).charge(601)
        # Refund through replica a (used 30 of 100): replica b sees the 70.
        charged = [lease for lease, r in zip(leases, results) if r is None and lease._limits is limits_a][0]
        charged.settle(30)
        charged.settle(0)  # once only
        tokens = lambda: float(redis_server.client().hget(f"{prefix}:key:{KEY}:tokens", "tokens") or 0)  # noqa: E731
        await eventually(lambda: tokens() >= 70, "the refund")
        assert tokens() < 70 + 10  # no more than the refund plus a second of refill
        await (await limits_b.acquire(KEY)).charge(70)
        ttl_ms = redis_server.client().pttl(f"{prefix}:key:{KEY}:tokens")
        assert 0 < ttl_ms <= 60_000  # a bucket untouched for a minute is full: it expires
        await close(a, b)

    run(scenario())


def test_a_dead_replicas_slots_expire_a_live_ones_are_renewed(redis_server: RedisServer, prefix: str) -> None:
    async def scenario() -> None:
        dead, live, other = (store(redis_server, prefix, lease_ttl_s=1.0) for _ in range(3))
        for s in (dead, live, other):  # connected and the scripts loaded: the lease clock is what counts
            await s.take_tokens("warm00000000", 1, 600)
        assert (await dead.acquire_slot(KEY, 1)).slot is not None
        assert (await other.acquire_slot(KEY, 1)).slot is None
        await dead.aclose()  # crashed: no release, no more renewals
        start = time.monotonic()
        while (await other.acquire_slot(KEY, 1)).slot is None:  # free after ~1 s
            assert time.monotonic() - start < 10, "the dead replica's slot did not expire"
            await asyncio.sleep(0.05)
        key2 = "aaaaaaaaaaaa"
        held = await live.acquire_slot(key2, 1)
        assert held.slot is not None
        # Three lease lifetimes later the live replica's slot is still counted (renewed every 1/3 s).
        deadline = time.monotonic() + 3 * 1.0
        while time.monotonic() < deadline:
            assert (await other.acquire_slot(key2, 1)).slot is None
            await asyncio.sleep(0.1)
        live.release_slot(held.slot)
        await eventually(lambda: redis_server.client().exists(f"{prefix}:key:{key2}:slots") == 0, "the release")
        await close(live, other)

    run(scenario())


def test_redis_down_and_back(redis_server: RedisServer, prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    slots_key, tokens_key = f"{prefix}:key:{KEY}:slots", f"{prefix}:key:{KEY}:tokens"

    async def scenario() -> None:
        s = store(redis_server, prefix)
        limits = KeyLimits(max_concurrent_requests=2, tokens_per_minute=6000, store=s)
        before = await limits.acquire(KEY)  # in Redis
        await before.charge(10)
        assert redis_server.client().zcard(slots_key) == 1
        with redis_server.stopped():
            started = time.monotonic()
            for _ in range(20):  # the first finds Redis down; then answered at once, each time
                (await limits.acquire(KEY)).release()
            assert time.monotonic() - started < 1.0
            during = await limits.acquire(KEY)  # answered locally
            await during.charge(10)
            assert not s.up and s.local.in_flight(KEY) == 1
            assert s.local.tokens_left(KEY, 6000) == pytest.approx(5990, abs=1)
            # The local count enforces the limit meanwhile, counting the slot this replica
            # still holds in Redis: before + during = 2.
            with pytest.raises(APIError, match="limit is 2"):
                await limits.acquire(KEY)
            before.release()  # Redis's copy is lost with it (and would expire)
            before.settle(0)
        # Back (same port, empty): the store reconnects and writes back the slot it holds.
        await eventually(lambda: s.up, "the store to reconnect")
        await eventually(lambda: redis_server.client().zcard(slots_key) == 1, "the held slot written back")
        after = await limits.acquire(KEY)  # counted in Redis again: 2 of 2
        assert redis_server.client().zcard(slots_key) == 2
        with pytest.raises(APIError, match="limit is 2"):
            await limits.acquire(KEY)
        await after.charge(100)
        assert float(redis_server.client().hget(tokens_key, "tokens")) == pytest.approx(5900, abs=5)
        during.settle(0)  # charged locally: refunded locally
        assert s.local.tokens_left(KEY, 6000) == pytest.approx(6000, abs=1)
        during.release()
        after.release()
        await eventually(lambda: redis_server.client().exists(slots_key) == 0, "both releases")
        assert s.local.in_flight(KEY) == 0
        await s.aclose()

    with caplog.at_level(logging.WARNING, logger="cluster.state_store"):
        run(scenario())
    lines = [r.getMessage() for r in caplog.records if r.name == "cluster.state_store"]
    assert len(lines) == 2 and "unreachable" in lines[0] and "is back" in lines[1], lines


def test_a_hung_redis_costs_one_short_wait(tmp_path: Any, prefix: str) -> None:
    """A server that accepts connections and never answers: the first call falls back
    after the socket timeout, the next ones at once."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        url = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"

        async def scenario() -> tuple[float, float]:
            s = RedisStoreSpec(url=url, key_prefix=prefix, socket_timeout_s=0.2).build()
            t0 = time.monotonic()
            first = await s.acquire_slot(KEY, 1)
            t1 = time.monotonic()
            second = await s.take_tokens(KEY, 10, 600)
            t2 = time.monotonic()
            assert first.slot is not None and first.slot.local and second.wait_s == 0.0
            assert not s.up
            await s.aclose()
            return t1 - t0, t2 - t1

        first_s, second_s = run(scenario())
    assert first_s < 1.0 and second_s < 0.05


def test_password_comes_from_the_environment(tmp_path: Any, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    server = RedisServer(tmp_path, password="s3cret-test-pw")
    server.start()
    try:
        monkeypatch.setenv("KVSERVE_TEST_REDIS_PASSWORD", "s3cret-test-pw")

        async def with_password() -> None:
            s = store(server, prefix, password_env="KVSERVE_TEST_REDIS_PASSWORD")
            assert (await s.acquire_slot(KEY, 1)).slot is not None and s.up
            await s.aclose()

        run(with_password())
        assert server.client().zcard(f"{prefix}:key:{KEY}:slots") == 1
        monkeypatch.delenv("KVSERVE_TEST_REDIS_PASSWORD")

        async def without() -> None:  # refused by Redis: serves from the local counts
            s = store(server, prefix, password_env="KVSERVE_TEST_REDIS_PASSWORD")
            grant = await s.acquire_slot("bbbbbbbbbbbb", 1)
            assert grant.slot is not None and grant.slot.local and not s.up
            await s.aclose()

        run(without())
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _no_secrets_in_redis(redis_server: RedisServer, prefix: str) -> Iterator[None]:
    """Whatever a test wrote: only key ids, slot members and numbers, under the prefix."""
    yield
    if not redis_server.running:
        return
    client = redis_server.client()
    for key in client.scan_iter(f"{prefix}:*"):
        assert key.startswith(f"{prefix}:key:") and key.rsplit(":", 1)[1] in ("slots", "tokens"), key


def test_a_late_answer_leaves_no_orphan_slot(redis_server: RedisServer, prefix: str) -> None:
    """The acquire script ran in Redis but its answer came after the call's deadline: the
    store fell back locally, and the member it never learned about must not hold the key
    full once Redis answers again."""

    async def scenario() -> Any:
        s = store(redis_server, prefix, socket_timeout_s=0.2)
        real = s._acquire

        async def late(keys: list[str], args: list[Any]) -> Any:
            result = await real(keys=keys, args=args)  # the script runs in Redis ...
            await asyncio.sleep(1.0)  # ... the answer arrives too late (slow network)
            return result

        s._acquire = late  # type: ignore[method-assign]
        grant = await s.acquire_slot(KEY, 1)
        assert grant.slot is not None and grant.slot.local and not s.up
        s._acquire = real  # type: ignore[method-assign]
        s.release_slot(grant.slot)
        await eventually(lambda: s.up, "the store to reconnect")
        again = await s.acquire_slot(KEY, 1)
        members = redis_server.client().zrange(f"{prefix}:key:{KEY}:slots", 0, -1)
        await close(s)
        return again, members

    again, members = run(scenario())
    assert again.slot is not None and not again.slot.local, again  # limit 1, nothing in flight
    assert len(members) == 1


def test_reconnect_survives_an_outage_during_its_write_back(prefix: str) -> None:
    """Redis flaps while the store writes its slots back: the store keeps trying and is up
    once Redis answers again (it used to stop trying for good)."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    async def scenario() -> bool:
        s = RedisStoreSpec(url="redis://127.0.0.1:1", key_prefix=prefix, socket_timeout_s=0.05,
                           reconnect_max_s=0.1).build()
        state = {"ping_ok": False, "flaps": 1}

        async def ping() -> bool:
            if not state["ping_ok"]:
                raise RedisConnectionError("down")
            return True

        async def renew(keys: list[str], args: list[Any]) -> int:
            if state["flaps"]:
                state["flaps"] -= 1
                state["ping_ok"] = False  # down again in the middle of the write-back
                raise RedisConnectionError("flap")
            return 0

        async def zrem(key: str, *members: str) -> int:  # the write-back removes the orphan
            if not state["ping_ok"]:
                raise RedisConnectionError("down")
            return len(members)

        # Nothing listens on port 1: every command the write-back sends is stubbed.
        s._client.ping = ping  # type: ignore[method-assign]
        s._client.zrem = zrem  # type: ignore[method-assign]
        s._renew = renew  # type: ignore[method-assign]
        grant = await s.acquire_slot(KEY, 5)  # nothing listens on port 1: local, down
        assert grant.slot is not None and grant.slot.local and not s.up
        state["ping_ok"] = True
        await eventually(lambda: state["flaps"] == 0, "the write-back to meet the flap")
        state["ping_ok"] = True
        await eventually(lambda: s.up and s._reconnecting.done(), "the store to come back after the flap",
                         timeout_s=10)
        up = s.up  # and it stays up: the reconnect loop finished with Redis answering
        await close(s)
        return up

    assert run(scenario())


def test_a_slot_released_during_the_write_back_is_not_counted_after_it(redis_server: RedisServer, prefix: str) -> None:
    """Two clients at their limit of 2 through an outage (the integration test's race, once
    seen in CI as a 429): slots taken while Redis was down are written back when it
    returns; one released while that ADD is on its way is ZREMed (and carried by the next
    acquire) before the ADD re-adds it. The acquire after the ADD must not count it."""
    slots_key = f"{prefix}:key:{KEY}:slots"

    async def scenario() -> None:
        s = store(redis_server, prefix)
        real = s._renew
        add_may_go = asyncio.Event()
        after_add: dict[str, Any] = {}

        async def gated(keys: list[str], args: list[Any]) -> Any:
            if args[1] != "ADD":
                return await real(keys=keys, args=args)
            await add_may_go.wait()  # the ADD is slow to land
            result = await real(keys=keys, args=args)
            # Landed: the second client's request ends and its next one comes at once.
            s.release_slot(second.slot)
            after_add["grant"] = await s.acquire_slot(KEY, 2)
            after_add["members"] = set(redis_server.client().zrange(slots_key, 0, -1))
            return result

        s._renew = gated  # type: ignore[method-assign]
        with redis_server.stopped():
            first = await s.acquire_slot(KEY, 2)
            second = await s.acquire_slot(KEY, 2)
            assert first.slot.local and second.slot.local and not s.up
        await eventually(lambda: s.up, "the store to reconnect")  # its write-back waits at the gate
        s.release_slot(first.slot)  # the first client's request ends, its next one comes at once
        again = await s.acquire_slot(KEY, 2)
        assert again.slot is not None and not again.slot.local
        add_may_go.set()
        await eventually(lambda: "grant" in after_add, "the write-back's ADD")
        grant = after_add["grant"]
        assert grant.slot is not None, f"refused at {grant.in_flight} in flight: {after_add['members']}"
        await eventually(lambda: not s._releasing, "the releases to land")
        assert set(redis_server.client().zrange(slots_key, 0, -1)) == {again.slot.member, grant.slot.member}
        await close(s)

    run(scenario())
