-- replace key: put before heartbeat.lua and lease_records.lua (HEARTBEAT_SOURCE,
-- LEASE_RECORDS_SOURCE). A write that meets a key of another type replaces the key (reported:
-- 1); any other error is raised as it is (the same write, made again, fails the same way).
local function write(command, key, a, b)
  local reply = redis.pcall(command, key, a, b)
  if type(reply) ~= 'table' or not reply.err then
    return 0
  end
  if string.sub(reply.err, 1, 9) == 'WRONGTYPE' then
    redis.call('DEL', key)
  end
  redis.call(command, key, a, b)
  return 1
end
