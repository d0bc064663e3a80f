-- SLIDING WINDOW LOG. Key: a sorted set, ONE member per admitted request of cost > 0:
--
--   score  = the request's time (us);
--   member = "<start>:<end>": the request's units are numbers start + 1 .. end of a running
--            count of the units the key has admitted (end - start = its cost; start = the end
--            of the member before it, 0 for a key's first member).
-- So a request of any cost writes one member, and the units in the window are
-- end(newest) - start(oldest live), read by rank in two lookups, whatever the limit and cost.
--
--   L = limit (units), P = period (us), c = cost (units), now (us since the epoch)
--   A member with score s counts while s > now - P. Expired members are removed oldest first,
--   at most SWL_BATCH of them per call (the rest in later calls, or with the key's TTL).
--   Scores are unique and increasing: a request is dated f = max(now, newest + 1) (never earlier
--   than the request; more than one request per microsecond on one key date later, which only
--   makes the log stricter), and each member's start is the newest member's end.
--   base = start(oldest live); a log holding more than L units (the limit was lowered) counts
--          only its newest L: base = max(base, end(newest) - L)
--   k = end(newest) - base, 0 when no member is live
--   allowed      = c <= L and k + c <= L
--   k' = k + c if allowed else k;  remaining = L - k'
--   reset_after  = newest' + P - now if k' > 0 else 0      (when the last member expires)
--   retry_after  = 0 if allowed; -1 if c > L; else s + P - now where s is the score of the
--                  oldest live member whose end >= base + (k + c - L) (once it expires, c units
--                  fit), looked for among the SWL_BATCH oldest live members; when they do not
--                  hold enough units, s is the score of the last of them (no earlier can c
--                  units fit; the request is decided again then). Exact whenever the units
--                  to free are in the SWL_BATCH oldest requests (always when at most SWL_BATCH
--                  requests are live, and for a cost of 1).
--   TTL          at least swl_until(newest') - now (newest' + P rounded up to a step of P / 8, at
--                most 1 s): set when an admission or a debit moves swl_until, else kept
--   refund:      take back the c OLDEST counted units: base' = base + c; the live members
--                that end at or below base' go (at most SWL_BATCH of them: the rest of the
--                refund is not given back, which only makes the log stricter), the one across
--                base' keeps its units above it. The newest units may be later requests':
--                taking the oldest keeps every unit left counted at least as long as the
--                refunding request's own would have been (taking the newest would date later
--                units earlier, and the log could admit more than L within a period).
--                A negative c is a debit (a settlement past the limit): one more member of
--                -c units, as an admission writes it; the log counts at most L of them.
--   A key whose newest score is ahead of now by more than P + L (garbage, or a clock jump back
--   by more than a period), or whose newest or oldest live member does not read as
--   "<start>:<end>" with start < end, is reset.
--
-- Bound per call and key, whatever L and c: at most 6 Redis commands (10 in a refund, which
-- evaluates again after giving back), at most SWL_BATCH members removed (expired ones; again in
-- a refund) and SWL_BATCH + 1 read, one written (bench/bench_script_time.py measures it).

