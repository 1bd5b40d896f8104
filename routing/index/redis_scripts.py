"""Lua scripts of the Redis block index (layout and reasons in docs/index.md).

Every script touches only keys that share one hash tag, so it runs on Redis Cluster too. Keys:

* ``<tag>:epochs`` HASH ``replica -> "<epoch>"`` (live) or ``"~<epoch>"`` (retired, none live);
* ``<tag>:alive``  HASH ``replica -> "<deadline ms>"`` (server clock), set by heartbeats;
* ``<tag>:slots``  HASH ``replica -> "<slot>"``: the bit of the replica's *live incarnation*;
* ``<tag>:owners`` HASH ``"<slot>" -> replica``: the same table read the other way (live only);
* ``<tag>:dead``   ZSET ``slot`` scored by the server time (ms) from which it may be reused;
* ``<tag>:meta``   HASH ``next`` (next never-used slot), ``maxttl`` (longest block-key TTL set);
* ``<tag>:b:<block hash as 16 hex digits>`` STRING
  ``<n: 2 bytes> <c: n bytes> <t> [ <slot>:<expiry ms>]...``:
  ``c`` is the bitset of the slots holding the block engine-confirmed, ``t`` the server time
  (s) the key's TTL was last extended to the full block TTL, then one entry per speculative
  holder, sorted. Bitsets use ``SETBIT`` order (slot ``k`` is bit ``7 - k % 8`` of byte
  ``k // 8``) without trailing zero bytes, so one holder set has exactly one encoding.

Why slots and strings: a lookup reads the chain's block keys with a few ``MGET`` calls and
ANDs each value's bitset (decoded once per distinct value: a shared prefix is usually held by
the same replicas all along, so its blocks share one value) into the bitset of the slots still
matching. That is O(matched blocks), not O(blocks x holders), and about one Redis call per
dozens of blocks instead of one or two per block.

Why slots can be reused safely: a slot dies when its incarnation is retired or replaced and is
reused only after ``maxttl`` (+1 s). Every script that extends a block key's TTL first clears the
dead slots' bits from it, so a key that still has a dead bit has not been extended since the
death and has expired by the time the slot is reused.

Why ``t``: extending a TTL is a write (and a replicated effect); doing it for every block of
every hit cost more than the lookup. A hit or a confirmed write that changes nothing extends a
key only if its ``t`` is more than 1/16 of the TTL old, so a block lives at least 15/16 of
``block_ttl_s`` after its last confirmed write or hit, and at most ``block_ttl_s``.

Block keys are built inside the scripts from ``ARGV`` (the key prefix and one string of the
hashes, each 16 lowercase hex digits) rather than passed as ``KEYS``: it spares the client packing
hundreds of arguments per call (redis-py's asyncio packer is pure Python), and fixed-width hex is
packed in C on the client (``struct`` + ``bytes.hex``) and cut with ``string.sub`` in the script,
about twice as fast on both sides as splitting decimals. The declared ``KEYS`` carry the same
hash tag, so Redis Cluster routes the call to the shard owning the block keys, and Redis >= 7
lets a script touch undeclared keys of the slot it was routed by.

Times come from the server's ``TIME`` so every gateway and agent agrees on expiry, whatever its
own clock says. Needs Redis >= 7.0 (``PEXPIRE ... GT``, effects replication of ``TIME``).
"""

from __future__ import annotations

#: Fraction of a block TTL after which a hit (or an idempotent confirmed write) extends it again.
REFRESH_DIVISOR = 16

