"""Stored responses, in memory and in a real Redis: owner-only reads, TTL, the entry bound,
the record-size bound, delete."""
from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from router.frontend.responses_api.store import ResponseStoreSpec, StoredResponse
from tests.support.redis_server import RedisServer


def record(owner: str, text: str = "hi") -> StoredResponse:
    return StoredResponse(owner, {"id": "x", "output": [text]}, [{"role": "user", "content": text}])


async def exercise(spec: ResponseStoreSpec) -> None:
    store = spec.build()
    assert await store.put("resp_a", record("alpha"))
    got = await store.get("resp_a", "alpha")
    assert got is not None and got.messages == [{"role": "user", "content": "hi"}] and got.response["id"] == "x"
    assert await store.get("resp_a", "beta") is None  # another key sees nothing
    assert not await store.delete("resp_a", "beta")
    assert await store.get("resp_a", "alpha") is not None
    assert await store.delete("resp_a", "alpha")
    assert await store.get("resp_a", "alpha") is None
    assert not await store.put("resp_big", record("alpha", "x" * spec.max_record_bytes))  # over the record bound
    assert await store.get("resp_big", "alpha") is None
    for i in range(spec.max_entries + 2):  # the oldest go first
        assert await store.put(f"resp_{i}", record("alpha"))
    assert await store.get("resp_0", "alpha") is None and await store.get("resp_1", "alpha") is None
    assert await store.get(f"resp_{spec.max_entries + 1}", "alpha") is not None


def test_memory_store() -> None:
    asyncio.run(exercise(ResponseStoreSpec(max_entries=3, max_record_bytes=1000)))


def test_memory_store_bounds_its_bytes() -> None:
    async def run() -> None:
        size = len(json.dumps({"owner": "alpha", "response": {"id": "x", "output": ["hi"]},
                               "messages": [{"role": "user", "content": "hi"}]}).encode())
        store = ResponseStoreSpec(max_total_bytes=3 * size).build()
        for i in range(5):
            assert await store.put(f"resp_{i}", record("alpha"))
        assert [await store.get(f"resp_{i}", "alpha") is not None for i in range(5)] == [False, False, True, True, True]
    asyncio.run(run())


def test_memory_store_expires() -> None:
    async def run() -> None:
        store = ResponseStoreSpec(ttl_s=0.01).build()
        await store.put("resp_a", record("alpha"))
        await asyncio.sleep(0.05)  # past the TTL: the record itself is what is tested
        assert await store.get("resp_a", "alpha") is None
    asyncio.run(run())


def test_redis_store(redis_server: RedisServer) -> None:
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    spec = ResponseStoreSpec(url=redis_server.url, key_prefix=prefix, password_env=None, max_entries=3, max_record_bytes=1000)
    asyncio.run(exercise(spec))
    client = redis_server.client()
    assert client.zcard(f"{prefix}:responses") == 3
    assert 0 < client.pttl(f"{prefix}:response:resp_4") <= 3600_000


def test_redis_down_is_a_503() -> None:
    from router import errors
    from tests.support.redis_server import free_port

    spec = ResponseStoreSpec(url=f"redis://127.0.0.1:{free_port()}/0", password_env=None, socket_timeout_s=0.2)

    async def run() -> None:
        with pytest.raises(errors.APIError) as info:
            await spec.build().get("resp_a", "alpha")
        assert info.value.status == 503

    asyncio.run(run())
