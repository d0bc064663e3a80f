-- The driver: evaluates every check of one request, all-or-nothing.
--
-- KEYS[i]  the key of check i (one key per check; every key a script touches is declared).
-- ARGV[1]  ONE string of comma-separated decimal integers (one argument, not 2 + 4n: the client
--          packs each argument in Python, so fewer is cheaper):
--   1      the time in us since the epoch, or -1 to read the server's clock (TIME). Only tests
--          inject a time.
--   2      0 = evaluate, 1 = refund (give back the costs consumed earlier by the same checks).
--   3 + 4(i-1) ..  per check: algorithm (1 fixed_window, 2 sliding_window_log,
--          3 sliding_window_counter, 4 token_bucket, 5 gcra, 6 concurrency), plus 16 for a
--          SHADOW check, plus 32 for a RELEASE (refund this one check, then peek at it), or
--          plus 64 for a DEBT (charge its cost past the limit if need be: its algorithm's refund
--          of minus the cost, then peek at it); plus 128 for a META check (below);
--          limit (units), period (us), cost (units; for concurrency: the slot's token).
--   A release check gives back what the same check took earlier (a concurrency slot when its
--   request ends) and never denies; it rides the ordinary evaluate call, so every storage
--   sends it like any other check. A release or a debt is always allowed.
--   Anything else (a wrong count, an empty field, a bad number) is refused before any write.
--
-- Evaluate: phase 1 reads and decides every check (pruning expired log entries and deleting
-- keys that hold garbage, but consuming nothing); phase 2, only when every check allows and
-- only for costs > 0, writes them all. A denied request consumes nothing anywhere.
-- A shadow check (code + 16) is decided like any other but never denies the request: when it
-- would deny, the others still decide alone, and it is not written (exactly as an enforced limit
-- that refuses is not charged), so its count is what it would be if it were enforced alone.
-- Refund: each check gives its cost back, then reports its state as a peek (cost 0).
-- A META check (code + 128) counts the request's breaches of the other checks: decided like any
-- check (its cost is 1, one breach), it denies the request when it is exhausted; it is written
-- only when the request is denied by another, non-shadow check (one breach, however many
-- denied), never when admitted; it reports itself as it stands. In a refund (a Cluster group
-- that admitted a request another group refused) it counts that breach, unless its cost is 0
-- (the request was not refused by a limit) or it is exhausted meanwhile; it never denies then.
--
-- Each algorithm file defines a loader LOAD_<NAME>() that builds its functions (only for the
-- algorithms a request uses). decide(key, limit, period, cost, now) returns {allowed (0/1),
-- remaining and reset_after if consumed, retry_after, repaired (0/1), remaining and reset_after
-- as it stands, then what commit(key, r, limit, period, cost, now) writes}; refund(key, limit,
-- period, cost, now) writes and returns repaired (0/1).
--
-- Reply: ONE bulk string of comma-separated decimal integers (formatted with %d, so exact below
--   2^53; the client parses one string instead of 1 + 6n RESP integers): now_us, then per check:
--   allowed (0/1; 2 = a shadow check that would deny), limit, remaining, reset_after_us,
--   retry_after_us (0 when allowed, -1 = never: cost > limit), repaired (0/1). E.g. "1700000000000000,1,100,99,60000000,0,0".

-- LOADERS[code]: each algorithm's loader (LOAD_<NAME>, in its file), by its code; the line is
-- written by engine/lua_source.py from the registry's codes.
--@@ LOADERS @@--
local loaded = {}
-- The reply's small fields as the strings %d writes.
local SMALL = {[0] = '0', '1', '2'}

local n = #KEYS

-- One check that lua/fast_path.lua did not take (concurrency, a release, a debt, a faster rate),
-- on a fast path of the driver's own: the same parse, checks, calls and reply as the
-- general path below, without cjson or per-request tables, and most of the reply as strings
-- (measured: docs/bench/engine.md, "The script's own time"). Only an argument of exactly six
-- plain decimal integers takes it (tonumber then reads each exactly as cjson would: both use
-- strtod); anything else, well-formed or not, goes to the general path, which decides or refuses.
if n == 1 and #ARGV == 1 then
  local now_s, mode_s, code_s, limit_s, period_s, cost_s = string.match(ARGV[1],
    '^(%-?%d+),(%d+),(%d%d?),([1-9]%d*),(%d+),(%d+)$')  -- code: 2 digits (no meta check)
  if now_s then
    local now, mode, code = tonumber(now_s), tonumber(mode_s), tonumber(code_s)
    local limit, period, cost = tonumber(limit_s), tonumber(period_s), tonumber(cost_s)
    -- plain digits read as whole numbers: whole(x) is x < MAX_EXACT here (no floor to call)
    if not (now == -1 or now >= 0 and now < MAX_EXACT) or not (mode == 0 or mode == 1) then
      return redis.error_reply('ERR distlimit: bad time or mode argument')
    end
    local shadow, release, debt, flagged = false, mode == 1, false, false
    if code > 64 then
      code = code - 64
      debt, flagged = true, true
    end
    if code > 32 then
      code = code - 32
      release, flagged = true, true
    end
    if code > 16 then
      code = code - 16
      shadow = true
    end
    local load = LOADERS[code]
    if load == nil or not (limit < MAX_EXACT and period >= 1 and period < MAX_EXACT
        and cost < MAX_EXACT) then
      return redis.error_reply('ERR distlimit: bad arguments for check 1')
    end
    if now == -1 then
      local time = redis.call('TIME')
      now = tonumber(time[1]) * 1000000 + tonumber(time[2])
    end
    if code == 5 and now / (period / limit) >= GCRA_MAX_UNITS then
      return redis.error_reply('ERR distlimit: check 1: a GCRA rate above ' ..
        '2,000,000 per second cannot be computed exactly; use token_bucket')
    end
    local algo, key, repaired = load(), KEYS[1], 0
    if release then
      repaired = algo.refund(key, limit, period, cost, now)
      cost = 0
    elseif debt then
      repaired = algo.refund(key, limit, period, -cost, now)
      cost = 0
    end
    local r = algo.decide(key, limit, period, cost, now)
    if repaired == 1 then
      r[5] = 1
    end
    if flagged then  -- a release or a debt never denies
      r[1], r[4] = 1, 0
    end
    local allowed, left, reset = r[1], r[2], r[3]
    if allowed == 1 then
      if cost > 0 then
        algo.commit(key, r, limit, period, cost, now)
      end
    else  -- denied, or a shadow check that would deny: as it stands, nothing written
      if shadow then
        allowed = 2
      end
      left, reset = r[6], r[7]
    end
    -- allowed and repaired as strings, the limit as it came, retry_after 0 in the format: each
    -- number formatted costs (%d of a whole number below 2^53 writes these very digits)
    if r[4] == 0 then
      return string.format('%d,%s,%s,%d,%d,0,%s', now, SMALL[allowed], limit_s, left, reset,
        SMALL[r[5]])
    end
    return string.format('%d,%s,%s,%d,%d,%d,%s', now, SMALL[allowed], limit_s, left, reset, r[4],
      SMALL[r[5]])
  end
end

if #ARGV ~= 1 then
  return redis.error_reply('ERR distlimit: expected 1 argument, got ' .. #ARGV)
end
-- The fields are a JSON array without its brackets: cjson (C code) parses them faster than a Lua
-- loop would, and refuses empty fields, stray commas and anything but JSON values (for two checks
-- or more, also faster than string.match with a tonumber per field: measured).
if args == nil then  -- not read yet (lua/fast_path.lua reads a plain one of several checks)
  parsed, args = pcall(cjson.decode, '[' .. ARGV[1] .. ']')
end
local count = parsed and type(args) == 'table' and #args or -1
if count ~= 2 + 4 * n then
  return redis.error_reply('ERR distlimit: expected 2 + 4 * #KEYS comma-separated integers')
end
for i = 1, count do
  if type(args[i]) ~= 'number' then
    return redis.error_reply('ERR distlimit: expected 2 + 4 * #KEYS comma-separated integers')
  end
end
local now, mode = args[1], args[2]
if not (now == -1 or whole(now)) or not (mode == 0 or mode == 1) then
  return redis.error_reply('ERR distlimit: bad time or mode argument')
end
if now == -1 then
  local time = redis.call('TIME')
  now = tonumber(time[1]) * 1000000 + tonumber(time[2])
end

-- Check i: algorithm args[4i - 1], limit args[4i], period args[4i + 1], cost args[4i + 2].
local algos, shadow, release, debt, meta = {}, {}, {}, {}, {}
for i = 1, n do
  local code, limit, period, cost = args[4 * i - 1], args[4 * i], args[4 * i + 1], args[4 * i + 2]
  if type(code) == 'number' and code > 128 then
    code = code - 128
    meta[i] = true
  end
  if type(code) == 'number' and code > 64 then
    code = code - 64
    debt[i] = true
  end
  if type(code) == 'number' and code > 32 then
    code = code - 32
    release[i] = true
  end
  if type(code) == 'number' and code > 16 then
    code = code - 16
    shadow[i] = true
  end
  if LOADERS[code] == nil or not (whole(limit) and limit >= 1 and whole(period) and period >= 1
      and whole(cost)) then
    return redis.error_reply('ERR distlimit: bad arguments for check ' .. i)
  end
  local algo = loaded[code]
  if algo == nil then
    algo = LOADERS[code]()
    loaded[code] = algo
  end
  if code == 5 and now / (period / limit) >= GCRA_MAX_UNITS then
    return redis.error_reply('ERR distlimit: check ' .. i .. ': a GCRA rate above ' ..
      '2,000,000 per second cannot be computed exactly; use token_bucket')
  end
  algos[i] = algo
end

local results, all, metadenied = {}, true, false
for i = 1, n do
  local repaired = 0
  if meta[i] and mode == 1 then
    -- a refund of a group that admitted a request refused in another: a breach (written below)
  elseif mode == 1 or release[i] then
    repaired = algos[i].refund(KEYS[i], args[4 * i], args[4 * i + 1], args[4 * i + 2], now)
    args[4 * i + 2] = 0
  elseif debt[i] then
    repaired = algos[i].refund(KEYS[i], args[4 * i], args[4 * i + 1], -args[4 * i + 2], now)
    args[4 * i + 2] = 0
  end
  local r = algos[i].decide(KEYS[i], args[4 * i], args[4 * i + 1], args[4 * i + 2], now)
  if repaired == 1 then
    r[5] = 1
  end
  if release[i] or debt[i] then  -- never denies
    r[1], r[4] = 1, 0
  elseif meta[i] and mode == 1 then  -- never denies a refund; exhausted meanwhile: no write
    if r[1] == 0 then
      args[4 * i + 2] = 0
    end
    r[1], r[4] = 1, 0
  end
  results[i] = r
  if r[1] == 0 then
    if meta[i] then
      metadenied = true
    end
    if shadow[i] then
      r[1] = 2  -- would deny: reported, never refuses, not written
    else
      all = false
    end
  end
end

if all then
  for i = 1, n do
    local cost = args[4 * i + 2]
    if cost > 0 and results[i][1] == 1 and (mode == 1 or not meta[i]) then
      algos[i].commit(KEYS[i], results[i], args[4 * i], args[4 * i + 1], cost, now)
    end
  end
elseif not metadenied and next(meta) then  -- a breach: counted by every meta check
  for i = 1, n do
    if meta[i] and args[4 * i + 2] > 0 then
      algos[i].commit(KEYS[i], results[i], args[4 * i], args[4 * i + 1], args[4 * i + 2], now)
    end
  end
end

-- A denied request reports every limit as it stands, without the consumption that did not happen.
local left, reset = 2, 3
if not all then
  left, reset = 6, 7
end
-- A shadow check that would deny was not written either: it reports itself as it stands.
if n == 1 then  -- the usual request: no reply table (measured: ~1 us less in a request)
  local r = results[1]
  if r[1] == 2 or meta[1] then
    left, reset = 6, 7
  end
  return string.format('%d,%d,%d,%d,%d,%d,%d', now, r[1], args[4], r[left], r[reset], r[4], r[5])
end
local reply = {now}
for i = 1, n do
  local r, j = results[i], 6 * i - 4
  local l, t = left, reset
  if r[1] == 2 or meta[i] then
    l, t = 6, 7
  end
  reply[j], reply[j + 1], reply[j + 2] = r[1], args[4 * i], r[l]
  reply[j + 3], reply[j + 4], reply[j + 5] = r[t], r[4], r[5]
end
-- One string.format call (in chunks of 960 values only past unpack's stack limit).
local size = #reply
if size <= 960 then
  return string.format(string.rep('%d,', size - 1) .. '%d', unpack(reply))
end
local parts = {}
for first = 1, size, 960 do
  local last = math.min(first + 959, size)
  parts[#parts + 1] = string.format(string.rep('%d,', last - first) .. '%d',
    unpack(reply, first, last))
end
return table.concat(parts, ',')