# Shared Lua helpers: the server's time, bitsets, block values, block keys.
_PRELUDE = (
    """
local band, bor, bnot = bit.band, bit.bor, bit.bnot
local MASK = {}
for k = 0, 7 do MASK[k] = 2 ^ (7 - k) end
local REFRESH_DIVISOR = """
    + str(REFRESH_DIVISOR)
    + """

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- Bytes (a table) to a bitset string, trailing zero bytes dropped (one encoding per set).
local function pack(bytes, n)
  while n > 0 and bytes[n] == 0 do n = n - 1 end
  if n == 0 then return '' end
  return string.char(unpack(bytes, 1, n))
end
local function with_bit(str, slot, on)
  local bytes = {string.byte(str, 1, -1)}
  local at = math.floor(slot / 8) + 1
  for b = #bytes + 1, at do bytes[b] = 0 end
  if on then
    bytes[at] = bor(bytes[at], MASK[slot % 8])
  else
    bytes[at] = band(bytes[at], bnot(MASK[slot % 8]))
  end
  return pack(bytes, math.max(#bytes, at))
end
local function has_bit(str, slot)
  local byte = string.byte(str, math.floor(slot / 8) + 1)
  return byte ~= nil and band(byte, MASK[slot % 8]) ~= 0
end
-- A block value: confirmed bitset, last full extension (s), speculative slot -> expiry (ms).
local function decode(value)
  if not value or value == '' then return '', 0, {} end
  local n = string.byte(value, 1) * 256 + string.byte(value, 2)
  local c = string.sub(value, 3, 2 + n)
  local rest = string.sub(value, 3 + n)
  local spec = {}
  for slot, expiry in string.gmatch(rest, ' (%d+):(%d+)') do
    spec[tonumber(slot)] = tonumber(expiry)
  end
  return c, tonumber(string.match(rest, '^%d+')) or 0, spec
end
local function encode(c, t, spec)
  local parts = {}
  for slot, expiry in pairs(spec) do
    parts[#parts + 1] = string.format(' %d:%.0f', slot, expiry)
  end
  if c == '' and #parts == 0 then return '' end
  table.sort(parts)  -- one encoding per content, so equal blocks compare equal
  return string.char(math.floor(#c / 256), #c % 256) .. c .. string.format('%.0f', t)
    .. table.concat(parts)
end
-- The live-slot bytes: any other bit in a block belongs to a dead slot.
local function live_bytes(owner_slots)
  local live = {}
  for j = 1, #owner_slots do
    local slot = tonumber(owner_slots[j])
    local at = math.floor(slot / 8) + 1
    live[at] = bor(live[at] or 0, MASK[slot % 8])
  end
  return live
end
local function is_live(live, slot)
  return band(live[math.floor(slot / 8) + 1] or 0, MASK[slot % 8]) ~= 0
end
-- Drops dead slots' entries and expired guesses. Must run before any TTL extension of the
-- key: slot reuse relies on it (module docstring).
local function drop_dead(c, spec, live, now)
  local bytes = {string.byte(c, 1, -1)}
  for b = 1, #bytes do bytes[b] = band(bytes[b], live[b] or 0) end
  local kept = {}
  for slot, expiry in pairs(spec) do
    if expiry > now and is_live(live, slot) then kept[slot] = expiry end
  end
  return pack(bytes, #bytes), kept
end
-- Block hashes travel as one ARGV string of fixed-width, 16-digit lowercase hex (the client packs
-- them in C); key ``i`` is the prefix and the ``i``-th 16 characters.
local HEX = 16
local sub = string.sub
local function block_key(prefix, hexes, i)
  return prefix .. sub(hexes, HEX * i - HEX + 1, HEX * i)
end
-- The block keys named by ARGV (prefix, hashes), in order.
local function block_keys(prefix, hexes)
  local keys = {}
  for i = 1, math.floor(#hexes / HEX) do keys[i] = block_key(prefix, hexes, i) end
  return keys
end
-- MGET in slices: unpack() of thousands of values would overflow Lua's C stack.
local function mget(keys, first, last)
  local values = {}
  for from = first, last, 1000 do
    local got = redis.call('MGET', unpack(keys, from, math.min(last, from + 999)))
    for j = 1, #got do values[from - first + j] = got[j] end
  end
  return values
end
"""
)

