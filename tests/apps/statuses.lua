-- wrk: count the answers by status, and those marked X-RateLimit-Degraded; printed by done().
local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  counts = {}
  degraded = 0
end

function response(status, headers, body)
  counts[status] = (counts[status] or 0) + 1
  if headers["X-RateLimit-Degraded"] ~= nil then
    degraded = degraded + 1
  end
end

function done(summary, latency, requests)
  local total = {}
  local marked = 0
  for _, thread in ipairs(threads) do
    for status, n in pairs(thread:get("counts")) do
      total[status] = (total[status] or 0) + n
    end
    marked = marked + thread:get("degraded")
  end
  for status, n in pairs(total) do
    io.write(string.format("status %d %d\n", status, n))
  end
  io.write(string.format("degraded %d\n", marked))
  io.write(string.format("errors %d %d %d %d\n", summary.errors.connect, summary.errors.read,
    summary.errors.write, summary.errors.timeout))
end
