"""A routing view shared by every ingress replica through Redis: each router adds the
work every OTHER router promised each replica since that replica's last report, and the
prefix hints every router learned.

Where it lives in Redis (the key layout, the wire format, the Lua scripts and why one
field per router): router/routing/redis_view_scripts.py.

Reads happen in `sync()`, awaited by the Serve router before each decision:
  * mode "per_decision": one round trip (the work of all candidates + new hints, one
    pipeline), shared by the decisions that start while it is in flight, waited for at most
    `decision_wait_s` (beyond that the decision uses the last answer and the read lands
    for the next one);
  * mode "cached": no round trip in the decision; a background task reads every refresh_s.
Writes are fire-and-forget, coalesced per event-loop turn, one pipeline.

Redis down (a call fails or times out): one warning, the view is this router's private view
at once (other routers' work is forgotten, not trusted stale), nothing waits on Redis; a
background task pings with backoff and, when Redis answers, says so once and republishes
this router's work (Redis may have restarted empty). Methods are called from one event
loop (the router's); the ledger methods are synchronous (a policy calls them in rank()).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal
from urllib.parse import urlsplit

from router.routing.redis_view_scripts import (
    PUBLISH_SCRIPT, READ_SCRIPT, as_text, encode_work, hints_key, parse_work, replica_name, script_sha, view_key,
)
from router.routing.reservations import PerReplica, ReplicaKey, Unreflected
from router.routing.routing_view import DEFAULT_HINT_TTL_S, HintTable, LocalRoutingView

logger = logging.getLogger(__name__)

_RECONNECT_MIN_S = 0.1

@dataclass(frozen=True)
class SharedViewSpec:
    """Where and how the routers share their view (plain data: it travels in the Serve
    router's request_router_kwargs as a dict; the password's variable name only)."""

    url: str
    key_prefix: str
    password_env: str | None = "KVSERVE_REDIS_PASSWORD"
    socket_timeout_s: float = 0.2
    mode: Literal["per_decision", "cached"] = "per_decision"
    refresh_s: float = 0.05  # mode "cached": read this often
    decision_wait_s: float = 0.005  # mode "per_decision": a decision waits at most this for the read
    entry_ttl_s: float = 10.0  # a router's published work counts this long after its last write
    hint_ttl_s: float = DEFAULT_HINT_TTL_S
    max_hint_entries: int = 10_000
    reconnect_max_s: float = 2.0

    def __post_init__(self) -> None:
        if self.mode not in ("per_decision", "cached"):
            raise ValueError(f"shared view mode must be 'per_decision' or 'cached', got {self.mode!r}")
        for name in ("socket_timeout_s", "refresh_s", "decision_wait_s", "entry_ttl_s", "hint_ttl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"shared view {name} must be > 0")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SharedViewSpec:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown shared view setting(s) {unknown}; known: {sorted(known)}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class RedisRoutingView:
    """A RoutingView: this router's LocalRoutingView plus the other routers' work and hints."""

    def __init__(self, spec: SharedViewSpec, report_lag_s: float = 0.05, router_id: str | None = None) -> None:
        import redis.asyncio  # noqa: F401 -- a required dependency: fail here, not mid-request

        self.spec = spec
        self.router_id = router_id or uuid.uuid4().hex[:12]
        self.local = LocalRoutingView(report_lag_s, spec.hint_ttl_s)
        self.up = True  # until a call fails
        self.num_round_trips = 0
        # replica name -> the other routers' work there, each with its newest dispatch time
        self._others: dict[str, list[tuple[Unreflected, float]]] = {}
        self._shared_hints = HintTable(spec.hint_ttl_s)  # keyed by replica name
        self._keys: dict[str, ReplicaKey] = {}  # replica name -> key, for every replica seen
        self._dirty: set[ReplicaKey] = set()
        self._new_hints: list[tuple[str, str]] = []  # (replica name, hashes as text)
        self._stream_id = "0"  # the last hint entry read; "0": from the start (warm start)
        self._last_full_publish = 0.0
        parts = urlsplit(spec.url)
        self._where = f"{parts.hostname}:{parts.port or 6379}"  # for logs: no credentials
        self._client: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flush_scheduled = False
        self._reading: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._refresher: asyncio.Task[None] | None = None
        self._reconnecting: asyncio.Task[None] | None = None
        self._closed = False

    # -- the ledger's methods (RoutingView) ---------------------------------------------------
    def __len__(self) -> int:
        return len(self.local)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.local

    def replica_of(self, request_id: str) -> ReplicaKey | None:
        return self.local.replica_of(request_id)

    def reserve(self, request_id: str, replica: ReplicaKey, need_by_replica: Mapping[ReplicaKey, int], now: float,
                prefill_tokens: PerReplica = 0, decode_blocks: int = 0) -> None:
        self._changed(self.local.replica_of(request_id), replica)
        self.local.reserve(request_id, replica, need_by_replica, now, prefill_tokens, decode_blocks)

    def routed(self, request_id: str, replica: ReplicaKey) -> None:
        self._changed(self.local.replica_of(request_id), replica)
        self.local.routed(request_id, replica)

    def complete(self, request_id: str, replica: ReplicaKey | None = None) -> None:
        self._changed(self.local.replica_of(request_id))
        self.local.complete(request_id, replica)

    def observe_report(self, replica: ReplicaKey, report_timestamp: float) -> None:
        before = self.local.unreflected(replica)
        self.local.observe_report(replica, report_timestamp)
        if self.local.unreflected(replica) != before:
            self._changed(replica)

    def unreflected(self, replica: ReplicaKey) -> Unreflected:
        """This router's work (exact) plus each other router's as last read, unless a report
        this router has seen already reflects that router's newest dispatch there (the other
        router may not have seen the report yet: it may be idle)."""
        own = self.local.unreflected(replica)
        others = self._others.get(replica_name(replica)) if self.up else None
        if not others:
            return own
        cutoff = self.local.report_cutoff(replica)
        b, r, p, d = own.blocks, own.requests, own.prefill_tokens, own.decode_blocks
        for work, newest in others:
            if newest > cutoff:
                b, r, p, d = b + work.blocks, r + work.requests, p + work.prefill_tokens, d + work.decode_blocks
        return Unreflected(b, r, p, d)

    def outstanding(self, replica: ReplicaKey) -> int:
        return self.local.outstanding(replica)

    def prune(self, now: float, live_replicas: set[ReplicaKey] | None, unconfirmed_ttl_s: float, ttl_s: float) -> int:
        before = {k: self.local.unreflected(k) for k in self.local.known_replicas()}
        dropped = self.local.prune(now, live_replicas, unconfirmed_ttl_s, ttl_s)
        self._changed(*(k for k, u in before.items() if self.local.unreflected(k) != u))
        if live_replicas is not None:
            live = {replica_name(k) for k in live_replicas}
            for name in [n for n in self._keys if n not in live]:
                del self._keys[name]
                self._others.pop(name, None)
        return dropped

    # -- prefix hints ---------------------------------------------------------------------------
    def prefix_owner_hints(self, block_hashes: Sequence[int],
                           not_before: Mapping[ReplicaKey, float] | None = None) -> dict[ReplicaKey, int]:
        hints = self.local.prefix_owner_hints(block_hashes, not_before)
        by_name = {replica_name(k): t for k, t in not_before.items()} if not_before else None
        for name, depth in self._shared_hints.match(block_hashes, by_name).items():
            key = self._keys.get(name)
            if key is not None and depth > hints.get(key, 0):
                hints[key] = depth
        return hints

    def learn_prefix(self, replica: ReplicaKey, block_hashes: Sequence[int], now: float) -> None:
        if not block_hashes:
            return
        self._remember(replica)
        known = self.local.prefix_owner_hints(block_hashes).get(replica, 0) == len(block_hashes)
        self.local.learn_prefix(replica, block_hashes, now)
        if not known and self.up:  # what this router already published is in the stream
            self._new_hints.append((replica_name(replica), ",".join(map(str, block_hashes))))
            self._schedule_flush()

    # -- Redis: reads --------------------------------------------------------------------------
    async def sync(self, replicas: Sequence[ReplicaKey]) -> None:
        """Before a decision: remember the candidates and make the others' work as fresh as
        the mode promises (see the module docstring). Never waits longer than
        decision_wait_s; never raises."""
        self._start()
        for key in replicas:
            self._remember(key)
        if not self.up:
            return
        if self.spec.mode == "cached":
            if self._refresher is None:
                self._refresher = self._spawn(self._refresh_loop())
            return
        if self._reading is None or self._reading.done():
            self._reading = self._spawn(self._read())
        try:
            await asyncio.wait_for(asyncio.shield(self._reading), self.spec.decision_wait_s)
        except TimeoutError:
            pass  # decide on the last answer; this read lands for the next decision

    async def _refresh_loop(self) -> None:
        while not self._closed:
            if self.up:
                await self._read()
            await asyncio.sleep(self.spec.refresh_s)  # the refresh period, not synchronisation

    async def _read(self) -> None:
        names = list(self._keys)
        if time.monotonic() - self._last_full_publish > self.spec.entry_ttl_s / 3:
            self._republish()  # keep this router's live fields from ageing out
        pipe = self._client.pipeline(transaction=False)
        pipe.evalsha(self._read_sha, len(names), *(self._view_key(n) for n in names),
                     self.router_id, int(self.spec.entry_ttl_s * 1000))
        pipe.xread({self._hints_key: self._stream_id}, count=1000)
        result = await self._call(pipe.execute)
        if result is None:
            return
        work, stream = result
        self._others = {n: [parse_work(v) for v in values] for n, values in zip(names, work, strict=True)}
        for _, entries in stream or ():
            for entry_id, data in entries:
                self._stream_id = as_text(entry_id)
                if as_text(data.get(b"router", b"")) != self.router_id:
                    hashes = [int(h) for h in as_text(data[b"hashes"]).split(",") if h]
                    learned_s = int(self._stream_id.split("-")[0]) / 1000.0  # Redis's clock
                    self._shared_hints.learn(as_text(data[b"replica"]), hashes, learned_s)

    # -- Redis: writes --------------------------------------------------------------------------
    def _changed(self, *replicas: ReplicaKey | None) -> None:
        for key in replicas:
            if key is not None:
                self._remember(key)
                self._dirty.add(key)
        if self.up:
            self._schedule_flush()

    def _published(self, replica: ReplicaKey) -> str:
        u = self.local.unreflected(replica)
        if u == Unreflected():
            return ""
        return encode_work(u, self.local.newest_unreflected(replica))

    def _republish(self) -> None:
        self._last_full_publish = time.monotonic()
        self._dirty.update(k for k in self.local.known_replicas() if self.local.unreflected(k) != Unreflected())

    def _schedule_flush(self) -> None:
        loop = self._loop
        if self._flush_scheduled or self._closed or loop is None or loop.is_closed():
            return
        self._flush_scheduled = True
        # Coalesced: every change of this event-loop turn goes in one pipeline.
        loop.call_soon(lambda: self._spawn(self._flush()))

    async def _flush(self) -> None:
        self._flush_scheduled = False
        dirty, self._dirty = list(self._dirty), set()
        hints, self._new_hints = self._new_hints, []
        if not (dirty or hints) or not self.up:
            return
        pipe = self._client.pipeline(transaction=False)
        if dirty:
            values = [self._published(k) for k in dirty]
            pipe.evalsha(self._publish_sha, len(dirty), *(self._view_key(replica_name(k)) for k in dirty),
                         self.router_id, int(self.spec.entry_ttl_s * 1000), *values)
        for name, hashes in hints:
            pipe.xadd(self._hints_key, {"router": self.router_id, "replica": name, "hashes": hashes},
                      maxlen=self.spec.max_hint_entries, approximate=True)
        await self._call(pipe.execute)

    # -- down and back ---------------------------------------------------------------------------
    async def _call(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """The call's result, or None at once when Redis is down or this call finds it so."""
        from redis.exceptions import NoScriptError, RedisError

        if not self.up:
            return None
        self.num_round_trips += 1
        try:
            async with asyncio.timeout(2 * self.spec.socket_timeout_s):  # connect + answer
                return await call()
        except NoScriptError:  # Redis restarted and lost the scripts: load them, next call works
            await self._load_scripts()
            return None
        except (RedisError, OSError, TimeoutError) as e:
            self._went_down(e)
            return None

    def _went_down(self, error: BaseException) -> None:
        if not self.up:
            return
        self.up = False
        self._others.clear()
        logger.warning("Redis routing view at %s unreachable (%s); router %s routes on its own view until it "
                       "is back", self._where, type(error).__name__, self.router_id)
        if self._reconnecting is None or self._reconnecting.done():
            self._reconnecting = self._spawn(self._reconnect())

    async def _reconnect(self) -> None:
        from redis.exceptions import RedisError

        delay = _RECONNECT_MIN_S
        while not self._closed:
            await asyncio.sleep(delay)  # backoff between pings, not synchronisation
            try:
                async with asyncio.timeout(2 * self.spec.socket_timeout_s):
                    await self._client.ping()
                    await self._load_scripts()
            except (RedisError, OSError, TimeoutError):
                delay = min(2 * delay, self.spec.reconnect_max_s)
                continue
            self.up = True
            logger.warning("Redis routing view at %s is back; router %s routes on the view shared by every "
                           "router again", self._where, self.router_id)
            self._republish()
            self._schedule_flush()
            return

    # -- plumbing ---------------------------------------------------------------------------------
    def _start(self) -> None:
        """Binds the view to the running loop (the router's) and connects lazily."""
        if self._client is not None:
            return
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self._loop = asyncio.get_running_loop()
        password = os.environ.get(self.spec.password_env) if self.spec.password_env else None
        self._client = aioredis.Redis.from_url(
            self.spec.url, password=password or None, socket_timeout=self.spec.socket_timeout_s,
            socket_connect_timeout=self.spec.socket_timeout_s,
            retry=Retry(NoBackoff(), 0),  # no retries: a failed call falls back at once
            health_check_interval=0,
        )
        self._read_sha = script_sha(READ_SCRIPT)
        self._publish_sha = script_sha(PUBLISH_SCRIPT)
        self._spawn(self._first_connect())

    async def _first_connect(self) -> None:
        await self._call(self._load_scripts)
        self._republish()
        self._schedule_flush()

    async def _load_scripts(self) -> None:
        await self._client.script_load(READ_SCRIPT)
        await self._client.script_load(PUBLISH_SCRIPT)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        assert self._loop is not None
        if self._closed:
            coro.close()
            done: asyncio.Future[Any] = self._loop.create_future()
            done.set_result(None)
            return done  # type: ignore[return-value]
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _remember(self, key: ReplicaKey) -> None:
        self._keys.setdefault(replica_name(key), key)

    def _view_key(self, name: str) -> str:
        return view_key(self.spec.key_prefix, name)

    @property
    def _hints_key(self) -> str:
        return hints_key(self.spec.key_prefix)

    async def aclose(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()