-- The most members one call removes from one key (pruning; again in a refund), and reads to find
-- a retry time. Also in flask_distlimit/engine/sliding_window_log.py: the twin does exactly as much.
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

  -- A member's (start, end), or nil for anything but "<start>:<end>" with start < end < 2^53.
  local function swl_span(member)
    if type(member) ~= 'string' then
      return nil
    end
    local a, b = match(member, '^(%d+):(%d+)$')
    if a == nil then
      return nil
    end
    local s, e = tonumber(a), tonumber(b)
    if s < MAX_EXACT and e < MAX_EXACT and s < e then  -- digits: whole(s) and whole(e) are this
      return s, e
    end
    return nil
  end

  -- When a key whose newest member is dated t may go: a period on, rounded up to a step of an
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

  -- The key's state after pruning: (k, newest score or nil, end(newest) (0 when empty), base,
  -- rank of the oldest live member, repaired 0/1).
  local function swl_read(key, limit, period, now)
    --@read
    local count, newest, last, base, oldest, repaired = 0, nil, 0, 0, 0, 0
    local cut = now - period
    local expired = redis.pcall('ZCOUNT', key, '-inf', cut)
    if failed(expired) then
      redis.call('UNLINK', key)
      repaired = 1
    else
      if expired > 0 then
        local drop = expired
        if drop > SWL_BATCH then
          drop = SWL_BATCH
        end
        redis.call('ZREMRANGEBYRANK', key, 0, drop - 1)
        expired = expired - drop
      end
      local top = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
      if top[1] ~= nil then
        local score = tonumber(top[2])
        local _, top_end = swl_span(top[1])
        if not (top_end and whole(score) and score <= now + period + limit) then
          redis.call('UNLINK', key)
          repaired = 1
        elseif score <= cut then  -- nothing live, only expired members still to remove: afresh
          redis.call('UNLINK', key)
        else
          local start, first_end = swl_span(redis.call('ZRANGE', key, expired, expired)[1])
          if not (start and first_end <= top_end) then
            redis.call('UNLINK', key)
            repaired = 1
          else
            if top_end - start > limit then
              start = top_end - limit
            end
            count, newest, last, base, oldest = top_end - start, score, top_end, start, expired
          end
        end
      end
    end
    --@end
    return count, newest, last, base, oldest, repaired
  end

  function SLIDING_WINDOW_LOG.decide(key, limit, period, cost, now)
    local count, newest, last, base, oldest, repaired = swl_read(key, limit, period, now)
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
      -- when the oldest live member whose end reaches the goal expires, looked for among the
      -- SWL_BATCH oldest live members (from rank `oldest`); if they do not reach the goal, when
      -- the last of them expires: no earlier can the request pass. Ends grow with rank; a member
      -- that does not read ends the search.
      local goal = base + count + cost - limit
      local block = redis.call('ZRANGE', key, oldest, oldest + SWL_BATCH - 1, 'WITHSCORES')
      local score
      for i = 1, #block, 2 do
        score = tonumber(block[i + 1])
        local _, e = swl_span(block[i])
        if e == nil or e >= goal then
          break
        end
      end
      retry = score + period - now
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
    redis.call('ZADD', key, first, string.format('%d:%d', last, last + cost))
    if renew > 0 then
      expire_in(key, renew)
    end
    --@end
  end

  -- Refund: reads the newest member and the SWL_BATCH + 1 oldest live ones (no pruning: the
  -- evaluation that follows in the same call prunes). The newest member stays: so does the TTL.
  -- A rollback (a Cluster refund of a request another group refused) takes the request's own
  -- member instead while it is the newest, as it almost always is: nothing stays charged.
  function SLIDING_WINDOW_LOG.refund(key, limit, period, cost, now, rollback)
    local top = redis.pcall('ZRANGE', key, -1, -1, 'WITHSCORES')
    if failed(top) then
      redis.call('UNLINK', key)
      return 1
    end
    local newest, last, repaired, top_start = nil, 0, 0, nil
    if #top > 0 then
      local top_s, top_e = swl_span(top[1])
      top_start, newest, last = top_s, tonumber(top[2]), top_e
      if not (last and whole(newest) and newest <= now + period + limit) then
        redis.call('UNLINK', key)
        if cost >= 0 then
          return 1
        end
        newest, last, repaired = nil, 0, 1
      end
    end
    if cost < 0 then  -- a debit: one more member of -c units, dated as an admission is
      local first = now
      if newest and newest >= now then
        first = newest + 1
      end
      redis.call('ZADD', key, first, string.format('%d:%d', last, last - cost))
      expire_in(key, swl_until(first, period) - now)
      return repaired
    end
    local cut = now - period
    if newest == nil or newest <= cut or cost == 0 then  -- nothing live, or nothing to give
      return 0
    end
    if rollback and top_start == last - cost then
      redis.call('ZREM', key, top[1])
      return 0
    end
    local live = redis.call('ZCOUNT', key, '-inf', cut)  -- the oldest live member's rank
    local block = redis.call('ZRANGE', key, live, live + SWL_BATCH, 'WITHSCORES')
    local start = swl_span(block[1])
    if start == nil then
      redis.call('UNLINK', key)
      return 1
    end
    if start < last - limit then  -- only the newest L units count
      start = last - limit
    end
    local target = start + cost
    if target >= last then  -- every unit counted goes back
      redis.call('UNLINK', key)
      return 0
    end
    -- the lowest member holding a unit above target (ends grow with rank): those below it go
    local r = 1
    while r <= SWL_BATCH do
      local _, e = swl_span(block[2 * r - 1])
      if e == nil or e > target then
        break
      end
      r = r + 1
    end
    if r > 1 then
      redis.call('ZREMRANGEBYRANK', key, live, live + r - 2)
    end
    local member = block[2 * r - 1]
    local s, e = swl_span(member)
    if s and s < target and target < e then
      -- the new member first: the key never empties, so its TTL stays
      redis.call('ZADD', key, block[2 * r], string.format('%d:%d', target, e))
      redis.call('ZREM', key, member)
    end
    return 0
  end
  return SLIDING_WINDOW_LOG
end