# Slot bookkeeping for the scripts that change a replica's live incarnation.
# KEYS of those scripts start: epochs, slots, owners, dead, meta.
_SLOTS = """
local EPOCHS, SLOTS, OWNERS, DEAD, META = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
-- A free slot for the replica's new live incarnation: the lowest one whose quarantine is over.
local function allocate(replica, now)
  local slot = nil
  local reusable = redis.call('ZRANGEBYSCORE', DEAD, '-inf', now)
  for j = 1, #reusable do
    local candidate = tonumber(reusable[j])
    if slot == nil or candidate < slot then slot = candidate end
  end
  if slot ~= nil then
    redis.call('ZREM', DEAD, slot)
  else
    slot = redis.call('HINCRBY', META, 'next', 1) - 1
  end
  redis.call('HSET', SLOTS, replica, slot)
  redis.call('HSET', OWNERS, slot, replica)
  return slot
end
-- The replica's live incarnation dies: its bits stop matching now; the slot is quarantined for
-- as long as any block key holding it may live without being rewritten.
local function kill(replica, now)
  local slot = redis.call('HGET', SLOTS, replica)
  if slot then
    redis.call('HDEL', SLOTS, replica)
    redis.call('HDEL', OWNERS, slot)
    local maxttl = tonumber(redis.call('HGET', META, 'maxttl') or '0')
    redis.call('ZADD', DEAD, now + maxttl + 1000, slot)
  end
end
"""

#: KEYS: epochs, slots, owners, dead, meta   ARGV: replica, epoch.
SET_EPOCH = (
    _PRELUDE
    + _SLOTS
    + """
local replica, epoch = ARGV[1], ARGV[2]
local now = now_ms()
if redis.call('HGET', EPOCHS, replica) == epoch then
  if not redis.call('HGET', SLOTS, replica) then allocate(replica, now) end
  return 0
end
kill(replica, now)
redis.call('HSET', EPOCHS, replica, epoch)
allocate(replica, now)
return 1
"""
)

#: KEYS: epochs, slots, owners, dead, meta   ARGV: replica, epoch.
#: Retires ``epoch`` only if it is the live one.
RETIRE = (
    _PRELUDE
    + _SLOTS
    + """
local replica, epoch = ARGV[1], ARGV[2]
if redis.call('HGET', EPOCHS, replica) == epoch then
  redis.call('HSET', EPOCHS, replica, '~' .. epoch)
  kill(replica, now_ms())
  return 1
end
return 0
"""
)

#: KEYS: epochs, slots, owners, dead, meta
#: ARGV: replica, epoch, speculative ttl ms ("" if confirmed), block ttl ms, block key prefix,
#:       block hashes (16-digit hex each, concatenated)
#: Returns the number of blocks written (0 when ``epoch`` is not the replica's live one).
RECORD = (
    _PRELUDE
    + _SLOTS
    + """
local replica, epoch = ARGV[1], ARGV[2]
local now = now_ms()
local current = redis.call('HGET', EPOCHS, replica)
if not current then
  -- A replica seen for the first time adopts the epoch of its first write.
  redis.call('HSET', EPOCHS, replica, epoch)
  current = epoch
end
if current ~= epoch then
  return 0
end
local slot = tonumber(redis.call('HGET', SLOTS, replica) or allocate(replica, now))
local speculative = ARGV[3] ~= ''
local ttl = tonumber(speculative and ARGV[3] or ARGV[4])
if ttl > tonumber(redis.call('HGET', META, 'maxttl') or '0') then
  redis.call('HSET', META, 'maxttl', ttl)
end
local now_s = math.floor(now / 1000)
local refresh_s = ttl / 1000 / REFRESH_DIVISOR
local live = live_bytes(redis.call('HKEYS', OWNERS))
local keys = block_keys(ARGV[5], ARGV[6])
local values = mget(keys, 1, #keys)
-- Most blocks of one call hold the same value: work out each transition once.
-- memo[value] = new value, or false when the block needs neither a write nor an extension.
local memo = {}
for i = 1, #keys do
  local key, old = keys[i], values[i]
  local new = memo[old or '']  -- a value is never '': that slot is for missing keys
  if new == nil then
    local c, t, spec = decode(old)
    local old_c = c
    c, spec = drop_dead(c, spec, live, now)
    if speculative then
      -- A speculative write never downgrades an engine-confirmed entry of the same epoch.
      if not has_bit(c, slot) then spec[slot] = now + ttl end
    else
      c = with_bit(c, slot, true)
      spec[slot] = nil
      if old and c == old_c and now_s - t < refresh_s and encode(c, t, spec) == old then
        new = false  -- already held, extended lately: nothing to do
      else
        t = now_s
      end
    end
    if new == nil then new = encode(c, t, spec) end
    memo[old or ''] = new
  end
  if not old then
    redis.call('SET', key, new, 'PX', ttl)
  elseif new then
    if new ~= old then redis.call('SET', key, new, 'KEEPTTL') end
    redis.call('PEXPIRE', key, ttl, 'GT')
  end
end
return #keys
"""
)

