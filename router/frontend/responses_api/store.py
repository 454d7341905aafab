"""Stored responses (`store: true`): what GET /v1/responses/{id} returns and what a later
`previous_response_id` continues. In Redis when the cluster has `state.redis_url` (every
ingress replica sees every response), else in this replica's memory.

A record is {"owner": key_id, "response": the response body, "messages": the chat
conversation it ended (input and output, never the request's `instructions`, which the
spec does not carry over)}. Records are read back only by the API key that made them:
another key gets the same 404 as for an id that never existed.

Bounds: every record expires `ttl_s` after it was written; a record over
`max_record_bytes` is not stored (the response says `store: false`); at most
`max_entries` records are kept (the oldest go first): in memory an ordered dict (also
bounded to `max_total_bytes`), in Redis a sorted set of ids scored by write time, trimmed
on each write.
"""
from __future__ import annotations

import json
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

from router import errors


@dataclass(frozen=True)
class StoredResponse:
    owner: str
    response: dict[str, Any]
    messages: list[dict[str, Any]]


@dataclass(frozen=True)
class ResponseStoreSpec:
    """Plain data (pickled to the ingress replicas); the password's variable name only."""

    url: str | None = None  # None: this replica's memory
    key_prefix: str = "kvserve"
    password_env: str | None = "KVSERVE_REDIS_PASSWORD"
    socket_timeout_s: float = 0.5
    ttl_s: float = 3600.0
    max_entries: int = 10_000
    max_record_bytes: int = 4 * 1024**2
    # In memory, the records' bytes together (the oldest go first); in Redis its own
    # maxmemory bounds them (max_entries x max_record_bytes at most).
    max_total_bytes: int = 256 * 1024**2

    def __post_init__(self) -> None:
        if min(self.ttl_s, self.max_entries, self.max_record_bytes, self.max_total_bytes) <= 0:
            raise ValueError("response store ttl_s, max_entries, max_record_bytes and max_total_bytes must be > 0")

    def build(self) -> ResponseStore:
        return RedisResponseStore(self) if self.url is not None else MemoryResponseStore(self)


class ResponseStore(Protocol):
    async def put(self, response_id: str, record: StoredResponse) -> bool: ...

    async def get(self, response_id: str, owner: str) -> StoredResponse | None: ...

    async def delete(self, response_id: str, owner: str) -> bool: ...


def _encode(record: StoredResponse) -> bytes:
    return json.dumps({"owner": record.owner, "response": record.response, "messages": record.messages},
                      ensure_ascii=False).encode()


def _decode(data: bytes | str) -> StoredResponse:
    raw = json.loads(data)
    return StoredResponse(raw["owner"], raw["response"], raw["messages"])


class MemoryResponseStore:
    """This replica's records: insertion-ordered, so the oldest is always first."""

    def __init__(self, spec: ResponseStoreSpec) -> None:
        self.spec = spec
        self._records: OrderedDict[str, tuple[float, bytes]] = OrderedDict()  # id -> (expiry, encoded)
        self._bytes = 0  # the records' encoded bytes together

    async def put(self, response_id: str, record: StoredResponse) -> bool:
        data = _encode(record)
        if len(data) > self.spec.max_record_bytes:
            return False
        now = time.monotonic()
        self._drop(response_id)
        while self._records:  # expired ones first, then the oldest while over a bound
            oldest_id, (expiry, _) = next(iter(self._records.items()))
            full = len(self._records) >= self.spec.max_entries or self._bytes + len(data) > self.spec.max_total_bytes
            if expiry > now and not full:
                break
            self._drop(oldest_id)
        self._records[response_id] = (now + self.spec.ttl_s, data)
        self._bytes += len(data)
        return True

    def _drop(self, response_id: str) -> None:
        entry = self._records.pop(response_id, None)
        if entry is not None:
            self._bytes -= len(entry[1])

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        entry = self._records.get(response_id)
        if entry is None:
            return None
        if entry[0] <= time.monotonic():
            self._drop(response_id)
            return None
        record = _decode(entry[1])
        return record if record.owner == owner else None

    async def delete(self, response_id: str, owner: str) -> bool:
        if await self.get(response_id, owner) is None:
            return False
        self._drop(response_id)
        return True


class RedisResponseStore:
    """Records as `{prefix}:response:{id}` strings with the TTL; `{prefix}:responses` the
    sorted set that bounds their number. Redis unreachable: 503 (a continuation cannot be
    served without its conversation, and a response the client asked to store must not
    be silently lost)."""

    def __init__(self, spec: ResponseStoreSpec) -> None:
        import redis.asyncio as aioredis

        self.spec = spec
        password = os.environ.get(spec.password_env) if spec.password_env else None
        self._client = aioredis.Redis.from_url(
            spec.url, password=password or None, socket_timeout=spec.socket_timeout_s,
            socket_connect_timeout=spec.socket_timeout_s,
        )
        self._index = f"{spec.key_prefix}:responses"

    def _key(self, response_id: str) -> str:
        return f"{self.spec.key_prefix}:response:{response_id}"

    async def put(self, response_id: str, record: StoredResponse) -> bool:
        data = _encode(record)
        if len(data) > self.spec.max_record_bytes:
            return False
        async with self._unavailable_as_503():
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.set(self._key(response_id), data, px=int(self.spec.ttl_s * 1000))
                pipe.zadd(self._index, {response_id: time.time()})
                pipe.zremrangebyscore(self._index, "-inf", time.time() - self.spec.ttl_s)
                pipe.zcard(self._index)
                count = (await pipe.execute())[-1]
            excess = int(count) - self.spec.max_entries
            if excess > 0:
                oldest = [m.decode() if isinstance(m, bytes) else m for m, _ in await self._client.zpopmin(self._index, excess)]
                await self._client.delete(*[self._key(i) for i in oldest])
        return True

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        async with self._unavailable_as_503():
            data = await self._client.get(self._key(response_id))
        if data is None:
            return None
        record = _decode(data)
        return record if record.owner == owner else None

    async def delete(self, response_id: str, owner: str) -> bool:
        if await self.get(response_id, owner) is None:
            return False
        async with self._unavailable_as_503():
            await self._client.delete(self._key(response_id))
            await self._client.zrem(self._index, response_id)
        return True

    def _unavailable_as_503(self) -> _RedisErrors:
        return _RedisErrors()


class _RedisErrors:
    """Turns a Redis failure into a 503 the client can retry."""

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        from redis.exceptions import RedisError

        if exc is not None and isinstance(exc, (RedisError, OSError)):
            raise errors.APIError(503, "The response store is unavailable; retry later.", "server_error", None,
                                  "response_store_unavailable") from None
        return False
