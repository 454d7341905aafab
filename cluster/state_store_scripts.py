"""The Lua scripts of the Redis limit store (cluster/state_store.py): each runs atomically in
Redis and reads Redis's own clock (TIME), so that ingress replicas with skewed clocks agree."""
from __future__ import annotations

_NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS[1] slots; ARGV limit, member, ttl_ms, members this replica released whose ZREM may
# still be on its way... -> {1 taken | 0 full, slots in flight}
ACQUIRE = _NOW_MS + """
for i = 4, #ARGV do redis.call('ZREM', KEYS[1], ARGV[i]) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local n = redis.call('ZCARD', KEYS[1])
if n >= tonumber(ARGV[1]) then return {0, n} end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {1, n + 1}
"""

# KEYS[1] slots; ARGV ttl_ms, mode ('XX': renew existing only | 'ADD': write back), members...
RENEW = _NOW_MS + """
local expiry = now + tonumber(ARGV[1])
for i = 3, #ARGV do
  if ARGV[2] == 'XX' then redis.call('ZADD', KEYS[1], 'XX', expiry, ARGV[i])
  else redis.call('ZADD', KEYS[1], expiry, ARGV[i]) end
end
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return 1
"""

# The token bucket: capacity ARGV[2] tokens, refilled at capacity per 60 000 ms.
_REFILL = _NOW_MS + """
local capacity = tonumber(ARGV[2])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'stamp')
local tokens = tonumber(state[1]) or capacity
local stamp = tonumber(state[2]) or now
if now > stamp then
  tokens = math.min(capacity, tokens + (now - stamp) * capacity / 60000)
  stamp = now
end
"""
_SAVE = """
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'stamp', stamp)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
"""

# KEYS[1] tokens; ARGV amount, capacity, ttl_ms -> 0 taken | ms until it fits | -1 never
TAKE = _REFILL + """
local amount = tonumber(ARGV[1])
local wait = 0
if amount <= tokens then tokens = tokens - amount
elseif amount > capacity then wait = -1
else wait = math.max(1, math.ceil((amount - tokens) * 60000 / capacity)) end
""" + _SAVE + """
return wait
"""

# KEYS[1] tokens; ARGV amount, capacity, ttl_ms
GIVE_BACK = _REFILL + """
tokens = math.min(capacity, tokens + tonumber(ARGV[1]))
""" + _SAVE + """
return 1
"""
