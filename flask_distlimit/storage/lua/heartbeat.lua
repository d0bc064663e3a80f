-- heartbeat: read by flask_distlimit/storage/heartbeat.py as HEARTBEAT_SOURCE, after
-- replace_key.lua (its `write`)
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl_ms = tonumber(ARGV[2])
local known = tonumber(ARGV[3])
local until_ms = now_ms + ttl_ms
-- a member that lives past a day from now is garbage (every process beats every few seconds; a
-- score of inf would count a ghost instance for ever, dividing every local share): removed
local past = string.format('(%d', now_ms + 86400000)

local repaired_live = write('ZADD', KEYS[1], until_ms, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms)
if redis.call('ZREMRANGEBYSCORE', KEYS[1], past, '+inf') > 0 then
  repaired_live = 1
end
redis.call('PEXPIRE', KEYS[1], ttl_ms)
local live = redis.call('ZCARD', KEYS[1])

local report = math.max(live, known)
local repaired_peak = write('ZADD', KEYS[2], until_ms, tostring(report))
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now_ms)
if redis.call('ZREMRANGEBYSCORE', KEYS[2], past, '+inf') > 0 then
  repaired_peak = 1
end
local largest = report
for _, member in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  local size = tonumber(member)
  if size == nil or size ~= math.floor(size) or size < 1 or size > 100000 then
    repaired_peak = 1
    largest = report
    redis.call('DEL', KEYS[2])
    redis.call('ZADD', KEYS[2], until_ms, tostring(report))
    break
  end
  largest = math.max(largest, size)
end
redis.call('PEXPIRE', KEYS[2], ttl_ms)
return {live, largest, repaired_live, repaired_peak}
