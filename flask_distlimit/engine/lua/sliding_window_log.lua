-- SLIDING WINDOW LOG. Key: a list, ONE entry per admitted request of cost > 0, the newest first
-- (index 0), each "<t>:<start>:<end>":
--
--   t      = the request's time (us);
--   start, end: its units are numbers start + 1 .. end of a running count of the units the key
--          has admitted (end - start = its cost; start = the end of the entry before it, 0 for a
--          key's first entry).
-- So a request of any cost writes one entry, and the units in the window are
-- end(newest) - start(oldest live), read from the list's two ends whatever the limit and cost.
--
--   L = limit (units), P = period (us), c = cost (units), now (us since the epoch)
--   An entry of time t counts while t > now - P. Every expired entry is removed (from the old
--   end, in one LTRIM), found among the SWL_BATCH + 1 oldest entries, or when all of them
--   expired by a binary search over the list by time (LINDEX, at most log2 of its length).
--   Times are unique and increasing toward the head: a request is dated f = max(now, newest + 1)
--   (never earlier than the request; more than one request per microsecond on one key date
--   later, which only makes the log stricter), and each entry's start is the newest one's end.
--   base = start(oldest live); k = min(end(newest) - base, L), 0 when no entry is live: a log
--          holding more than L units (a debt, or the limit was lowered) counts its newest L
--   allowed      = c <= L and k + c <= L
--   k' = k + c if allowed else k;  remaining = L - k'
--   reset_after  = newest' + P - now if k' > 0 else 0      (when the last entry expires)
--   retry_after  = 0 if allowed; -1 if c > L; else t + P - now where t is the time of the
--                  oldest live entry whose end >= end(newest) + c - L (once it expires, c units
--                  fit), looked for among the SWL_BATCH oldest live entries; when they do not
--                  hold enough units, t is the time of the last of them (no earlier can c
--                  units fit; the request is decided again then). Exact whenever the units
--                  to free are in the SWL_BATCH oldest requests (always when at most SWL_BATCH
--                  requests are live, and for a cost of 1 while at most L units are live).
--   TTL          at least swl_until(newest') - now (newest' + P rounded up to a step of P / 8, at
--                most 1 s): set when an admission or a debit moves swl_until, else kept. This
--                layout and swl_until are the key's format: a change of either is a change of
--                the storage key format (docs/releasing.md), never a patch's
--   refund:      take back the c OLDEST units: base' = base + c (a debt's units beyond L
--                count: the oldest is not forgiven); the live entries
--                that end at or below base' go (at most SWL_BATCH of them: the rest of the
--                refund is not given back, which only makes the log stricter), the one across
--                base' keeps its units above it. The newest units may be later requests':
--                taking the oldest keeps every unit left counted at least as long as the
--                refunding request's own would have been (taking the newest would date later
--                units earlier, and the log could admit more than L within a period).
--                A negative c is a debit (a settlement past the limit): one more entry of
--                -c units, as an admission writes it; the log counts at most L of them.
--   A key whose newest entry is dated ahead of now by more than P + L (garbage, or a clock jump
--   back by more than a period), or whose newest, oldest live or searched entry does not read
--   as "<t>:<start>:<end>" with start < end, is reset.
--
-- Bound per call and key, whatever L and c: at most 6 Redis commands while at most SWL_BATCH
-- entries expired since the last call (9 in a refund, which evaluates again after giving
-- back), plus one LLEN and a LINDEX per halving of the list when more did; one entry written
-- (bench/bench_script_time.py measures it).

-- The entries read from the list's old end (the expired ones among them and the oldest live),
-- and the most a retry time is looked for among. Also in
-- flask_distlimit/engine/sliding_window_log.py: the twin does exactly as much.
--@setup
local SWL_BATCH = 4
--@end

