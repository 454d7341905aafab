"""The ingress replicas' shared state in Redis: per-API-key concurrency slots and
tokens-per-minute budgets, counted cluster-wide (router/frontend/key_limits.py's LimitStore).

Keys (never an API key or a prompt: `key_id` is the first 12 hex digits of the key's SHA-256):

    {prefix}:key:{key_id}:slots   sorted set: one member per request in flight,
                                  "{replica_id}:{seq}", scored by its lease's expiry (ms)
    {prefix}:key:{key_id}:tokens  hash {tokens, stamp}: the key's token bucket

Every script reads Redis's own clock (TIME), so that replicas with skewed clocks agree.
A replica renews the leases of its slots every lease_ttl_s/3; the slots of a replica
that died expire after lease_ttl_s (acquire drops expired members before counting), and
each key expires as a whole once nobody touches it (a bucket untouched for a minute is
full again, so its expiry changes nothing).

Redis down: every call answers at once from the fallback LocalLimitStore (this replica's
counts; or 503 with `when_down="refuse"`), one warning is logged, the observer's metrics
show it (kvserve:limit_store_up 0, kvserve:limit_store_local_decisions counting), and a background task pings with backoff; when Redis
answers again one line says so, the slots held here (including those taken while it was
down) are written back (it may have restarted empty), and Redis counts again. A call on
a hung Redis waits at most 2 x socket_timeout_s, once: after that failure the store is
down and the following calls do not wait. Giving back (release, refund) is fire-and-forget;
the next acquire for the same key from this replica carries the removal of slots released
here whose ZREM may not have landed yet (a client that sends its next request as soon as
the last one ends must not meet its own released slot). A release that never lands leaves
a slot that expires with its lease; a lost refund is gone (the budget refills within a
minute).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from router import errors
from cluster.lora_registry import RedisAdapterRegistry
from cluster.state_store_scripts import ACQUIRE, GIVE_BACK, RENEW, TAKE
from router.frontend.key_limits import LocalLimitStore, SlotGrant, TokenGrant

logger = logging.getLogger(__name__)

_RECONNECT_MIN_S = 0.1
_BUCKET_TTL_MS = 60_000

@dataclass(frozen=True)
class RedisStoreSpec:
    """What cluster/app.py puts in IngressSettings.state_store: plain data (it is pickled
    to the ingress replicas), the password's variable name only, never the password."""

    url: str
    key_prefix: str
    password_env: str | None = "KVSERVE_REDIS_PASSWORD"
    socket_timeout_s: float = 0.2
    lease_ttl_s: float = 30.0
    reconnect_max_s: float = 2.0
    # While Redis is unreachable: "local" counts on this replica (up to N x the limits with
    # N ingress replicas; the observer's metrics and a warning say so), "refuse" answers
    # every limited request 503 until Redis is back.
    when_down: str = "local"

    def build(self) -> RedisLimitStore:
        warning = exposure_warning(self)
        if warning:
            logger.warning(warning)
        return RedisLimitStore(self)

    def adapter_registry(self) -> RedisAdapterRegistry:
        """The run-time LoRA adapters' shared list (cluster/lora_registry.py). Its calls are
        rare (loads, unloads, a version read per second per replica): they may wait longer
        than a limit check."""
        return RedisAdapterRegistry(self.url, self.key_prefix, self.password_env, self.socket_timeout_s * 5)


def exposure_warning(spec: RedisStoreSpec) -> str | None:
    """What an ingress replica says at start about a remote Redis that anyone on its network
    could read or write (the keys' limits, the shared routing view, the run-time adapters): no
    password, or plaintext to a host that is not this machine. None: nothing to say."""
    parts = urlsplit(spec.url)
    if parts.hostname in ("127.0.0.1", "localhost", "::1"):
        return None  # this machine's own (a local cluster)
    problems = []
    if not (spec.password_env and os.environ.get(spec.password_env)):
        problems.append(f"no password (set {spec.password_env or 'state.redis_password_env'})")
    if parts.scheme != "rediss":
        problems.append("no TLS to a remote host (use rediss://)")
    if not problems:
        return None
    return (f"the shared state's Redis at {parts.hostname}:{parts.port or 6379} has " + " and ".join(problems)
            + ": whoever reaches it can change the per-key limits, the routing view and the LoRA adapters")


