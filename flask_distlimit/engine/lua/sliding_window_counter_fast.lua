-- FAST PATH: ONE sliding-window-counter check, enforced or shadow, evaluated (not a refund or a
-- release), decided inline before any helper or algorithm function is built, like
-- fixed_window_fast.lua (concatenated first; the reasons are there). It is
-- sliding_window_counter.lua's swc_read, swc_fits, swc_left, swc_reset, decide and commit and
-- evaluate.lua's checks and reply written out in one piece, for exactly the same result, stored
-- state, TTL and Redis commands (the same double expressions, in the same order);
-- tests/test_script_fastpath.py runs every case on both paths and compares.
--
-- Only an argument of six plain decimal integers, mode 0, algorithm 3 or 19, limit and period
-- >= 1 and every number exact (below 2^53) is decided here; anything else falls through,
-- untouched, to the general path (which decides it, or refuses it with its message).
if #KEYS == 1 and #ARGV == 1 then
  local now_s, code_s, limit_s, period_s, cost_s = string.match(ARGV[1],
    '^(%-?%d+),0,(1?[39]),([1-9]%d*),([1-9]%d*),(%d+)$')
  local exact = 9007199254740992
  local now, limit, period, cost
  if now_s and (code_s == '3' or code_s == '19') then
    now, limit, period, cost = tonumber(now_s), tonumber(limit_s), tonumber(period_s),
      tonumber(cost_s)
  end
  if now and (now == -1 or now >= 0 and now < exact) and limit < exact and period < exact
      and cost < exact then
    local floor, ceil, key = math.floor, math.ceil, KEYS[1]
    if now == -1 then
      local time = redis.call('TIME')
      now = tonumber(time[1]) * 1000000 + tonumber(time[2])
    end
    -- read: the stored window and counts, shifted to the current window; a stored window ahead
    -- of the clock kept, and time clamped to its start
    local window, t, cur, prev, current, repaired = floor(now / period), now, 0, 0, false, '0'
    local raw = redis.pcall('HMGET', key, 'w', 'c', 'p')
    if raw.err then
      repaired = '1'
      redis.call('DEL', key)
    elseif raw[1] or raw[2] or raw[3] then
      local w, c, p = tonumber(raw[1]), tonumber(raw[2]), tonumber(raw[3])
      -- whole(w), whole(c) and whole(p) (common.lua), written out
      if w and c and p and w == w and c == c and p == p and w >= 0 and w < exact
          and w == floor(w) and c >= 0 and c < exact and c == floor(c) and p >= 0
          and p < exact and p == floor(p) and w * period <= now + period then
        if w > window then
          window, t, cur, prev, current = w, w * period, c, p, true
        elseif w == window then
          cur, prev, current = c, p, true
        elseif w == window - 1 then
          prev = c
        end
      else
        repaired = '1'
        redis.call('DEL', key)
      end
    end
    -- decide (swc_fits written out: (prev * (period - elapsed)) / period + (cur + cost))
    local elapsed = t - window * period
    local shift = t - now
    local weighted = (prev * (period - elapsed)) / period
    local state, after, retry = '1', cur, 0
    if cost <= limit and weighted + (cur + cost) <= limit then
      after = cur + cost
      if cost > 0 then  -- commit
        if current then  -- the stored window: w and p stand, and so does the TTL
          redis.call('HSET', key, 'c', after)
        else
          redis.call('HSET', key, 'w', window, 'c', after, 'p', prev)
          local us = (window + 2) * period - now
          if us > 0 then
            redis.call('PEXPIRE', key, floor((us + 1999) / 1000))
          else
            redis.call('DEL', key)
          end
        end
      end
    else
      state = '0'
      if code_s == '19' then
        state = '2'  -- a shadow check that would deny: reported, never refuses, not written
      end
      if cost > limit then
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
    end
    -- swc_left and swc_reset of what the window holds now (a denial wrote nothing: after = cur)
    local left = floor(limit - (weighted + after))
    if left < 0 then
      left = 0
    end
    local reset = 0
    if after > 0 then
      reset = shift + 2 * period - elapsed
    elseif prev > 0 then
      reset = shift + period - elapsed
    end
    return string.format('%d,%s,%d,%d,%d,%d,%s', now, state, limit, left, reset, retry,
      repaired)
  end
end