-- A loader: the functions are built only when a request uses this algorithm. The regions from
-- --@setup, --@read, --@decide and --@commit to --@end are also the script's fast path for one
-- such check (engine/lua_source.py copies them into fast_path.lua's branch; see
-- fixed_window.lua).
local function LOAD_SLIDING_WINDOW_LOG()
  local SLIDING_WINDOW_LOG = {}
  --@setup
  local match = string.match

  -- An entry's (t, start, end), or nil for anything but "<t>:<start>:<end>" with
  -- start < end, each below 2^53.
  local function swl_entry(entry)
    if type(entry) ~= 'string' then
      return nil
    end
    local a, b, c = match(entry, '^(%d+):(%d+):(%d+)$')
    if a == nil then
      return nil
    end
    local t, s, e = tonumber(a), tonumber(b), tonumber(c)
    if t < MAX_EXACT and s < MAX_EXACT and e < MAX_EXACT and s < e then  -- digits: whole
      return t, s, e
    end
    return nil
  end

  -- When a key whose newest entry is dated t may go: a period on, rounded up to a step of an
  -- eighth of the period (at most 1 s). The key's TTL is at least this - now, so an admission
  -- sets it only when its date moves this (a busy key's PEXPIRE once a step, not per request).
  local function swl_until(t, period)
    local step = ceil(period / 8)
    if step > 1000000 then
      step = 1000000
    end
    return (floor((t + period) / step) + 1) * step
  end
  --@end

  -- The key's state with every expired entry removed: (k, newest time or nil, end(newest) (0
  -- when empty), base, repaired 0/1).
  local function swl_read(key, limit, period, now)
    --@read
    local count, newest, last, base, repaired = 0, nil, 0, 0, 0
    local cut = now - period
    local top = redis.pcall('LINDEX', key, 0)
    if failed(top) then
      redis.call('UNLINK', key)
      repaired = 1
    elseif top then
      local t, _, top_end = swl_entry(top)
      if not (t and t <= now + period + limit) then
        redis.call('UNLINK', key)
        repaired = 1
      elseif t <= cut then  -- nothing live, only expired entries: afresh
        redis.call('UNLINK', key)
      else
        -- the oldest entries, oldest last; the oldest live among them, or by a search
        local block = redis.call('LRANGE', key, -SWL_BATCH - 1, -1)
        local n, i, ti, start, first_end = #block, #block, nil, nil, nil
        while i >= 1 do
          ti, start, first_end = swl_entry(block[i])
          if not ti or ti > cut then
            break
          end
          i = i - 1
        end
        if i == 0 then  -- all of them expired (more than SWL_BATCH): search (entry 0 is live)
          local lo, hi = 0, redis.call('LLEN', key) - n
          while ti and hi - lo > 1 do
            local mid = floor((lo + hi) / 2)
            ti, start, first_end = swl_entry(redis.call('LINDEX', key, mid))
            if ti and ti > cut then
              lo = mid
            else
              hi = mid
            end
          end
          if ti then
            ti, start, first_end = swl_entry(redis.call('LINDEX', key, lo))
            redis.call('LTRIM', key, 0, lo)
          end
        elseif i < n then
          redis.call('LTRIM', key, 0, i - n - 1)
        end
        if not (ti and first_end <= top_end) then
          redis.call('UNLINK', key)
          repaired = 1
        else
          count, newest, last, base = top_end - start, t, top_end, start
          if count > limit then
            count = limit
          end
        end
      end
    end
    --@end
    return count, newest, last, base, repaired
  end

  function SLIDING_WINDOW_LOG.decide(key, limit, period, cost, now)
    local count, newest, last, base, repaired = swl_read(key, limit, period, now)
    --@decide
    local first = now
    if newest and newest >= now then
      first = newest + 1
    end
    local allowed = cost <= limit and count + cost <= limit
    local after, latest, retry, renew = count, newest, 0, 0
    if allowed then
      if cost > 0 then
        after, latest = count + cost, first
        local at = swl_until(first, period)
        if not newest or at ~= swl_until(newest, period) then
          renew = at - now
        end
      end
    elseif cost > limit then
      retry = -1
    else
      -- when the oldest live entry whose end reaches the goal expires, looked for among the
      -- SWL_BATCH oldest live entries (the list's old end: every expired one is gone); if they
      -- do not reach the goal, when the last of them expires: no earlier can the request pass.
      -- Ends grow toward the head; an entry that does not read ends the search.
      local goal = last + cost - limit
      local block = redis.call('LRANGE', key, -SWL_BATCH, -1)
      local t
      for i = #block, 1, -1 do
        local ti, _, e = swl_entry(block[i])
        if ti == nil then
          break
        end
        t = ti
        if e >= goal then
          break
        end
      end
      retry = t + period - now
    end
    local left, reset, left_now, reset_now = limit - after, 0, limit - count, 0
    if after > 0 then
      reset = latest + period - now
    end
    if count > 0 then
      reset_now = newest + period - now
    end
    --@end
    --@result
    local r = {allowed and 1 or 0, left, reset, retry, repaired, left_now, reset_now, first, last,
      renew}
    --@end
    return r
  end

  function SLIDING_WINDOW_LOG.commit(key, r, limit, period, cost, now)
    --@restore
    local first, last, renew = r[8], r[9], r[10]
    --@end
    --@commit
    redis.call('LPUSH', key, string.format('%d:%d:%d', first, last, last + cost))
    if renew > 0 then
      expire_in(key, renew)
    end
    --@end
  end

  -- Refund: the key is read as an evaluation reads it (every expired entry goes, garbage is
  -- reset), then the oldest units go. The newest entry stays: so does the TTL. A Cluster
  -- refund of a request another group refused takes the oldest units too: the newest entry
  -- may be a later request's of the same cost, whose units would then be dated earlier.
  function SLIDING_WINDOW_LOG.refund(key, limit, period, cost, now)
    local count, newest, last, start, repaired = swl_read(key, limit, period, now)
    if cost < 0 then  -- a debit: one more entry of -c units, dated as an admission is
      local first = now
      if newest and newest >= now then
        first = newest + 1
      end
      redis.call('LPUSH', key, string.format('%d:%d:%d', first, last, last - cost))
      expire_in(key, swl_until(first, period) - now)
      return repaired
    end
    if repaired == 1 or count == 0 or cost == 0 then  -- reset, nothing live, or nothing to give
      return repaired
    end
    local target = start + cost
    if target >= last then  -- every unit counted goes back
      redis.call('UNLINK', key)
      return 0
    end
    -- the oldest entry holding a unit above target (ends grow toward the head): those below it
    -- go, at most SWL_BATCH of them
    local block = redis.call('LRANGE', key, -SWL_BATCH - 1, -1)
    local n, r = #block, 0
    local t, s, e = swl_entry(block[n])
    while r < SWL_BATCH and e and e <= target do
      r = r + 1
      t, s, e = swl_entry(block[n - r])
    end
    if r > 0 then
      redis.call('LTRIM', key, 0, -r - 1)
    end
    if s and s < target and target < e then
      redis.call('LSET', key, -1, string.format('%d:%d:%d', t, target, e))
    end
    return 0
  end
  return SLIDING_WINDOW_LOG
end
