-- FIXED WINDOW. Key: a hash {w = window index, n = units consumed in that window}.
--
-- KEEP IN STEP with fixed_window_fast.lua, which decides one such check inline (the common request,
-- 15 us less per call): a change here is made there too; tests/test_script_fastpath.py compares
-- the two paths on twin keys.
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

-- A loader: the functions are built only when a request uses this algorithm.
local function LOAD_FIXED_WINDOW()
  local FIXED_WINDOW = {}

  -- (window, count, repaired, kept: 1 when the stored window is the one in use, its TTL set)
  local function fw_read(key, period, now)
    local window, count, repaired, kept = floor(now / period), 0, 0, 0
    local raw = redis.pcall('HMGET', key, 'w', 'n')
    if failed(raw) then
      repaired = 1
      redis.call('DEL', key)
    elseif raw[1] or raw[2] then
      local w, n = tonumber(raw[1]), tonumber(raw[2])
      if whole(w) and whole(n) and w * period <= now + period then
        if w >= window then
          window, count, kept = w, n, 1
        end
      else
        repaired = 1
        redis.call('DEL', key)
      end
    end
    return window, count, repaired, kept
  end

  local function fw_left(limit, n)
    if n < limit then
      return limit - n
    end
    return 0
  end

  local function fw_reset(n, to_end)
    if n > 0 then
      return to_end
    end
    return 0
  end

  function FIXED_WINDOW.decide(key, limit, period, cost, now)
    local window, count, repaired, kept = fw_read(key, period, now)
    local window_end = (window + 1) * period
    local allowed = cost <= limit and count + cost <= limit
    local after = count
    local retry = 0
    if allowed then
      after = count + cost
    elseif cost > limit then
      retry = -1
    else
      retry = window_end - now
    end
    return {allowed and 1 or 0, fw_left(limit, after), fw_reset(after, window_end - now), retry,
      repaired, fw_left(limit, count), fw_reset(count, window_end - now), window, after, kept}
  end

  function FIXED_WINDOW.commit(key, r, limit, period, cost, now)
    if r[10] == 1 then  -- the stored window: w stands, and so does the TTL
      redis.call('HSET', key, 'n', r[9])
    else
      redis.call('HSET', key, 'w', r[8], 'n', r[9])
      expire_in(key, (r[8] + 1) * period - now)
    end
  end

  function FIXED_WINDOW.refund(key, limit, period, cost, now)
    local window, count, repaired = fw_read(key, period, now)
    if count > 0 then
      count = count - cost
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
