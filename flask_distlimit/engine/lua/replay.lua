-- REPLAY: one retry after a lost reply (flask_distlimit/storage/redis.py, "One retry").
--
-- A call may carry a REQUEST TOKEN: one key more than its checks (the last of KEYS, in the
-- first check's Cluster slot) and a second argument, ARGV[2] = "<ttl_ms>" on the first try or
-- "<ttl_ms>,1" on the retry. The reply of a call with a token is kept under the token's key for
-- ttl_ms; the retry of a call whose reply was lost in transit answers that kept reply instead of
-- running again, so a script that ran is never counted twice, and one that did not run runs now.
-- A call without a token (one argument) is exactly the script below, unchanged.
--
-- Everything between the two markers (the fast paths, the helpers, the algorithms and the
-- driver) is the body of run(KEYS, ARGV): its KEYS and ARGV are the checks' own, token removed.
local function run(KEYS, ARGV)
--@@ BODY @@--
end

if #ARGV ~= 2 then
  return run(KEYS, ARGV)
end
local n = #KEYS
local ttl_s, again = string.match(ARGV[2], '^([1-9]%d?%d?%d?%d?%d?%d?)(,?1?)$')
if not ttl_s or n < 2 or (again ~= '' and again ~= ',1') then
  return redis.error_reply('ERR distlimit: bad request token argument')
end
local token = KEYS[n]
if again == ',1' then
  local kept = redis.pcall('GET', token)
  if type(kept) == 'string' then
    return kept  -- the first try ran: its reply, not a second count
  elseif type(kept) == 'table' and kept.err then
    redis.call('DEL', token)  -- not ours (garbage of another type): the first try did not run
  end
end
local keys = {}
for i = 1, n - 1 do
  keys[i] = KEYS[i]
end
local reply = run(keys, {ARGV[1]})
if type(reply) == 'string' then  -- an error reply is not kept: nothing was written
  redis.call('SET', token, reply, 'PX', tonumber(ttl_s))
end
return reply
