-- FAST PATH: the commonest request, ONE fixed-window check, enforced or shadow, evaluated (not a
-- refund or a release). This file is concatenated FIRST: such a request is decided here, inline,
-- before any helper or algorithm function is built (every function is a closure made again on
-- every call, and building them was a sixth of the script's time: docs/bench/engine.md, "The
-- script's own time"). It is fixed_window.lua's read, decide and commit and evaluate.lua's checks
-- and reply written out in one piece, for exactly the same result, stored state, TTL and Redis
-- commands; tests/test_script_fastpath.py runs every case on both paths and compares.
--
-- Only an argument of six plain decimal integers, mode 0, algorithm 1 or 17, limit and period
-- >= 1 and every number exact (below 2^53) is decided here; anything else falls through,
-- untouched, to the general path (which decides it, or refuses it with its message).
if #KEYS == 1 and #ARGV == 1 then
  local now_s, code_s, limit_s, period_s, cost_s = string.match(ARGV[1],
    '^(%-?%d+),0,(1[7]?),([1-9]%d*),([1-9]%d*),(%d+)$')
  local exact = 9007199254740992
  local now, limit, period, cost
  if now_s then
    now, limit, period, cost = tonumber(now_s), tonumber(limit_s), tonumber(period_s),
      tonumber(cost_s)
  end
  if now_s and (now == -1 or now >= 0 and now < exact) and limit < exact and period < exact
      and cost < exact then
    local floor, key = math.floor, KEYS[1]
    if now == -1 then
      local time = redis.call('TIME')
      now = tonumber(time[1]) * 1000000 + tonumber(time[2])
    end
    -- read: the stored window and count, a stored window ahead of the clock kept
    local window, count, repaired, kept = floor(now / period), 0, '0', false
    local raw = redis.pcall('HMGET', key, 'w', 'n')
    if raw.err then
      repaired = '1'
      redis.call('DEL', key)
    elseif raw[1] or raw[2] then
      local w, n = tonumber(raw[1]), tonumber(raw[2])
      -- whole(w) and whole(n) (common.lua), written out
      if w and n and w >= 0 and w < exact and w == floor(w) and n >= 0 and n < exact
          and n == floor(n) and w * period <= now + period then
        if w >= window then
          window, count, kept = w, n, true
        end
      else
        repaired = '1'
        redis.call('DEL', key)
      end
    end
    -- decide, and commit when allowed; a denial reports the window as it stands
    local to_end = (window + 1) * period - now
    local state, shown, retry = '1', count, 0
    if cost <= limit and count + cost <= limit then
      shown = count + cost
      if cost > 0 then
        if kept then  -- the stored window: w stands, and so does the TTL
          redis.call('HSET', key, 'n', shown)
        else
          redis.call('HSET', key, 'w', window, 'n', shown)
          if to_end > 0 then
            redis.call('PEXPIRE', key, floor((to_end + 1999) / 1000))
          else
            redis.call('DEL', key)
          end
        end
      end
    else
      state = '0'
      if code_s == '17' then
        state = '2'  -- a shadow check that would deny: reported, never refuses, not written
      end
      if cost > limit then
        retry = -1
      else
        retry = to_end
      end
    end
    local left, reset = 0, 0
    if shown < limit then
      left = limit - shown
    end
    if shown > 0 then
      reset = to_end
    end
    return string.format('%d,%s,%s,%d,%d,%d,%s', now, state, limit_s, left, reset, retry,
      repaired)
  end
end
