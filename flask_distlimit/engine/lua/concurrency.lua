-- CONCURRENCY (requests in flight, not a rate). Key: a sorted set of the slots in use:
--   member = the slot's token (a decimal integer the client draws per request, >= 1),
--   score  = when its lease ends (us). A slot is given back by its request when the response
--            ends (a release check); a slot whose process died is given back by its lease.
--
--   L = slots, P = lease (us), t = token (0: a peek), now (us since the epoch)
--   Slots whose lease ended (score <= now) are removed first; k = the live slots. A key
--   holding a slot whose lease ends more than two days on is garbage: replaced (repaired).
--   allowed      = t == 0; or t already holds a live slot: its own (the request's call made
--                  again after its reply was lost, without a kept reply: a calm storage,
--                  flask_distlimit/storage/tokens.py), its lease renewed, no slot more (tokens
--                  are drawn at random per request: no two requests share one); or k + 1 <= L
--   k' = k + 1 if a new slot is taken, else k;  remaining = L - k'
--   reset_after  = P if a slot is taken or renewed, else latest lease end - now if k > 0,
--                  else 0   (every slot is free by then)
--   retry_after  = 0 if allowed; else min(1 s, earliest lease end - now): a slot frees when a
--                  request ends, which no one can foresee; 1 s is a hint, never a promise
--   TTL          = P (the newest slot's lease; every other ends earlier)
--   refund (the release): ZREM t.
--   Bounded work: at most L + expired members are live, L <= MAX_CONCURRENCY
--   (flask_distlimit/core/algorithms.py); a key of another type is replaced.

local function LOAD_CONCURRENCY()
  local CONCURRENCY = {}

  -- (live slots, repaired): expired slots removed; a key of another type, or holding a slot
  -- whose lease ends more than two days from now (no lease is longer than one,
  -- DISTLIMIT_CONCURRENCY_LEASE's most: garbage, which would hold that slot for ever), deleted.
  local function cc_read(key, now)
    local gone = redis.pcall('ZREMRANGEBYSCORE', key, '-inf', now)
    if failed(gone)
        or redis.call('ZCOUNT', key, string.format('(%d', now + 172800000000), '+inf') > 0 then
      redis.call('DEL', key)
      return 0, 1
    end
    return redis.call('ZCARD', key), 0
  end

  local function cc_until(key, first, now)
    local edge = redis.call('ZRANGE', key, first, first, 'WITHSCORES')
    local score = tonumber(edge[2])
    if score == nil or score <= now then
      return 0
    end
    return score - now
  end

  function CONCURRENCY.decide(key, limit, period, cost, now)
    local k, repaired = cc_read(key, now)
    local allowed, taken, own = true, k, false
    if cost > 0 then
      if repaired == 0 and redis.call('ZSCORE', key, cost) then
        own = true  -- its own live slot (its call made again): renewed, not taken twice
      elseif k + 1 <= limit then
        taken = k + 1
      else
        allowed = false
      end
    end
    local left_now = limit - k
    if left_now < 0 then
      left_now = 0
    end
    local left = limit - taken
    if left < 0 then
      left = 0
    end
    local reset_now = 0
    if k > 0 then
      reset_now = cc_until(key, -1, now)
    end
    local reset, retry = reset_now, 0
    if taken > k or own then
      reset = period
    end
    if not allowed then
      retry = cc_until(key, 0, now)
      if retry > 1000000 or retry <= 0 then
        retry = 1000000
      end
    end
    return {allowed and 1 or 0, left, reset, retry, repaired, left_now, reset_now}
  end

  function CONCURRENCY.commit(key, r, limit, period, cost, now)
    redis.call('ZADD', key, now + period, cost)
    expire_in(key, period)
  end

  function CONCURRENCY.refund(key, limit, period, cost, now)
    local gone = redis.pcall('ZREM', key, cost)
    if failed(gone) then
      redis.call('DEL', key)
      return 1
    end
    return 0
  end
  return CONCURRENCY
end
