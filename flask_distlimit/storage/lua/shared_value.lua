-- shared value: read by flask_distlimit/storage/side_calls.py as SHARED_VALUE_SOURCE.
-- Atomically, in one round trip: stores ARGV[1] at KEYS[1] when the key is absent, sets its
-- lifetime (ARGV[2] seconds; 0: none, so no volatile-* policy evicts it) and answers the value
-- stored. A read needs no memory, so a full Redis still answers it; a key of another type, or
-- a value not of the candidate's form, is replaced; only commands of ACL_GRANTS
-- (flask_distlimit/storage/translate.py).
local ok, value = pcall(redis.call, 'GET', KEYS[1])
-- a value not of the candidate's form (as long, letters and digits) is garbage too: a process
-- would fail on it (bytes that are no text) or count identities its own way (a huge one: a
-- timeout)
if not ok or value and (#value ~= #ARGV[1] or string.find(value, '[^%w]')) then
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
