-- SLIDING WINDOW LOG. Key: a sorted set, one member per consumed unit, score = its time (us).
--
--   L = limit (units), P = period (us), c = cost (units), now (us since the epoch)
--   An entry with score s counts while s > now - P; older entries are pruned first.
--   Scores are unique: a request's c units get the scores f, f+1, ..., f+c-1 with
--   f = max(now, newest + 1), and the member is the score written in decimal. So members never
--   collide (same microsecond, cost > 1), and an entry is never dated earlier than its request
--   (at most one unit per microsecond: more than 1,000,000 units/second on one key date later,
--   which only makes the log stricter).
--   At most L entries are kept: a log holding more (the limit was lowered) loses its oldest.
--   k = entries after pruning
--   allowed      = c <= L and k + c <= L
--   k' = k + c if allowed else k;  remaining = L - k'
--   reset_after  = newest' + P - now if k' > 0 else 0      (when the last entry expires)
--   retry_after  = 0 if allowed; -1 if c > L; else s_j + P - now where s_j is the score of
--                  the (k + c - L)-th oldest entry (once it expires, c units fit)
--   TTL          = newest' + P - now
--   refund:      remove the c newest entries (ZPOPMAX). Approximation: on a busy key these may
--                be another request's entries written since; the count is right, only which
--                of the newest entries go is not.
--   A score ahead of now by more than P + L (garbage, or a clock jump back by more than a
--   period) resets the key.

-- A loader: the functions are built only when a request uses this algorithm.
local function LOAD_SLIDING_WINDOW_LOG()
  local SLIDING_WINDOW_LOG = {}

  local function swl_read(key, limit, period, now)
    local count, newest, repaired = 0, nil, 0
    local pruned = redis.pcall('ZREMRANGEBYSCORE', key, '-inf', now - period)
    if failed(pruned) then
      repaired = 1
      redis.call('DEL', key)
      return 0, nil, 1
    end
    count = redis.call('ZCARD', key)
    if count > 0 then
      local top = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
      newest = tonumber(top[2])
      if not (whole(newest) and newest <= now + period + limit) then
        redis.call('DEL', key)
        return 0, nil, 1
      end
      if count > limit then
        redis.call('ZREMRANGEBYRANK', key, 0, count - limit - 1)
        count = limit
      end
    end
    return count, newest, repaired
  end

  function SLIDING_WINDOW_LOG.decide(key, limit, period, cost, now)
    local count, newest, repaired = swl_read(key, limit, period, now)
    local first = now
    if newest and newest >= now then
      first = newest + 1
    end
    local allowed = cost <= limit and count + cost <= limit
    local after, last, retry = count, newest, 0
    if allowed then
      if cost > 0 then
        after, last = count + cost, first + cost - 1
      end
    elseif cost > limit then
      retry = -1
    else
      local idx = count + cost - limit - 1
      local entry = redis.call('ZRANGE', key, idx, idx, 'WITHSCORES')
      retry = ceil(tonumber(entry[2]) + period - now)
    end
    local reset, reset_now = 0, 0
    if after > 0 then
      reset = last + period - now
    end
    if count > 0 then
      reset_now = newest + period - now
    end
    return {allowed and 1 or 0, limit - after, reset, retry, repaired, limit - count, reset_now,
      first}
  end

  function SLIDING_WINDOW_LOG.commit(key, r, limit, period, cost, now)
    local first = r[8]
    if cost == 1 then  -- the usual request: no argument table
      redis.call('ZADD', key, first, first)
      expire_in(key, first + period - now)
      return
    end
    local i = 0
    while i < cost do
      local n = cost - i
      if n > 1000 then
        n = 1000
      end
      local args = {}
      for j = 1, n do
        local s = first + i + j - 1
        args[2 * j - 1] = s
        args[2 * j] = s
      end
      redis.call('ZADD', key, unpack(args))
      i = i + n
    end
    expire_in(key, first + cost - 1 + period - now)
  end

  function SLIDING_WINDOW_LOG.refund(key, limit, period, cost, now)
    local count, newest, repaired = swl_read(key, limit, period, now)
    if count > 0 then
      redis.call('ZPOPMAX', key, cost)
      local top = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
      if top[2] then
        expire_in(key, tonumber(top[2]) + period - now)
      end
    end
    return repaired
  end
  return SLIDING_WINDOW_LOG
end
