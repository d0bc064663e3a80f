"""The instance heartbeat: one small Lua script on the Redis server's clock.

Atomically it records this process, drops expired members and fleet sizes, and answers the live
count and the largest size reported within the TTL (:func:`peak_key`, same slot); garbage is
replaced and reported as repaired; only the ACL's commands are used. KEYS and ARGV:
docs/design-notes.md, "The heartbeat script".
"""

from __future__ import annotations

from typing import Final, NamedTuple

from flask_distlimit.storage.slot_keys import same_slot_key

#: The largest fleet size a heartbeat accepts (``DISTLIMIT_INSTANCES`` accepts as much).
MAX_FLEET: Final = 100_000

HEARTBEAT_SOURCE: Final = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl_ms = tonumber(ARGV[2])
local known = tonumber(ARGV[3])
local until_ms = now_ms + ttl_ms

-- ZADD, replacing a key of another type (reported: 1); any other error is raised as it is.
local function zadd(key, score, member)
  local reply = redis.pcall('ZADD', key, score, member)
  if type(reply) ~= 'table' or not reply.err then
    return 0
  end
  if string.sub(reply.err, 1, 9) ~= 'WRONGTYPE' then
    redis.call('ZADD', key, score, member)  -- fails the same way: raises the error as it is
    return 0
  end
  redis.call('DEL', key)
  redis.call('ZADD', key, score, member)
  return 1
end

local repaired_live = zadd(KEYS[1], until_ms, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms)
redis.call('PEXPIRE', KEYS[1], ttl_ms)
local live = redis.call('ZCARD', KEYS[1])

local report = math.max(live, known)
local repaired_peak = zadd(KEYS[2], until_ms, tostring(report))
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now_ms)
local largest = report
for _, member in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  local size = tonumber(member)
  if size == nil or size ~= math.floor(size) or size < 1 or size > 100000 then
    repaired_peak = 1
    largest = report
    redis.call('DEL', KEYS[2])
    redis.call('ZADD', KEYS[2], until_ms, tostring(report))
    break
  end
  largest = math.max(largest, size)
end
redis.call('PEXPIRE', KEYS[2], ttl_ms)
return {live, largest, repaired_live, repaired_peak}
"""


class Fleet(NamedTuple):
    """What one heartbeat learnt."""

    live: int  #: processes with a live heartbeat now, this one included
    largest: int  #: the largest fleet size reported within the TTL (at least ``live``)
    repaired_keys: tuple[str, ...] = ()  #: keys that held garbage and were replaced


def peak_key(key: str) -> str:
    """The key of the fleet sizes reported beside the heartbeat ``key``, in its Redis Cluster
    slot: ``<key>:peak`` when ``key`` has a hash tag, else ``<key>:peak:{<key>}`` (Redis then
    hashes ``<key>`` for both), e.g. ``ratelimit:instances:peak:{ratelimit:instances}``."""
    return same_slot_key(key, "peak", "heartbeat")


def fleet_from_reply(reply: object, key: str) -> Fleet:
    """The script's reply as a :class:`Fleet` (``key`` is its ``KEYS[1]``)."""
    if not isinstance(reply, list | tuple) or len(reply) != 4:
        raise ValueError(f"unexpected heartbeat reply {reply!r}")
    live, largest, repaired_live, repaired_peak = (int(x) for x in reply)
    repaired = (key,) * bool(repaired_live) + (peak_key(key),) * bool(repaired_peak)
    return Fleet(live, max(live, largest), repaired)
