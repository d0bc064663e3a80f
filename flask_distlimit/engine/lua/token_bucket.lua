-- TOKEN BUCKET. Key: a hash {t = tokens (a double, %.17g), s = time of t (us)}.
--
--   L = limit = capacity (tokens), P = period (us): the bucket refills L tokens per P,
--   c = cost (tokens), now (us since the epoch)
--   A missing key is a full bucket. Time is clamped: t0 = max(now, s) (a clock that went back
--   does not refill, and never subtracts tokens).
--   tokens(x) = min(L, t + ((x - s) * L) / P)   (doubles, in exactly this order)
--   k = tokens(t0)
--   allowed      = c <= L and c <= k
--   k' = k - c if allowed else k;  remaining = floor(k')
--   reset_after  = (t0 - now) + r, r = the first whole us at which the bucket is full again:
--                  ceil(((L - k') * P) / L), then stepped (at most 3 us each way) to the first
--                  us with tokens(t0 + r) >= L by the same double expression, so the key is
--                  never dropped while the bucket is not full
--   retry_after  = 0 if allowed; -1 if c > L; else (t0 - now) + d, d likewise the first whole
--                  us with tokens(t0 + d) >= c
--   TTL          = reset_after after the write (a full bucket and a missing key are the same)
--   refund:      t = min(L, k + c) at t0. A negative c is a debit (a settlement past the
--                limit): t = k + c, below 0 if need be, down to -L (a missing key is
--                full); the refill repays it. remaining is never below 0.

-- A loader: the functions are built only when a request uses this algorithm. The regions from
-- --@setup, --@read, --@decide and --@commit to --@end are also the script's fast paths (see
-- fixed_window.lua).
local function LOAD_TOKEN_BUCKET()
  local TOKEN_BUCKET = {}

  -- (b, s: the stored tokens and their time, nil when none; t0; k; repaired 0/1)
  local function tb_read(key, limit, period, now)
    --@read
    local b, s, t0, k, repaired = nil, nil, now, limit, 0
    local raw = redis.pcall('HMGET', key, 't', 's')
    if raw.err then  -- an error (HMGET answers a table: failed(raw) is this)
      repaired = 1
      redis.call('DEL', key)
    elseif raw[1] or raw[2] then
      local t, at = tonumber(raw[1]), tonumber(raw[2])
      -- t below 0 is a debit's debt, at most L
      if t and t == t and t >= -limit and t < MAX_EXACT and whole(at) and at <= now + period then
        b, s = t, at
        if at > now then
          t0 = at
        end
        k = t + ((t0 - at) * limit) / period
        if k > limit then
          k = limit
        end
      else
        repaired = 1
        redis.call('DEL', key)
      end
    end
    --@end
    return b, s, t0, k, repaired
  end

  --@setup
  -- First whole us d >= 1 after t0 at which a bucket holding b tokens at time s holds `want`.
  local function tb_wait(limit, period, b, s, t0, k, want)
    local d = ceil(((want - k) * period) / limit)
    if d < 1 then
      d = 1
    end
    for _ = 1, 3 do
      if d > 1 and b + (((t0 + d - 1 - s) * limit) / period) >= want then
        d = d - 1
      else
        break
      end
    end
    for _ = 1, 3 do
      if b + (((t0 + d - s) * limit) / period) >= want then
        break
      end
      d = d + 1
    end
    return d
  end
  --@end

  function TOKEN_BUCKET.decide(key, limit, period, cost, now)
    local b, s, t0, k, repaired = tb_read(key, limit, period, now)
    --@decide
    local shift = t0 - now
    local allowed = cost <= limit and cost <= k
    local after, retry, reset, reset_now = k, 0, 0, 0
    if k < limit then
      reset_now = shift + tb_wait(limit, period, b, s, t0, k, limit)
    end
    if allowed then
      after = k - cost
    elseif cost > limit then
      retry = -1
    else
      retry = shift + tb_wait(limit, period, b, s, t0, k, cost)
    end
    if allowed and cost > 0 then
      reset = shift + tb_wait(limit, period, after, t0, t0, after, limit)
    else
      reset = reset_now
    end
    local left, left_now = floor(after), floor(k)
    if left_now < 0 then  -- a debit's debt: nothing left
      left, left_now = 0, 0
    end
    --@end
    --@result
    local r = {allowed and 1 or 0, left, reset, retry, repaired, left_now, reset_now, after, t0}
    --@end
    return r
  end

  function TOKEN_BUCKET.commit(key, r, limit, period, cost, now)
    --@restore
    local after, t0, reset = r[8], r[9], r[3]
    --@end
    --@commit
    redis.call('HSET', key, 't', after, 's', t0)
    expire_in(key, reset)
    --@end
  end

  function TOKEN_BUCKET.refund(key, limit, period, cost, now)
    local b, _, t0, k, repaired = tb_read(key, limit, period, now)
    if b or cost < 0 then
      k = k + cost
      if k < -limit then  -- the most debt a key holds
        k = -limit
      end
      if k < limit then
        redis.call('HSET', key, 't', k, 's', t0)
        expire_in(key, t0 - now + tb_wait(limit, period, k, t0, t0, k, limit))
      else
        redis.call('DEL', key)
      end
    end
    return repaired
  end
  return TOKEN_BUCKET
end
