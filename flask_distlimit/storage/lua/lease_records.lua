-- lease records: read by flask_distlimit/storage/lease_records.py as LEASE_RECORDS_SOURCE,
-- after replace_key.lua (its `write`)
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- each member of `live` and its value in `values` appended to `into` (one without: skipped)
local function with_values(into, live, values)
  for i, member in ipairs(live) do
    if values[i] then
      into[#into + 1] = member
      into[#into + 1] = values[i]
    end
  end
  return into
end

if ARGV[1] == '' then  -- read: the 1,000 whose time is up soonest, of those not expired
  -- by rank past the expired (the lowest scores): ZRANGE ... BYSCORE needs Redis 6.2 and
  -- ZRANGEBYSCORE a grant of its own
  local reply = {now_ms}
  local expired = redis.pcall('ZCOUNT', KEYS[1], '-inf', now_ms)
  if type(expired) ~= 'number' then
    return reply
  end
  local live = redis.pcall('ZRANGE', KEYS[1], expired, expired + 999)
  if type(live) ~= 'table' or live.err or #live == 0 then
    return reply
  end
  local values = redis.pcall('HMGET', KEYS[2], unpack(live))
  if type(values) ~= 'table' or values.err then
    return reply
  end
  return with_values(reply, live, values)
end

local hold_ms = tonumber(ARGV[3])
local repaired_set = write('ZADD', KEYS[1], now_ms + hold_ms, ARGV[1])
local repaired_records = write('HSET', KEYS[2], ARGV[1], now_ms .. ':' .. ARGV[2])
-- a time up past two years from now is garbage (no lease outlives its limit's period, at most
-- 366 days; inf made every publication an error, 1e15 kept the keys 31,000 years): removed
local past = string.format('(%d', now_ms + 2 * 366 * 86400000)
if redis.call('ZREMRANGEBYSCORE', KEYS[1], past, '+inf') > 0 then
  repaired_set = 1
end
if redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms) > 0 then
  -- processes whose time is up were dropped: the records rebuilt with the live ones' (the
  -- first 1,000 by expiry; one past them publishes again on its next renewal)
  local live = redis.call('ZRANGE', KEYS[1], 0, 999)
  local values = redis.call('HMGET', KEYS[2], unpack(live))
  redis.call('DEL', KEYS[2])
  local kept = with_values({}, live, values)
  if #kept > 0 then
    redis.call('HSET', KEYS[2], unpack(kept))
  end
end
-- both keys live until the last record's time is up
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
local ttl_ms = math.max(1, math.floor(tonumber(last[2]) - now_ms))
redis.call('PEXPIRE', KEYS[1], ttl_ms)
redis.call('PEXPIRE', KEYS[2], ttl_ms)
return {repaired_set, repaired_records}
