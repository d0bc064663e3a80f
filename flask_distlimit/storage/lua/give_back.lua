-- give back: read by flask_distlimit/storage/give_back.py as GIVE_BACK_SOURCE, which fills in
-- the algorithms' hash fields and how long a give-back's id is kept (ms)
local FIELDS = {FIELDS}
local code, period = tonumber(ARGV[1]), tonumber(ARGV[2])
local window, units, now = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local field = code and FIELDS[code]
if not field or not period or period < 1 or not window or not units
    or units < 1 or not now then
  return redis.error_reply('ERR distlimit: bad give-back arguments')
end
local id = KEYS[2]
if id then
  local kept = redis.pcall('GET', id)
  if type(kept) == 'string' then
    return tonumber(kept) or 0  -- made again: what the first try gave back, nothing more
  elseif type(kept) == 'table' and kept.err then
    redis.call('DEL', id)  -- not ours (another type): the first try did not run
  end
end
local function give()
  if now == -1 then
    local t = redis.call('TIME')
    now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  end
  if math.floor(now / period) ~= window then
    return 0  -- the window is over (or, on a clock behind, not begun): the units stay counted
  end
  local raw = redis.pcall('HMGET', KEYS[1], 'w', field)
  if type(raw) ~= 'table' or raw.err then
    return 0
  end
  local w, n = tonumber(raw[1]), tonumber(raw[2])
  if w ~= window or not n or n ~= math.floor(n) or n < 1 then
    return 0
  end
  local taken = math.min(units, n)
  redis.call('HSET', KEYS[1], field, n - taken)
  return taken
end
local taken = give()
if id then
  redis.call('SET', id, taken, 'PX', math.min(math.ceil(period / 1000), ID_KEPT_MS))
end
return taken