class StoreObserver(Protocol):
    """What watches the store (router/frontend/metrics.py's IngressMetrics): whether Redis
    answers, and each limit decision made from this replica's counts instead."""

    def limit_store_up(self, up: bool) -> None: ...

    def limit_decided_locally(self, kind: str) -> None: ...


@dataclass(frozen=True)
class _Slot:
    key_id: str
    member: str
    local: bool  # taken from the fallback while Redis was down


@dataclass(frozen=True)
class _Receipt:
    key_id: str
    tokens_per_minute: int


_DOWN = object()


class RedisLimitStore:
    """A LimitStore in Redis, with `local` as the fallback. Used from one event loop
    (the ingress replica's); release/refund may come from any thread (a lease's __del__)."""

    def __init__(self, spec: RedisStoreSpec, local: LocalLimitStore | None = None) -> None:
        self.spec = spec
        self.local = local if local is not None else LocalLimitStore()
        self.replica_id = uuid.uuid4().hex[:12]
        self.up = True  # until a call fails
        parts = urlsplit(spec.url)
        self._where = f"{parts.hostname}:{parts.port or 6379}"  # for logs: no credentials
        password = os.environ.get(spec.password_env) if spec.password_env else None
        self._client = aioredis.Redis.from_url(
            spec.url,
            password=password or None,
            socket_timeout=spec.socket_timeout_s,
            socket_connect_timeout=spec.socket_timeout_s,
            retry=Retry(NoBackoff(), 0),  # no retries: a failed call falls back at once
            health_check_interval=0,
        )
        self._acquire = self._client.register_script(ACQUIRE)
        self._renew = self._client.register_script(RENEW)
        self._take = self._client.register_script(TAKE)
        self._give_back = self._client.register_script(GIVE_BACK)
        self._seq = itertools.count()
        self._held: dict[str, str] = {}  # member -> key_id: every slot this replica holds
        # key_id -> members released here whose ZREM has not been seen to land: the next
        # acquire for the key removes them first, so that a client that sends its next
        # request as soon as the last one ends is not refused because of the release's lag.
        self._releasing: dict[str, set[str]] = {}
        # Members a write-back may (re-)add to Redis: a release of one of them does not
        # count as landed (it stays in _releasing, carried by each acquire) until that
        # write-back's ADD has landed, since the ADD can come after the release's ZREM.
        self._rewriting: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._heartbeat: asyncio.Task[None] | None = None
        self._reconnecting: asyncio.Task[None] | None = None
        self._reported_response_error = False
        self.observer: StoreObserver | None = None  # set by the ingress (its metrics)

    def _slots_key(self, key_id: str) -> str:
        return f"{self.spec.key_prefix}:key:{key_id}:slots"

    def _tokens_key(self, key_id: str) -> str:
        return f"{self.spec.key_prefix}:key:{key_id}:tokens"

    @property
    def _ttl_ms(self) -> int:
        return int(self.spec.lease_ttl_s * 1000)

    # -- LimitStore -----------------------------------------------------------------------
    async def acquire_slot(self, key_id: str, limit: int) -> SlotGrant:
        self._start()
        member = f"{self.replica_id}:{next(self._seq)}"
        released = sorted(self._releasing.get(key_id, ()))
        try:
            result = await self._call(
                lambda: self._acquire(keys=[self._slots_key(key_id)], args=[limit, member, self._ttl_ms, *released])
            )
        except BaseException:  # cancelled (the client left): the script may have run anyway
            self._orphaned(key_id, member)
            raise
        if result is not _DOWN:
            self._released_landed(key_id, released)
        if result is _DOWN:
            # The script may have added the member before the call timed out: nobody would
            # renew or remove it, and the key would look full for a lease's life.
            self._orphaned(key_id, member)
            self._decide_locally("concurrency")
            # The slots this replica holds in Redis count too (else one replica could run
            # up to twice the limit for a key while Redis is down).
            held_in_redis = sum(1 for k in self._held.values() if k == key_id) - self.local.in_flight(key_id)
            grant = self.local.try_acquire(key_id, max(limit - held_in_redis, 0))
            if grant.slot is None:
                return grant
            member = f"{self.replica_id}:{next(self._seq)}"  # not the orphan's name
            slot, count = _Slot(key_id, member, local=True), grant.in_flight
        else:
            taken, count = int(result[0]), int(result[1])
            if not taken:
                return SlotGrant(None, count)
            slot = _Slot(key_id, member, local=False)
        self._held[member] = key_id
        return SlotGrant(slot, count)

    def _orphaned(self, key_id: str, member: str) -> None:
        """A member this replica may have written without knowing: removed by the next
        acquire for the key, or by the write-back after an outage."""
        self._releasing.setdefault(key_id, set()).add(member)

    def release_slot(self, slot: Any) -> None:
        assert isinstance(slot, _Slot)
        self._held.pop(slot.member, None)
        if slot.local:
            self.local.release(slot.key_id)
        if slot.local and not self.up and slot.member not in self._rewriting:
            return  # taken and given back during the outage: never written to Redis
        # A local slot too: it was written back to Redis when Redis came back.
        self._releasing.setdefault(slot.key_id, set()).add(slot.member)
        if self.up:
            self._spawn(lambda: self._remove_released(slot.key_id, [slot.member]))

    async def take_tokens(self, key_id: str, amount: int, tokens_per_minute: int) -> TokenGrant:
        self._start()
        result = await self._call(
            lambda: self._take(keys=[self._tokens_key(key_id)], args=[amount, tokens_per_minute, _BUCKET_TTL_MS])
        )
        if result is _DOWN:
            self._decide_locally("tokens")
            return self.local.take(key_id, amount, tokens_per_minute)
        wait_ms = int(result)
        if wait_ms == 0:
            return TokenGrant(0.0, _Receipt(key_id, tokens_per_minute))
        return TokenGrant(math.inf if wait_ms < 0 else wait_ms / 1000.0)

    def refund_tokens(self, receipt: Any, amount: int) -> None:
        if not isinstance(receipt, _Receipt):  # taken from the fallback
            self.local.refund_tokens(receipt, amount)
            return
        if self.up:
            key, args = self._tokens_key(receipt.key_id), [amount, receipt.tokens_per_minute, _BUCKET_TTL_MS]
            self._spawn(lambda: self._call(lambda: self._give_back(keys=[key], args=args)))

    async def aclose(self) -> None:
        """Stops the background tasks and closes the connections. Slots still held are not
        released: they expire with their leases (as when the replica dies)."""
        for task in [self._heartbeat, self._reconnecting, *self._tasks]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in [self._heartbeat, self._reconnecting, *self._tasks] if t), return_exceptions=True)
        await self._client.aclose()

    # -- Redis calls, down and back -----------------------------------------------------------
    def _decide_locally(self, kind: str) -> None:
        """Redis did not answer this decision: refuse it (503) or count it here, visibly."""
        if self.spec.when_down == "refuse":
            raise errors.APIError(503, "Per-key limits cannot be checked right now; retry shortly.", "server_error",
                                  None, "limits_unavailable")
        if self.observer is not None:
            self.observer.limit_decided_locally(kind)

    async def _call(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """The call's result, or _DOWN at once when Redis is down or this call finds it so."""
        if not self.up:
            return _DOWN
        try:
            async with asyncio.timeout(2 * self.spec.socket_timeout_s):  # connect + answer
                return await call()
        except ResponseError as e:  # a bug or a foreign key of the wrong type: not an outage
            if not self._reported_response_error:
                self._reported_response_error = True
                logger.error("Redis state store at %s refused a command (%s); using this replica's counts for it",
                             self._where, e)
            return _DOWN
        except (RedisError, OSError, TimeoutError) as e:
            self._went_down(e)
            return _DOWN

    def _went_down(self, error: BaseException) -> None:
        if not self.up:
            return
        self.up = False
        if self.observer is not None:
            self.observer.limit_store_up(False)
        if self.spec.when_down == "refuse":
            logger.warning("Redis state store at %s unreachable (%s); requests of limited keys are refused (503) "
                           "until it is back", self._where, type(error).__name__)
        else:
            logger.warning("Redis state store at %s unreachable (%s); per-key limits are counted per ingress "
                           "replica until it is back", self._where, type(error).__name__)
        if self._loop is not None and (self._reconnecting is None or self._reconnecting.done()):
            self._reconnecting = self._loop.create_task(self._reconnect())

    async def _reconnect(self) -> None:
        delay = _RECONNECT_MIN_S
        while True:
            await asyncio.sleep(delay)  # backoff between pings, not synchronisation
            try:
                async with asyncio.timeout(2 * self.spec.socket_timeout_s):
                    await self._client.ping()
            except (RedisError, OSError, TimeoutError):
                delay = min(2 * delay, self.spec.reconnect_max_s)
                continue
            # Idle pooled connections from before the outage are dead (a restarted Redis
            # closed them): drop them, or the next call to pick one fails and takes the
            # store down again for a whole backoff.
            await self._client.connection_pool.disconnect(inuse_connections=False)
            self.up = True
            if self.observer is not None:
                self.observer.limit_store_up(True)
            logger.warning("Redis state store at %s is back; per-key limits are cluster-wide again", self._where)
            await self._write_back()
            if self.up:
                return
            # It went down again during the write-back; _went_down saw this task still
            # running and started none: keep trying from here.
            delay = _RECONNECT_MIN_S

    # -- leases -------------------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.spec.lease_ttl_s / 3)
            if self.up:
                await self._renew_held("XX", dict(self._held))

    async def _renew_held(self, mode: str, slots: dict[str, str]) -> None:
        """Renews (XX: only members still there) or writes back (ADD) `slots` (member -> key_id)."""
        for key_id, members in _by_key(slots).items():
            key = self._slots_key(key_id)
            if await self._call(lambda: self._renew(keys=[key], args=[self._ttl_ms, mode, *members])) is _DOWN:
                break

    async def _write_back(self) -> None:
        """After an outage: Redis may have restarted empty, and slots taken meanwhile are
        only counted here. A slot released while the ADD is on its way may be re-added
        after its release's ZREM (and after an acquire that carried it), so its release
        stays pending (_rewriting) until the ADD has landed, then is removed once more."""
        slots = dict(self._held)
        self._rewriting |= set(slots)  # kept, with any earlier attempt's, until an ADD lands
        await self._renew_held("ADD", slots)
        if not self.up:
            return  # down again on the way: the next write-back sends it all again
        self._rewriting.clear()
        for key_id, members in list(self._releasing.items()):
            await self._remove_released(key_id, sorted(members))

    async def _remove_released(self, key_id: str, members: list[str]) -> None:
        if members and await self._call(lambda: self._client.zrem(self._slots_key(key_id), *members)) is not _DOWN:
            self._released_landed(key_id, members)

    def _released_landed(self, key_id: str, members: list[str]) -> None:
        pending = self._releasing.get(key_id)
        landed = [m for m in members if m not in self._rewriting]  # a write-back may still re-add the others
        if pending is not None and landed:
            pending.difference_update(landed)
            if not pending:
                self._releasing.pop(key_id, None)

    # -- plumbing -------------------------------------------------------------------------------
    def _start(self) -> None:
        """Binds the store to the running loop (the first call) and starts the heartbeat."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        if self._heartbeat is None:
            self._heartbeat = self._loop.create_task(self._heartbeat_loop())

    def _spawn(self, make: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        """Runs `make()` on the store's loop, from that loop or any other thread; dropped
        when the loop is gone (the slot then expires with its lease)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            task = loop.create_task(make())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif loop.is_running():
            asyncio.run_coroutine_threadsafe(make(), loop)


def _by_key(slots: dict[str, str]) -> dict[str, list[str]]:
    """member -> key_id, grouped: key_id -> members."""
    grouped: dict[str, list[str]] = {}
    for member, key_id in slots.items():
        grouped.setdefault(key_id, []).append(member)
    return grouped
