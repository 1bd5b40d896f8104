"""Lua scripts of the Redis block index (layout and reasons in docs/index.md).

Every script touches only keys that share one hash tag, so it runs on Redis Cluster too. Values:

* ``<tag>:epochs`` HASH ``replica -> "<epoch>"`` (live) or ``"~<epoch>"`` (retired, none live);
* ``<tag>:alive``  HASH ``replica -> "<deadline ms>"`` (server clock), set by heartbeats;
* ``<tag>:b:<block hash>`` HASH ``replica -> "<epoch>"`` (engine-confirmed) or
  ``"<epoch>:<expiry ms>"`` (speculative), with a key TTL that only ever grows.

Times come from the server's ``TIME`` so every gateway and agent agrees on expiry, whatever its
own clock says. Needs Redis >= 7.0 (``PEXPIRE ... GT``, effects replication of ``TIME``).
"""

from __future__ import annotations

# Shared Lua helpers: the server's time in ms, and a key TTL that never shrinks. A key without a
# TTL (just created) counts as infinite for PEXPIRE GT, so it gets a plain PEXPIRE instead.
_PRELUDE = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function extend_ttl(key, ttl_ms, fresh)
  if fresh then
    redis.call('PEXPIRE', key, ttl_ms)
  else
    redis.call('PEXPIRE', key, ttl_ms, 'GT')
  end
end
"""

#: KEYS: epochs, block...   ARGV: replica, epoch, speculative ttl ms ("" if confirmed), block ttl ms
#: Returns the number of blocks written (0 when ``epoch`` is not the replica's live one).
RECORD = (
    _PRELUDE
    + """
local replica, epoch = ARGV[1], ARGV[2]
local current = redis.call('HGET', KEYS[1], replica)
if not current then
  -- A replica seen for the first time adopts the epoch of its first write.
  redis.call('HSET', KEYS[1], replica, epoch)
  current = epoch
end
if current ~= epoch then
  return 0
end
local speculative = ARGV[3] ~= ''
local value, key_ttl = epoch, tonumber(ARGV[4])
if speculative then
  local ttl = tonumber(ARGV[3])
  value = epoch .. ':' .. string.format('%.0f', now_ms() + ttl)
  key_ttl = ttl
end
for i = 2, #KEYS do
  local key = KEYS[i]
  local fresh = redis.call('PTTL', key) < 0
  local held = redis.call('HGET', key, replica)
  -- A speculative write never downgrades an engine-confirmed entry of the same epoch.
  if not (speculative and held == epoch) then
    redis.call('HSET', key, replica, value)
  end
  extend_ttl(key, key_ttl, fresh)
end
return #KEYS - 1
"""
)

#: KEYS: block...   ARGV: replica, epoch.   Deletes the replica's entry where it has that epoch.
REMOVE = """
local replica, epoch = ARGV[1], ARGV[2]
local removed = 0
for i = 1, #KEYS do
  local held = redis.call('HGET', KEYS[i], replica)
  if held and (held == epoch or string.sub(held, 1, #epoch + 1) == epoch .. ':') then
    redis.call('HDEL', KEYS[i], replica)
    removed = removed + 1
  end
end
return removed
"""

#: KEYS: epochs   ARGV: replica, epoch.   Retires ``epoch`` only if it is the live one.
RETIRE = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  redis.call('HSET', KEYS[1], ARGV[1], '~' .. ARGV[2])
  return 1
end
return 0
"""

#: KEYS: alive   ARGV: replica, ttl ms.   Deadline on the server's clock.
HEARTBEAT = (
    _PRELUDE
    + """
redis.call('HSET', KEYS[1], ARGV[1], string.format('%.0f', now_ms() + tonumber(ARGV[2])))
return 1
"""
)

#: KEYS: epochs, alive, block...   ARGV: require heartbeat ("1"/"0"), touch ttl ms ("" = none)
#: Returns a flat array ``replica, depth, replica, depth, ...`` of replicas with depth >= 1.
#:
#: Walks the chain and stops at the first block that no replica with an unbroken match holds,
#: so it reads O(matched) keys. Epochs and heartbeats are read lazily, once per replica met.
MATCH = (
    _PRELUDE
    + """
local now = now_ms()
local require_heartbeat = ARGV[1] == '1'
local touch_ttl = tonumber(ARGV[2])
local live = {}
local function live_epoch(replica)
  local epoch = live[replica]
  if epoch == nil then
    epoch = redis.call('HGET', KEYS[1], replica)
    if epoch and string.sub(epoch, 1, 1) == '~' then
      epoch = false
    end
    if epoch then
      local deadline = redis.call('HGET', KEYS[2], replica)
      if deadline then
        if tonumber(deadline) <= now then epoch = false end
      elseif require_heartbeat then
        epoch = false
      end
    end
    live[replica] = epoch
  end
  return epoch
end
local depths = {}
local running = nil
for i = 3, #KEYS do
  local flat = redis.call('HGETALL', KEYS[i])
  local still = {}
  local any = false
  for j = 1, #flat, 2 do
    local replica = flat[j]
    if running == nil or running[replica] then
      local held = flat[j + 1]
      local epoch = held
      local sep = string.find(held, ':', 1, true)
      local fresh = true
      if sep then
        epoch = string.sub(held, 1, sep - 1)
        fresh = tonumber(string.sub(held, sep + 1)) > now
      end
      if fresh and live_epoch(replica) == epoch then
        still[replica] = true
        any = true
      end
    end
  end
  if not any then
    break
  end
  if touch_ttl then
    redis.call('PEXPIRE', KEYS[i], touch_ttl, 'GT')
  end
  for replica in pairs(still) do
    depths[replica] = i - 2
  end
  running = still
end
local out = {}
for replica, depth in pairs(depths) do
  out[#out + 1] = replica
  out[#out + 1] = depth
end
return out
"""
)
