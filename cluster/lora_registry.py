"""The run-time LoRA adapters every ingress replica serves, in Redis
(router/frontend/lora_modules.py's AdapterRegistry): a load or unload through any replica
is seen by all of them, and by a replica started later.

Keys (next to cluster/state_store.py's, same prefix):

    {prefix}:lora:adapters   hash name -> JSON {"path", "ref"} (ref: the directory with its
                             content digest, worker/lora/identity.py)
    {prefix}:lora:version    counter, bumped by every change: a replica re-reads the hash
                             only when it moved

A load is one script (exists? full? then add), so two replicas loading the same name, or
the last free place, cannot both win. Redis unreachable: loads and unloads answer 503
(the shared list is the truth; a change made on one replica only would be undone by the
next read), requests keep resolving from the list each replica read last.
"""
from __future__ import annotations

import json
import os
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from router import errors

# KEYS: adapters, version; ARGV: name, entry JSON, max adapters -> "ok" | "exists" | "full"
_ADD = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 'exists' end
if redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[3]) then return 'full' end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('INCR', KEYS[2])
return 'ok'
"""
# KEYS: adapters, version; ARGV: name -> 1 when it was there
_REMOVE = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 1 then redis.call('INCR', KEYS[2]) return 1 end
return 0
"""


def _unavailable() -> errors.APIError:
    return errors.APIError(503, "The shared adapter registry (Redis) is unreachable; retry later.",
                           "server_error", None, "adapter_registry_unavailable")


class RedisAdapterRegistry:
    def __init__(self, url: str, key_prefix: str, password_env: str | None, socket_timeout_s: float) -> None:
        """The shared state's Redis (cluster/state_store.py's RedisStoreSpec gives these)."""
        password = os.environ.get(password_env) if password_env else None
        self._client = aioredis.Redis.from_url(
            url, password=password or None, socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s, retry=Retry(NoBackoff(), 0), health_check_interval=0,
        )
        self._adapters = f"{key_prefix}:lora:adapters"
        self._version = f"{key_prefix}:lora:version"
        self._add = self._client.register_script(_ADD)
        self._remove = self._client.register_script(_REMOVE)

    async def version(self) -> int:
        """The list's version (RedisError when unreachable: the caller keeps what it has)."""
        return int(await self._client.get(self._version) or 0)

    async def snapshot(self) -> tuple[int, dict[str, tuple[str, str]]]:
        """(version, name -> (path, ref)), read together."""
        async with self._client.pipeline(transaction=True) as pipe:
            version, entries = await pipe.get(self._version).hgetall(self._adapters).execute()
        adapters = {}
        for name, raw in entries.items():
            entry = json.loads(raw)
            adapters[name.decode()] = (str(entry["path"]), str(entry["ref"]))
        return int(version or 0), adapters

    async def add(self, name: str, path: str, ref: str, max_adapters: int) -> str:
        """"ok", "exists" or "full"; APIError 503 when Redis is unreachable."""
        try:
            result = await self._add(keys=[self._adapters, self._version],
                                     args=[name, json.dumps({"path": path, "ref": ref}), max_adapters])
        except RedisError:
            raise _unavailable() from None
        return result.decode() if isinstance(result, bytes) else str(result)

    async def remove(self, name: str) -> bool:
        try:
            return bool(await self._remove(keys=[self._adapters, self._version], args=[name]))
        except RedisError:
            raise _unavailable() from None

    async def aclose(self) -> None:
        await self._client.aclose()
