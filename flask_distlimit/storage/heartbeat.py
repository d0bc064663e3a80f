"""The instance heartbeat: one small Lua script on the Redis server's clock.

``KEYS[1]`` is a sorted set of live instances scored by their expiry (milliseconds, server time).
``ARGV[1]`` the member (one per process), ``ARGV[2]`` its time to live in milliseconds.
The script records the member, drops expired ones, bounds the key's own lifetime and answers
the live count, atomically, in one round trip.
"""

from __future__ import annotations

from typing import Final

__all__ = ["HEARTBEAT_SOURCE"]

HEARTBEAT_SOURCE: Final = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl_ms = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now_ms + ttl_ms, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms)
redis.call('PEXPIRE', KEYS[1], ttl_ms)
return redis.call('ZCARD', KEYS[1])
"""
