"""Lua scripts of the mirrored index's shared truth (layout in ``stream_layout``).

``WRITE`` applies one engine-confirmed change of one replica (set_epoch, retire, record, remove,
heartbeat) to its keys *and* appends the event to its shard's stream, atomically: a gateway that
reads a replica's snapshot and then tails the stream from the snapshot's sequence number sees
every change exactly once, in order. Each event carries the replica's sequence number ``q`` (one
more per event) and the incarnation ``i`` of its state hash (new after Redis lost the hash), so
a gateway notices a trimmed stream or a flushed Redis and reloads that replica.

``SNAPSHOT`` reads one replica's state and blocks in one atomic call.

Block hashes travel as one binary argument, 8 bytes big-endian per block (packed in C by
``struct``), cut with ``string.sub`` here: no per-block argument packing in redis-py.
"""

from __future__ import annotations

#: Members per ``SADD``/``SREM`` call: Lua's ``unpack`` is bounded by its C stack (~8,000).
_CHUNK = 1000
#: A replica's state and blocks expire this long after its last heartbeat (ms): one that
#: crashed or lost its node without retiring its epoch leaves nothing behind for long.
SILENT_EXPIRY_MS = 3_600_000

WRITE = (
    """
local R, B, S, REPLICAS = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local op, replica, epoch, maxlen = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local payload, ttl = ARGV[5], ARGV[6]
local CHUNK = """
    + str(_CHUNK)
    + """
local SILENT_MS = """
    + str(SILENT_EXPIRY_MS)
    + """
local current = redis.call('HGET', R, 'e')
local incarnation = redis.call('HGET', R, 'i')
local known = current and 1 or 0

local function ensure()
  if not incarnation then
    local t = redis.call('TIME')
    incarnation = t[1] .. string.format('%06d', tonumber(t[2]))
    redis.call('HSET', R, 'i', incarnation)
    redis.call('SADD', REPLICAS, replica)
  end
end
local function emit(code, ...)
  local seq = redis.call('HINCRBY', R, 'q', 1)
  redis.call('XADD', S, 'MAXLEN', '~', maxlen, '*',
    'o', code, 'p', replica, 'q', seq, 'i', incarnation, 'e', epoch, ...)
end
local function each_chunk(command)
  local n = #payload / 8
  local members = {}
  for k = 1, n do
    members[#members + 1] = string.sub(payload, 8 * k - 7, 8 * k)
    if #members == CHUNK or k == n then
      redis.call(command, B, unpack(members))
      members = {}
    end
  end
end
local function declare()
  redis.call('HSET', R, 'e', epoch)
  redis.call('DEL', B)
  current = epoch
  emit('e')
end

if op == 'e' then
  ensure()
  if current ~= epoch then declare() end
elseif op == 't' then
  if current == epoch then
    redis.call('HSET', R, 'e', '~' .. epoch)
    redis.call('DEL', B)
    emit('t')
  end
elseif op == 'r' then
  ensure()
  if not current then declare() end  -- a replica seen for the first time adopts the epoch
  if current == epoch then
    each_chunk('SADD')
    emit('r', 'b', payload)
  end
elseif op == 'x' then
  if current == epoch then
    each_chunk('SREM')
    emit('x', 'b', payload)
  end
elseif op == 'h' then
  ensure()
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('HSET', R, 'a', string.format('%.0f', now + tonumber(ttl)))
  emit('h', 't', ttl)
  -- A replica that stops heartbeating without leaving (a crash, a lost node) takes its keys
  -- with it once silent for SILENT_MS: heartbeats push the expiry on while it lives.
  redis.call('PEXPIRE', R, SILENT_MS)
  redis.call('PEXPIRE', B, SILENT_MS)
end
return known
"""
)

#: One replica's state: ``[epoch or '', seq, incarnation or '', heartbeat ms left (-1: none),
#: block, block, ...]``, read atomically.
SNAPSHOT = """
local state = redis.call('HMGET', KEYS[1], 'e', 'q', 'i', 'a')
local left = -1
if state[4] then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  left = tonumber(state[4]) - now
  if left < 0 then left = 0 end
end
local out = {state[1] or '', state[2] or '0', state[3] or '', string.format('%.0f', left)}
for _, member in ipairs(redis.call('SMEMBERS', KEYS[2])) do out[#out + 1] = member end
return out
"""
