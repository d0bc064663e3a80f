-- FIXED WINDOW. Key: a hash {w = window index, n = units consumed in that window}.
--
--   L = limit (units), P = period (us), c = cost (units), now (us since the epoch)
--   w_now = floor(now / P); window w = max(w_now, stored w)   (a stored window ahead of the
--           clock, after a failover to a server whose clock is behind, is kept: time is clamped)
--   n = stored n if stored w == w, else 0
--   allowed      = c <= L and n + c <= L
--   n' = n + c if allowed else n;  remaining = max(0, L - n')
--   window end E = (w + 1) * P;     reset_after = E - now if n' > 0 else 0
--   retry_after  = 0 if allowed; -1 (never) if c > L; else E - now (the next window is empty)
--   TTL          = E - now (the key is useless once its window is over), set when the key's window
--                  starts (a new key, a new window, a repaired key): a write into the stored window
--                  leaves the TTL it already has, which ends at the same E (one command less)
--   refund:      n = max(0, n - c) only while the stored window is still the current one.
--                A negative c is a debit (a settlement past the limit): n = n - c in the
--                current window, over L if need be (refused until the window ends), at most 2L.

-- A loader: the functions are built only when a request uses this algorithm. The regions from
-- --@read, --@decide and --@commit to --@end are also the script's fast path for one such check
-- (engine/lua_source.py copies them into fast_path.lua's branch): blocks without a `return`,
-- which set the locals that branch reads (see fast_path.lua).
local function LOAD_FIXED_WINDOW()
  local FIXED_WINDOW = {}

  -- (window, count, repaired, kept: true when the stored window is the one in use, its TTL set)
  local function fw_read(key, period, now)
    --@read
    local window, count, repaired, kept = floor(now / period), 0, 0, false
    local raw = redis.pcall('HMGET', key, 'w', 'n')
    if raw.err then  -- an error (HMGET answers a table: failed(raw) is this)
      repaired = 1
      redis.call('DEL', key)
    elseif raw[1] or raw[2] then
      local w, n = tonumber(raw[1]), tonumber(raw[2])
      if whole(w) and whole(n) and w * period <= now + period then
        if w >= window then
          window, count, kept = w, n, true
        end
      else
        repaired = 1
        redis.call('DEL', key)
      end
    end
    --@end
    return window, count, repaired, kept
  end

  function FIXED_WINDOW.decide(key, limit, period, cost, now)
    local window, count, repaired, kept = fw_read(key, period, now)
    --@decide
    local to_end = (window + 1) * period - now
    local allowed = cost <= limit and count + cost <= limit
    local after, retry = count, 0
    if allowed then
      after = count + cost
    elseif cost > limit then
      retry = -1
    else
      retry = to_end
    end
    -- remaining and reset_after with the request counted, and as the window stands
    local left, reset, left_now, reset_now = 0, 0, 0, 0
    if after < limit then
      left = limit - after
    end
    if after > 0 then
      reset = to_end
    end
    if count < limit then
      left_now = limit - count
    end
    if count > 0 then
      reset_now = to_end
    end
    --@end
    --@result
    local r = {allowed and 1 or 0, left, reset, retry, repaired, left_now, reset_now, window,
      after, kept}
    --@end
    return r
  end

  function FIXED_WINDOW.commit(key, r, limit, period, cost, now)
    --@restore
    local window, after, kept = r[8], r[9], r[10]
    --@end
    --@commit
    if kept then  -- the stored window: w stands, and so does the TTL
      redis.call('HSET', key, 'n', after)
    else
      redis.call('HSET', key, 'w', window, 'n', after)
      expire_in(key, (window + 1) * period - now)
    end
    --@end
  end

  function FIXED_WINDOW.refund(key, limit, period, cost, now)
    local window, count, repaired = fw_read(key, period, now)
    if count > 0 or cost < 0 then
      count = count - cost
      if count > 2 * limit then  -- the most debt a key holds: one limit past a full window
        count = 2 * limit
      end
      if count > 0 then
        redis.call('HSET', key, 'w', window, 'n', count)
        expire_in(key, (window + 1) * period - now)
      else
        redis.call('DEL', key)
      end
    end
    return repaired
  end
  return FIXED_WINDOW
end