#: KEYS: epochs, slots   ARGV: replica, epoch, block key prefix, block hashes (16-digit hex each)
#: Deletes the replica's entries if ``epoch`` is its live one (other epochs' entries are dead).
REMOVE = (
    _PRELUDE
    + """
local replica, epoch = ARGV[1], ARGV[2]
if redis.call('HGET', KEYS[1], replica) ~= epoch then
  return 0
end
local slot = redis.call('HGET', KEYS[2], replica)
if not slot then
  return 0
end
slot = tonumber(slot)
local keys = block_keys(ARGV[3], ARGV[4])
local values = mget(keys, 1, #keys)
local removed = 0
for i = 1, #keys do
  local value = values[i]
  if value then
    local c, t, spec = decode(value)
    if has_bit(c, slot) or spec[slot] then
      spec[slot] = nil
      local new = encode(with_bit(c, slot, false), t, spec)
      if new == '' then
        redis.call('DEL', keys[i])
      else
        redis.call('SET', keys[i], new, 'KEEPTTL')
      end
      removed = removed + 1
    end
  end
end
return removed
"""
)

#: KEYS: alive   ARGV: replica, ttl ms.   Deadline on the server's clock.
HEARTBEAT = (
    _PRELUDE
    + """
redis.call('HSET', KEYS[1], ARGV[1], string.format('%.0f', now_ms() + tonumber(ARGV[2])))
-- KEYS[2], the epoch table, when given: 0 tells an agent that Redis forgot its epoch (flushed).
if KEYS[2] then return redis.call('HEXISTS', KEYS[2], ARGV[1]) end
return 1
"""
)

