-- shared value: read by flask_distlimit/storage/shared_value.py as SHARED_VALUE_SOURCE
local ok, value = pcall(redis.call, 'GET', KEYS[1])
if not ok then
  redis.call('UNLINK', KEYS[1])
  value = false
end
if not value then
  redis.call('SET', KEYS[1], ARGV[1])
  value = ARGV[1]
end
local ttl = tonumber(ARGV[2])  -- seconds; 0: never expires
if ttl > 0 then
  redis.call('PEXPIRE', KEYS[1], ttl * 1000)
else
  redis.call('PERSIST', KEYS[1])
end
return value
