"""What the shared routing view (router/routing/redis_view.py) keeps in Redis: the key layout, the
wire format of a router's published work, and the Lua scripts that read and write it.

Keys (prefix = the app's state.key_prefix):

    {prefix}:view:{replica}  hash: one field per router, "blocks,requests,prefill_tokens,
                             decode_blocks,stamp_ms": that router's unreflected work there
                             (router/routing/reservations.py's Unreflected), stamped with Redis's
                             clock; zero work deletes the field. The key expires with
                             entry_ttl_s; a field older than that is dropped by the next read
                             (its router died or lost Redis).
    {prefix}:hints           stream: (router, replica, block hashes) per learned chain,
                             capped at max_hint_entries (MAXLEN ~). A new router reads it
                             from the start: its first decisions already know what every
                             router learned (warm start), not only what the reports show.

Why one field per router, not one counter per replica: a router's own reservations stay
exact in its local ledger and are never counted twice (a read sums the OTHER routers'
fields, whatever of its own writes are still in flight), a dead router's work ages out
with its stamp, and every write is one HSET of the writer's own field: no lost updates.
The read and the write are Lua scripts (atomic; the read drops stale fields as it goes).
"""
from __future__ import annotations

import hashlib

from router.routing.reservations import ReplicaKey, Unreflected

_NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS view hashes; ARGV router_id, ttl_ms, one "b,r,p,d,newest" per key ("" for none) -> 1
PUBLISH_SCRIPT = _NOW_MS + """
for i, key in ipairs(KEYS) do
  local v = ARGV[i + 2]
  if v == '' then redis.call('HDEL', key, ARGV[1])
  else
    redis.call('HSET', key, ARGV[1], v .. ',' .. now)
    redis.call('PEXPIRE', key, ARGV[2])
  end
end
return 1
"""

# KEYS view hashes; ARGV router_id, max_age_ms -> per key, the other routers' fresh values
# ("b,r,p,d,newest,stamp"; Lua would truncate the float `newest`, so they go back as text);
# stale fields are deleted.
READ_SCRIPT = _NOW_MS + """
local out = {}
local max_age = tonumber(ARGV[2])
for i, key in ipairs(KEYS) do
  local fresh = {}
  local all = redis.call('HGETALL', key)
  for j = 1, #all, 2 do
    if all[j] ~= ARGV[1] then
      local stamp = tonumber(string.match(all[j + 1], ',(%d+)$'))
      if stamp == nil or now - stamp > max_age then redis.call('HDEL', key, all[j])
      else fresh[#fresh + 1] = all[j + 1] end
    end
  end
  out[i] = fresh
end
return out
"""


def replica_name(key: ReplicaKey) -> str:
    """A replica's name in Redis: Serve's ReplicaID by its unique id, anything else by str."""
    unique_id = getattr(key, "unique_id", None)
    return unique_id if isinstance(unique_id, str) else str(key)


def view_key(key_prefix: str, name: str) -> str:
    """The hash of the routers' work on the replica named `name`."""
    return f"{key_prefix}:view:{name}"


def hints_key(key_prefix: str) -> str:
    """The stream of learned prefix hints."""
    return f"{key_prefix}:hints"


def encode_work(work: Unreflected, newest: float) -> str:
    """A router's (nonzero) work on one replica as PUBLISH_SCRIPT takes it: "b,r,p,d,newest";
    the script appends Redis's stamp ("" instead deletes the router's field)."""
    return f"{work.blocks},{work.requests},{work.prefill_tokens},{work.decode_blocks},{newest!r}"


def parse_work(value: bytes | str) -> tuple[Unreflected, float]:
    """"b,r,p,d,newest,stamp" -> (Unreflected, newest dispatch time)."""
    b, r, p, d, newest, _ = as_text(value).split(",")
    return Unreflected(int(b), int(r), int(p), int(d)), float(newest)


def as_text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def script_sha(script: str) -> str:
    return hashlib.sha1(script.encode()).hexdigest()