#: KEYS: owners, alive, meta
#: ARGV: require heartbeat ("1"/"0"), touch ttl ms ("" = none), block key prefix,
#:       chain (block hashes, 16-digit hex each, concatenated)
#: Returns a flat array ``replica, depth, replica, depth, ...`` of replicas with depth >= 1.
#:
#: Walks the chain with the bitset of the slots still matching, and stops at the first block
#: that none of them holds. Block values are read by MGET in slices of 32, so it reads
#: O(matched) keys in a handful of calls; each distinct value is decoded once.
MATCH = (
    _PRELUDE
    + """
local now = now_ms()
local require_heartbeat = ARGV[1] == '1'
local touch_ttl = tonumber(ARGV[2])
local owners = redis.call('HGETALL', KEYS[1])
local alive = redis.call('HGETALL', KEYS[2])
local deadlines = {}
for j = 1, #alive, 2 do
  deadlines[alive[j]] = tonumber(alive[j + 1])
end
-- The slots that may match now (live incarnation, heartbeat kept), as bytes; their replicas.
local name, live, run = {}, {}, {}
local width = 0
for j = 1, #owners, 2 do
  local slot, replica = tonumber(owners[j]), owners[j + 1]
  local at = math.floor(slot / 8) + 1
  live[at] = bor(live[at] or 0, MASK[slot % 8])
  local deadline = deadlines[replica]
  if (deadline and deadline > now) or (not deadline and not require_heartbeat) then
    name[slot] = replica
    run[at] = bor(run[at] or 0, MASK[slot % 8])
    if at > width then width = at end
  end
end
if width == 0 then
  return {}
end
for b = 1, width do run[b] = run[b] or 0 end
local now_s = math.floor(now / 1000)
local refresh_s = 0
if touch_ttl then
  refresh_s = touch_ttl / 1000 / REFRESH_DIVISOR
  if touch_ttl > tonumber(redis.call('HGET', KEYS[3], 'maxttl') or '0') then
    redis.call('HSET', KEYS[3], 'maxttl', touch_ttl)  -- slot quarantine must cover this TTL
  end
end
local out = {}
local function emit(bits, at, depth)
  for k = 0, 7 do
    if band(bits, MASK[k]) ~= 0 then
      out[#out + 1] = name[(at - 1) * 8 + k]
      out[#out + 1] = depth
    end
  end
end
-- memo[value] = {holder bytes (confirmed or unexpired guess), refreshed value or false}
local memo = {}
local function holders(value)
  local m = memo[value]
  if m == nil then
    local c, t, spec = decode(value)
    local bytes = {}
    for b = 1, width do bytes[b] = string.byte(c, b) or 0 end
    for slot, expiry in pairs(spec) do
      local at = math.floor(slot / 8) + 1
      if expiry > now and at <= width then bytes[at] = bor(bytes[at], MASK[slot % 8]) end
    end
    local refreshed = false
    if touch_ttl and now_s - t >= refresh_s then
      local kept_c, kept_spec = drop_dead(c, spec, live, now)
      -- Only a block some replica confirmed holding lives on by being matched: one held by
      -- guesses alone lives as long as the longest of them, hit or not.
      if string.find(kept_c, '[^%z]') then
        refreshed = encode(kept_c, now_s, kept_spec)
      end
    end
    m = {bytes, refreshed}
    memo[value] = m
  end
  return m
end
-- Keys are built and read SLICE at a time, so the walk builds and reads at most SLICE - 1 keys
-- past the block where it stops: building and reading a key is most of the per-block work, and
-- one MGET call costs about as much as reading two keys (measured: 32 beats 16 and 128 on a
-- 375-block chain matched 250 deep).
local SLICE = 32
local prefix, hexes = ARGV[3], ARGV[4]
local total = math.floor(#hexes / HEX)
local matched = 0
local previous, previous_m = nil, nil
local from = 1
local stop = false
while from <= total and not stop do
  local to = math.min(total, from + SLICE - 1)
  local keys = {}
  for i = from, to do keys[i - from + 1] = block_key(prefix, hexes, i) end
  local values = redis.call('MGET', unpack(keys))
  for j = 1, #keys do
    local value = values[j]
    if not value then
      stop = true
      break
    end
    local m = previous_m
    if value ~= previous then
      m = holders(value)
      -- An equal value cannot change the running set (it is already a subset of it).
      local bytes, still, any = m[1], {}, false
      for b = 1, width do
        local bits = band(run[b], bytes[b])
        still[b] = bits
        if bits ~= 0 then any = true end
      end
      if not any then
        stop = true
        break
      end
      if matched > 0 then
        for b = 1, width do
          local ended = band(run[b], bnot(still[b]))
          if ended ~= 0 then emit(ended, b, matched) end
        end
      end
      run = still
      previous, previous_m = value, m
    end
    if m[2] then
      -- A hit keeps the block alive: dead bits are dropped first (slot reuse relies on it).
      if m[2] ~= value then redis.call('SET', keys[j], m[2], 'KEEPTTL') end
      redis.call('PEXPIRE', keys[j], touch_ttl, 'GT')
    end
    matched = matched + 1
  end
  from = to + 1
end
if matched > 0 then
  for b = 1, width do
    if run[b] ~= 0 then emit(run[b], b, matched) end
  end
end
return out
"""
)
