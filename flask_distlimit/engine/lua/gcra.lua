-- GCRA (generic cell rate algorithm). Key: a string, the theoretical arrival time TAT.
--
--   L = limit = burst (units), P = period (us), c = cost (units), now (us since the epoch)
--   T = P / L, the emission interval (us per unit, a double).
--   The TAT is kept in units of T ("now_u = now / T"), not in us: adding c units is then exact
--   in doubles, so a burst of exactly L is admitted whatever T is (a TAT in us accumulates the
--   rounding of T at every request and could admit one unit too many or too few).
--   tat = max(stored TAT, now_u); a missing key is tat = now_u (nothing owed)
--   used = tat - now_u                   (units owed, >= 0)
--   allowed      = c <= L and used + c <= L
--   tat' = tat + c if allowed else tat;  used' = tat' - now_u
--   remaining    = max(0, floor(L - used'))
--   reset_after  = the first whole us r with (now + r) / T >= tat' (ceil(used' * T), then stepped
--                  at most 3 us each way by the same double expression)
--   retry_after  = 0 if allowed; -1 if c > L; else the first whole us d with
--                  (tat - (now + d) / T) + c <= L
--   TTL          = reset_after after the write
--   refund:      tat = max(tat - c, now_u). A negative c is a debit (a settlement past the
--                limit): tat = tat - c (now_u for a missing key), at most now_u + 2L - 1 (the
--                debt a key can hold: under the garbage bound below).
--   A stored TAT more than 2L units ahead (garbage, a clock jump back by more than a period, or a
--   changed rate: T changed, so the units mean another time) resets the key.

-- now / T must stay below 2^52 so that adding whole units to a TAT is exact (about 2.5 million
-- units per second now, a little less every year): the driver refuses faster GCRA rates.
local GCRA_MAX_UNITS = 4503599627370496

-- A loader: the functions are built only when a request uses this algorithm. The regions from
-- --@setup, --@read, --@decide and --@commit to --@end are also the script's fast paths (see
-- fixed_window.lua), which take only rates that always fit (lua/fast_path.lua).
local function LOAD_GCRA()
  local GCRA = {}

  -- (interval, now_u, tat, present: a TAT is stored, repaired 0/1)
  local function gcra_read(key, limit, period, now)
    --@read
    local interval = period / limit
    local now_u = now / interval
    local tat, present, repaired = now_u, false, 0
    local raw = redis.pcall('GET', key)
    if failed(raw) then
      repaired = 1
      redis.call('DEL', key)
    elseif raw then
      local stored = tonumber(raw)
      if finite(stored) and stored - now_u <= 2 * limit then
        present = true
        if stored > now_u then
          tat = stored
        end
      else
        repaired = 1
        redis.call('DEL', key)
      end
    end
    --@end
    return interval, now_u, tat, present, repaired
  end

  --@setup
  -- First whole us r >= 0 after now at which now_u has reached tat.
  local function gcra_until(interval, now, now_u, tat)
    if tat <= now_u then
      return 0
    end
    local r = ceil((tat - now_u) * interval)
    if r < 1 then
      r = 1
    end
    for _ = 1, 3 do
      if r > 1 and (now + r - 1) / interval >= tat then
        r = r - 1
      else
        break
      end
    end
    for _ = 1, 3 do
      if (now + r) / interval >= tat then
        break
      end
      r = r + 1
    end
    return r
  end

  local function gcra_left(limit, now_u, tat)
    local left = floor(limit - (tat - now_u))
    if left < 0 then
      return 0
    end
    return left
  end
  --@end

  function GCRA.decide(key, limit, period, cost, now)
    local interval, now_u, tat, _, repaired = gcra_read(key, limit, period, now)
    --@decide
    local used = tat - now_u
    local allowed = cost <= limit and used + cost <= limit
    local after, retry = tat, 0
    if allowed then
      after = tat + cost
    elseif cost > limit then
      retry = -1
    else
      local d = ceil((used + cost - limit) * interval)
      if d < 1 then
        d = 1
      end
      for _ = 1, 3 do
        if d > 1 and (tat - (now + d - 1) / interval) + cost <= limit then
          d = d - 1
        else
          break
        end
      end
      for _ = 1, 3 do
        if (tat - (now + d) / interval) + cost <= limit then
          break
        end
        d = d + 1
      end
      retry = d
    end
    local left, reset = gcra_left(limit, now_u, after), gcra_until(interval, now, now_u, after)
    local left_now, reset_now = gcra_left(limit, now_u, tat), gcra_until(interval, now, now_u, tat)
    --@end
    --@result
    local r = {allowed and 1 or 0, left, reset, retry, repaired, left_now, reset_now, after}
    --@end
    return r
  end

  function GCRA.commit(key, r, limit, period, cost, now)
    --@restore
    local after, reset = r[8], r[3]
    --@end
    --@commit
    redis.call('SET', key, after, 'PX', floor((reset + 1999) / 1000))
    --@end
  end

  function GCRA.refund(key, limit, period, cost, now)
    local interval, now_u, tat, present, repaired = gcra_read(key, limit, period, now)
    if present or cost < 0 then
      tat = tat - cost
      if tat > now_u + (2 * limit - 1) then
        tat = now_u + (2 * limit - 1)
      end
      if tat > now_u then
        redis.call('SET', key, tat, 'PX',
          floor((gcra_until(interval, now, now_u, tat) + 1999) / 1000))
      else
        redis.call('DEL', key)
      end
    end
    return repaired
  end
  return GCRA
end
