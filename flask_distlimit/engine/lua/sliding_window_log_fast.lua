-- FAST PATH: ONE sliding-window-log check, enforced or shadow, evaluated (not a refund or a
-- release), decided inline before any helper or algorithm function is built, like
-- fixed_window_fast.lua (concatenated just before this file; the reasons are there). It is
-- sliding_window_log.lua's swl_span, swl_read, swl_retry, decide and commit and evaluate.lua's
-- checks and reply written out in one piece, for exactly the same result, stored state, TTL and
-- Redis commands; tests/test_script_fastpath.py runs every case on both paths and compares.
--
-- Only an argument of six plain decimal integers, mode 0, algorithm 2 or 18, limit and period
-- >= 1 and every number exact (below 2^53) is decided here; anything else falls through,
-- untouched, to the general path (which decides it, or refuses it with its message).
if #KEYS == 1 and #ARGV == 1 then
  local now_s, code_s, limit_s, period_s, cost_s = string.match(ARGV[1],
    '^(%-?%d+),0,(1?[28]),([1-9]%d*),([1-9]%d*),(%d+)$')
  local exact = 9007199254740992
  local now, limit, period, cost
  if now_s and (code_s == '2' or code_s == '18') then
    now, limit, period, cost = tonumber(now_s), tonumber(limit_s), tonumber(period_s),
      tonumber(cost_s)
  end
  if now and (now == -1 or now >= 0 and now < exact) and limit < exact and period < exact
      and cost < exact then
    local floor, match, key = math.floor, string.match, KEYS[1]
    local batch = 4  -- SWL_BATCH of sliding_window_log.lua (a test keeps them equal)
    if now == -1 then
      local time = redis.call('TIME')
      now = tonumber(time[1]) * 1000000 + tonumber(time[2])
    end

    -- swl_span: a member's (start, end), or nil unless "<start>:<end>" with start < end < 2^53
    local function span(member)
      if type(member) ~= 'string' then
        return nil
      end
      local a, b = match(member, '^(%d+):(%d+)$')
      if a == nil then
        return nil
      end
      local s, e = tonumber(a), tonumber(b)
      if s < exact and e < exact and s < e then  -- digits only: whole(s), whole(e) is this
        return s, e
      end
      return nil
    end

    -- swl_read: (k, newest score or nil, end(newest), base, rank of the oldest live, repaired)
    local count, newest, last, base, oldest, repaired = 0, nil, 0, 0, 0, '0'
    local cut = now - period
    local expired = redis.pcall('ZCOUNT', key, '-inf', cut)
    if type(expired) == 'table' and expired.err ~= nil then
      redis.call('UNLINK', key)
      repaired = '1'
    else
      if expired > 0 then
        local drop = expired
        if drop > batch then
          drop = batch
        end
        redis.call('ZREMRANGEBYRANK', key, 0, drop - 1)
        expired = expired - drop
      end
      local top = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
      if top[1] ~= nil then
        local score = tonumber(top[2])
        local _, top_end = span(top[1])
        if not (top_end and score ~= nil and score == score and score >= 0 and score < exact
            and score == floor(score) and score <= now + period + limit) then
          redis.call('UNLINK', key)
          repaired = '1'
        elseif score <= cut then  -- nothing live, only expired members still to remove
          redis.call('UNLINK', key)
        else
          local start, first_end = span(redis.call('ZRANGE', key, expired, expired)[1])
          if not (start and first_end <= top_end) then
            redis.call('UNLINK', key)
            repaired = '1'
          else
            if top_end - start > limit then
              start = top_end - limit
            end
            count, newest, last, base, oldest = top_end - start, score, top_end, start, expired
          end
        end
      end
    end

    -- decide, and commit when allowed; a denial reports the log as it stands
    local first = now
    if newest and newest >= now then
      first = newest + 1
    end
    local state, shown, retry, reset = '1', count, 0, 0
    if cost <= limit and count + cost <= limit then
      if cost > 0 then
        shown = count + cost
        redis.call('ZADD', key, first, string.format('%d:%d', last, last + cost))
        if first + period - now > 0 then
          redis.call('PEXPIRE', key, floor((first + period - now + 1999) / 1000))
        else
          redis.call('DEL', key)
        end
        reset = first + period - now
      elseif count > 0 then
        reset = newest + period - now
      end
    else
      state = '0'
      if code_s == '18' then
        state = '2'  -- a shadow check that would deny: reported, never refuses, not written
      end
      if cost > limit then
        retry = -1
      else
        -- swl_retry: when the oldest live member whose end reaches the goal expires, looked for
        -- among the `batch` oldest live; if they fall short, when the last of them expires
        local goal = base + count + cost - limit
        local block = redis.call('ZRANGE', key, oldest, oldest + batch - 1, 'WITHSCORES')
        local score
        for i = 1, #block, 2 do
          score = tonumber(block[i + 1])
          local _, e = span(block[i])
          if e == nil or e >= goal then
            break
          end
        end
        retry = score + period - now
      end
      if count > 0 then
        reset = newest + period - now
      end
    end
    return string.format('%d,%s,%s,%d,%d,%d,%s', now, state, limit_s, limit - shown, reset,
      retry, repaired)
  end
end
