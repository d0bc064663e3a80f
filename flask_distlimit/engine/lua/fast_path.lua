-- FAST PATH: the commonest request, ONE check of an algorithm whose file marks its --@read,
-- --@decide and --@commit regions (fixed window, sliding window log, sliding window counter),
-- enforced or shadow, evaluated (not a refund or a release), is decided here, inline, after
-- common.lua's constants and before any function is built: every function in the script is a
-- closure made again on every call, and building them was a sixth of the script's time
-- (docs/bench/engine.md, "The script's own time").
--
-- GENERATED at import by flask_distlimit/engine/lua_source.py, never kept by hand: the line
-- `--@branches` becomes one branch per such algorithm, `if code_s == '<code>' or code_s ==
-- '<code + 16>' then local shadow = code_s == '<code + 16>' <branch> elseif ... end` (the code
-- compared as the text it came as: no number to make), each <branch> the template after
-- `--@branch` below with its file's regions in place of `--@setup`, `--@read`, `--@decide` and
-- `--@commit` (the very text of its general functions; a region a file lacks is left out). So
-- the fast path decides, stores, expires and calls Redis exactly as the general path does;
-- tests/engine/test_script_fastpath.py runs every case on both paths and compares.
--
-- The regions' contract: they read key, limit, period, cost and now (and what `--@setup` defines);
-- `--@read` sets repaired (0/1); `--@decide` sets allowed (a boolean), retry (us, -1 = never),
-- left and reset (remaining and reset_after with the request counted) and left_now and reset_now
-- (as the key stands); `--@commit` writes the request (run only when allowed and cost > 0).
--
-- Only an argument of six plain decimal integers, mode 0, an algorithm with a branch (plus 16 for
-- a shadow check), limit and period >= 1 and every number exact (below 2^53) is decided here;
-- anything else falls through, untouched, to the general path (which decides it, or refuses it
-- with its message).
if #KEYS == 1 and #ARGV == 1 then
  local now_s, code_s, limit_s, period_s, cost_s = string.match(ARGV[1],
    '^(%-?%d+),0,(%d+),([1-9]%d*),([1-9]%d*),(%d+)$')
  local now, limit, period, cost
  if now_s then
    now, limit, period, cost = tonumber(now_s), tonumber(limit_s), tonumber(period_s),
      tonumber(cost_s)
  end
  if now_s and (now == -1 or now >= 0 and now < MAX_EXACT) and limit < MAX_EXACT
      and period < MAX_EXACT and cost < MAX_EXACT then
    local key = KEYS[1]
    --@branches
  end
end
--@branch
if now == -1 then
  local time = redis.call('TIME')
  now = tonumber(time[1]) * 1000000 + tonumber(time[2])
end
--@setup
--@read
--@decide
if allowed and cost > 0 then
  --@commit
end
-- allowed and repaired as strings, the limit as it came: each number formatted costs
local state = '1'
if not allowed then  -- denied, or a shadow check that would deny: as it stands, nothing written
  state, left, reset = '0', left_now, reset_now
  if shadow then
    state = '2'
  end
end
return string.format('%d,%s,%s,%d,%d,%d,%s', now, state, limit_s, left, reset, retry,
  repaired == 1 and '1' or '0')
