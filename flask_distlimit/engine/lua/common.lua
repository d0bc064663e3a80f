-- Helpers shared by every algorithm file (first in the script, before the fast path).
--
-- Units: every time is an integer number of MICROSECONDS since the epoch (now, period, the
-- durations in replies); Redis TTLs are set in milliseconds, rounded UP from microseconds.
-- Numbers go to Redis as Lua numbers: Redis writes them with %.17g, so integers below 2^53 stay
-- exact and the two fractional values (token bucket tokens, GCRA TAT) read back bit-exact.
--
-- INLINED: every `local function` below is written into the script at each of its calls by
-- flask_distlimit/engine/lua_source.py, not defined (a function in a script is a closure built
-- again on every call: docs/bench/engine.md, "The script's own time"). One whose body is a
-- single `return` is an expression, called with plain names only (each is read more than once);
-- any other is a statement, called on a line of its own, its arguments bound once (`do local`).

local floor = math.floor
local ceil = math.ceil
-- Integers stay exact below 2^53 in Lua's doubles; stored counts/times above it are garbage.
local MAX_EXACT = 9007199254740992

-- A whole, non-negative, exactly representable number (false for nil, NaN, +-inf, fractions).
local function whole(x)
  return x ~= nil and x == x and x >= 0 and x < MAX_EXACT and x == floor(x)
end

-- A finite, non-negative number below 2^53 (false for nil, NaN, +-inf).
local function finite(x)
  return x ~= nil and x == x and x >= 0 and x < MAX_EXACT
end

-- A redis.pcall reply that is an error (WRONGTYPE and friends).
local function failed(reply)
  return type(reply) == 'table' and reply.err ~= nil
end

-- Keep `key` for `us` more microseconds: rounded up to whole ms, and 1 ms more, because Redis
-- counts a TTL from a clock truncated to the ms: `PEXPIRE k 1` may expire k within the same
-- call (measured on 7.0: 7 in 30,000), so a key could vanish up to 1 ms before its window or
-- its last member ended and a request in that ms start from zero. 0 or less deletes it.
local function expire_in(key, us)
  if us > 0 then
    redis.call('PEXPIRE', key, floor((us + 1999) / 1000))
  else
    redis.call('DEL', key)
  end
end
