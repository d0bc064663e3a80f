-- FAST PATHS: the commonest request, ONE check of an algorithm whose file marks its --@read,
-- --@decide and --@commit regions (every rate algorithm: not concurrency), enforced or shadow,
-- evaluated (not a refund or a release), is decided here, inline, after common.lua's constants
-- and before any function is built: every function in the script is a closure made again on
-- every call, and building them was a sixth of the script's time (docs/bench/engine.md, "The
-- script's own time"). So are several such checks (below).
--
-- GENERATED at import by flask_distlimit/engine/lua_source.py, never kept by hand: each line
-- `--@<section>` below becomes the text after `--@@ <section> @@--` (at the end of this file)
-- once per such algorithm, with its file's regions in place of `--@setup`, `--@read`, `--@decide`,
-- `--@result`, `--@restore` and `--@commit` (the very text of its general functions; a region a
-- file lacks is left out), `@code` its code and `@shadowed` its code plus 16 (a shadow check's):
-- so `--@one` and `--@deciding` are chains of `elseif code == <code> then <branch>`. (One check's
-- code is compared as the text it came as: no number to make.) So the fast paths decide, store,
-- expire and call Redis exactly as the general path does; tests/engine/test_script_fastpath.py
-- runs every case on both paths and compares.
--
-- The regions' contract: they read key, limit, period, cost and now (and what `--@setup` defines);
-- `--@read` sets repaired (0/1); `--@decide` sets allowed (a boolean), retry (us, -1 = never),
-- left and reset (remaining and reset_after with the request counted) and left_now and reset_now
-- (as the key stands); `--@result` sets r (as the general decide returns it), `--@restore` reads
-- it back; `--@commit` writes the request (run only when allowed and cost > 0).
--
-- Only an argument of six plain decimal integers, mode 0, an algorithm with a branch (plus 16 for
-- a shadow check), limit and period >= 1, every number exact (below 2^53) and a rate of at most
-- one unit per 2 us (2 * limit <= period: so now / (period / limit) < 2^52, and the driver's
-- refusal of a faster GCRA rate never applies) is decided here; anything else falls through,
-- untouched, to the general path (which decides it, or refuses it with its message).
if #KEYS == 1 and #ARGV == 1 then
  local now_s, code_s, limit_s, period_s, cost_s = string.match(ARGV[1],
    '^(%-?%d+),0,(%d+),([1-9]%d*),([1-9]%d*),(%d+)$')
  local now, limit, period, cost
  if now_s then
    now, limit, period, cost = tonumber(now_s), tonumber(limit_s), tonumber(period_s),
      tonumber(cost_s)
  end
  if now_s and (now == -1 or now >= 0 and now < MAX_EXACT) and limit < MAX_EXACT
      and period < MAX_EXACT and cost < MAX_EXACT and 2 * limit <= period then
    local key = KEYS[1]
    if false then  -- (a chain of elseif: one branch per algorithm)
    --@one
    end
  end
end
-- SEVERAL CHECKS, all of those algorithms (enforced or shadow, evaluated), of an argument of
-- plain integers: the driver's two phases (lua/evaluate.lua) on the same regions, inline, without
-- loaders, closures or a table per check but its r. The argument is read as the driver reads it
-- (cjson) and left in `parsed, args` for the driver, which reads it only if this did not. Every
-- check is checked before any is read (anything else goes on, untouched, to the general path);
-- then each is read and decided (`--@result` makes its r as its general decide returns it); then,
-- only when no check but a shadow one would deny, each allowed check of cost > 0 is written, in
-- order (`--@restore` takes back from r what `--@commit` reads). The reply is the general path's.
local parsed, args
if #KEYS >= 2 and #ARGV == 1 then
  local n = #KEYS
  parsed, args = pcall(cjson.decode, '[' .. ARGV[1] .. ']')
  local several = parsed and type(args) == 'table' and #args == 2 + 4 * n and args[2] == 0
  for i = 1, n do  -- `==` compares values of any type: another algorithm goes on at once
    if not several then
      break
    end
    local code = args[4 * i - 1]
    several = false
      --@known
  end
  -- only digits, commas and minus signs: cjson read integers, as tonumber would
  if several and string.find(ARGV[1], '^[%d,%-]*$') then
    local now = args[1]
    several = now == -1 or now >= 0 and now < MAX_EXACT
    for i = 1, n do  -- whole(x) is x >= 0 and x < MAX_EXACT for such an integer
      local limit, period, cost = args[4 * i], args[4 * i + 1], args[4 * i + 2]
      if not (limit >= 1 and limit < MAX_EXACT and period >= 1 and period < MAX_EXACT
          and cost >= 0 and cost < MAX_EXACT and 2 * limit <= period) then
        several = false
      end
    end
    if several then
      if now == -1 then
        local time = redis.call('TIME')
        now = tonumber(time[1]) * 1000000 + tonumber(time[2])
      end
      --@setups
      local held, all = {}, true
      for i = 1, n do
        local code, limit, period, cost = args[4 * i - 1], args[4 * i], args[4 * i + 1],
          args[4 * i + 2]
        local key, shadow = KEYS[i], code > 16
        if shadow then
          code = code - 16
        end
        if false then
        --@deciding
        end
        local r = held[i]
        if r[1] == 0 then
          if shadow then
            r[1] = 2  -- would deny: reported, never refuses, not written
          else
            all = false
          end
        end
      end
      if all then
        for i = 1, n do
          local code, limit, period, cost = args[4 * i - 1], args[4 * i], args[4 * i + 1],
            args[4 * i + 2]
          local key, r = KEYS[i], held[i]
          if code > 16 then
            code = code - 16
          end
          if cost > 0 and r[1] == 1 then
            if false then
            --@committing
            end
          end
        end
      end
      -- a denied request, and a shadow check that would deny, report the keys as they stand
      local reply = {string.format('%d', now)}
      for i = 1, n do
        local r, left, reset = held[i], 2, 3
        if not all or r[1] == 2 then
          left, reset = 6, 7
        end
        reply[i + 1] = string.format('%d,%d,%d,%d,%d,%d', r[1], args[4 * i], r[left], r[reset],
          r[4], r[5])
      end
      return table.concat(reply, ',')
    end
  end
end
--@@ one @@--
elseif code_s == '@code' or code_s == '@shadowed' then
  local shadow = code_s == '@shadowed'
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
--@@ known @@--
or code == @code or code == @shadowed
--@@ setups @@--
--@setup
--@@ deciding @@--
elseif code == @code then
  --@read
  --@decide
  --@result
  held[i] = r
--@@ committing @@--
elseif code == @code then
  --@restore
  --@commit
