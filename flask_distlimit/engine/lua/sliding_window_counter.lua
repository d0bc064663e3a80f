-- SLIDING WINDOW COUNTER (Cloudflare's estimate). Key: a hash {w = window index,
-- c = units in window w, p = units in window w - 1}.
--
--   L = limit (units), P = period (us), c = cost (units), now (us since the epoch)
--   w_now = floor(now / P). A stored window ahead of w_now (clock went back) is kept and time is
--   clamped to its start: t = max(now, w * P). Otherwise t = now, w = w_now, and the stored
--   counts shift: stored w == w_now -> (cur, prev) = (c, p); w_now - 1 -> (0, c); older -> (0, 0).
--   elapsed = t - w * P   (0 <= elapsed < P)
--   weighted = prev * (P - elapsed) / P      (a double: (prev * (P - elapsed)) / P, that order)
--   allowed  = c <= L and weighted + (cur + c) <= L
--   cur' = cur + c if allowed else cur;  estimate' = weighted + cur'
--   remaining   = max(0, floor(L - estimate'))
--   reset_after = (t - now) + (2P - elapsed if cur' > 0; P - elapsed if prev > 0; else 0)
--   retry_after = 0 if allowed; -1 if c > L; else the first whole microsecond d at which the
--                 estimate leaves room for c (within this window if cur + c <= L, else in the
--                 next one, where prev becomes cur), checked with the same double expression
--                 (the closed form, then at most 3 steps of 1 us each way).
--   TTL         = (t - now) + 2P - elapsed  (to the end of the next window: two at most), set
--                 when the key's window starts (a new key, a new window, a repaired key): a
--                 write into the stored window keeps the TTL it has, which ends at the same time
--   It is an estimate: it may admit a little more or less than L in a true sliding window.
--   refund:     cur = max(0, cur - c) while the stored window is still the current one.
--               A negative c is a debit (a settlement past the limit): cur = cur - c in the
--               current window, over L if need be, at most 2L.

-- A loader: the functions are built only when a request uses this algorithm. The regions from
-- --@read, --@decide and --@commit to --@end are also the script's fast path for one such check
-- (engine/lua_source.py copies them into fast_path.lua's branch; see fixed_window.lua).
local function LOAD_SLIDING_WINDOW_COUNTER()
  local SLIDING_WINDOW_COUNTER = {}

  local function swc_read(key, period, now)
    --@read
    local window, t, cur, prev, current, repaired = floor(now / period), now, 0, 0, false, 0
    local raw = redis.pcall('HMGET', key, 'w', 'c', 'p')
    if raw.err then  -- an error (HMGET answers a table: failed(raw) is this)
      repaired = 1
      redis.call('DEL', key)
    elseif raw[1] or raw[2] or raw[3] then
      local w, c, p = tonumber(raw[1]), tonumber(raw[2]), tonumber(raw[3])
      if whole(w) and whole(c) and whole(p) and w * period <= now + period then
        if w > window then
          window, t, cur, prev, current = w, w * period, c, p, true
        elseif w == window then
          cur, prev, current = c, p, true
        elseif w == window - 1 then
          prev = c
        end
      else
        repaired = 1
        redis.call('DEL', key)
      end
    end
    --@end
    return window, t, cur, prev, current, repaired
  end

  -- Would `cost` fit at `elapsed` into a window holding `cur` after one holding `prev`? That is
  -- (prev * (period - elapsed)) / period + (cur + cost) <= limit, written out where it is asked.
  function SLIDING_WINDOW_COUNTER.decide(key, limit, period, cost, now)
    local window, t, cur, prev, current, repaired = swc_read(key, period, now)
    --@decide
    local elapsed = t - window * period
    local shift = t - now
    local weighted = (prev * (period - elapsed)) / period
    local allowed = cost <= limit and weighted + (cur + cost) <= limit
    local after, retry = cur, 0
    if allowed then
      after = cur + cost
    elseif cost > limit then
      retry = -1
    elseif cur + cost <= limit then
      -- prev > 0 here: wait in this window until enough of prev has slid out
      local d = ceil((period - elapsed) - ((limit - cur - cost) * period) / prev)
      if d < 1 then
        d = 1
      end
      for _ = 1, 3 do
        if d > 1 and (prev * (period - (elapsed + d - 1))) / period + (cur + cost) <= limit then
          d = d - 1
        else
          break
        end
      end
      for _ = 1, 3 do
        if d >= period - elapsed
            or (prev * (period - (elapsed + d))) / period + (cur + cost) <= limit then
          break
        end
        d = d + 1
      end
      retry = shift + d
    else
      -- only in the next window, where cur becomes prev (cur > L - c >= 0)
      local e = ceil(period - ((limit - cost) * period) / cur)
      if e < 0 then
        e = 0
      end
      for _ = 1, 3 do
        if e > 0 and (cur * (period - (e - 1))) / period + (0 + cost) <= limit then
          e = e - 1
        else
          break
        end
      end
      for _ = 1, 3 do
        if e >= period or (cur * (period - e)) / period + (0 + cost) <= limit then
          break
        end
        e = e + 1
      end
      retry = shift + (period - elapsed) + e
    end
    -- remaining and reset_after with the request counted (cur' = after), and as the key stands
    local left, left_now = floor(limit - (weighted + after)), floor(limit - (weighted + cur))
    if left < 0 then
      left = 0
    end
    if left_now < 0 then
      left_now = 0
    end
    local reset, reset_now = 0, 0
    if after > 0 then
      reset = shift + 2 * period - elapsed
    elseif prev > 0 then
      reset = shift + period - elapsed
    end
    if cur > 0 then
      reset_now = shift + 2 * period - elapsed
    elseif prev > 0 then
      reset_now = shift + period - elapsed
    end
    --@end
    --@result
    local r = {allowed and 1 or 0, left, reset, retry, repaired, left_now, reset_now, window,
      after, prev, current}
    --@end
    return r
  end

  function SLIDING_WINDOW_COUNTER.commit(key, r, limit, period, cost, now)
    --@restore
    local window, after, prev, current = r[8], r[9], r[10], r[11]
    --@end
    --@commit
    if current then  -- the stored window: w and p stand, and so does the TTL
      redis.call('HSET', key, 'c', after)
    else
      redis.call('HSET', key, 'w', window, 'c', after, 'p', prev)
      expire_in(key, (window + 2) * period - now)
    end
    --@end
  end

  function SLIDING_WINDOW_COUNTER.refund(key, limit, period, cost, now)
    local window, _, cur, prev, current, repaired = swc_read(key, period, now)
    if current and cur > 0 or cost < 0 then
      cur = cur - cost
      if cur < 0 then
        cur = 0
      elseif cur > 2 * limit then  -- the most debt a key holds: one limit past a full window
        cur = 2 * limit
      end
      if cur > 0 or prev > 0 then
        redis.call('HSET', key, 'w', window, 'c', cur, 'p', prev)
        expire_in(key, (window + 2) * period - now)
      else
        redis.call('DEL', key)
      end
    end
    return repaired
  end
  return SLIDING_WINDOW_COUNTER
end
