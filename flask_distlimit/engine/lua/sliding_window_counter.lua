-- SLIDING WINDOW COUNTER (Cloudflare's estimate). Key: a hash {w = window index,
-- c = units in window w, p = units in window w - 1}.
--
-- KEEP IN STEP with sliding_window_counter_fast.lua, which decides one such check inline (the
-- common request): a change here is made there too; tests/test_script_fastpath.py compares the
-- two paths on twin keys.
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

-- A loader: the functions are built only when a request uses this algorithm.
local function LOAD_SLIDING_WINDOW_COUNTER()
  local SLIDING_WINDOW_COUNTER = {}

  local function swc_read(key, period, now)
    local window, t, cur, prev, current, repaired = floor(now / period), now, 0, 0, false, 0
    local raw = redis.pcall('HMGET', key, 'w', 'c', 'p')
    if failed(raw) then
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
    return window, t, cur, prev, current, repaired
  end

  -- Would `cost` fit at `elapsed` into a window holding `cur` after one holding `prev`?
  local function swc_fits(limit, period, prev, cur, cost, elapsed)
    return (prev * (period - elapsed)) / period + (cur + cost) <= limit
  end

  local function swc_left(limit, weighted, cur)
    local left = floor(limit - (weighted + cur))
    if left < 0 then
      return 0
    end
    return left
  end

  local function swc_reset(period, prev, cur, shift, elapsed)
    if cur > 0 then
      return shift + 2 * period - elapsed
    elseif prev > 0 then
      return shift + period - elapsed
    end
    return 0
  end

  function SLIDING_WINDOW_COUNTER.decide(key, limit, period, cost, now)
    local window, t, cur, prev, current, repaired = swc_read(key, period, now)
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
        if d > 1 and swc_fits(limit, period, prev, cur, cost, elapsed + d - 1) then
          d = d - 1
        else
          break
        end
      end
      for _ = 1, 3 do
        if d >= period - elapsed or swc_fits(limit, period, prev, cur, cost, elapsed + d) then
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
        if e > 0 and swc_fits(limit, period, cur, 0, cost, e - 1) then
          e = e - 1
        else
          break
        end
      end
      for _ = 1, 3 do
        if e >= period or swc_fits(limit, period, cur, 0, cost, e) then
          break
        end
        e = e + 1
      end
      retry = shift + (period - elapsed) + e
    end
    return {allowed and 1 or 0, swc_left(limit, weighted, after),
      swc_reset(period, prev, after, shift, elapsed), retry, repaired,
      swc_left(limit, weighted, cur), swc_reset(period, prev, cur, shift, elapsed),
      window, after, prev, current}
  end

  function SLIDING_WINDOW_COUNTER.commit(key, r, limit, period, cost, now)
    local window = r[8]
    if r[11] then  -- the stored window: w and p stand, and so does the TTL
      redis.call('HSET', key, 'c', r[9])
    else
      redis.call('HSET', key, 'w', window, 'c', r[9], 'p', r[10])
      expire_in(key, (window + 2) * period - now)
    end
  end

  function SLIDING_WINDOW_COUNTER.refund(key, limit, period, cost, now)
    local window, _, cur, prev, current, repaired = swc_read(key, period, now)
    if current and cur > 0 then
      cur = cur - cost
      if cur < 0 then
        cur = 0
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
