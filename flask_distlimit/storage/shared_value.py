"""The shared value of a deployment: one small Lua script (``Storage.shared_value``).

``KEYS[1]`` is the key, ``ARGV[1]`` the value to store when the key is absent, ``ARGV[2]`` its
time to live in seconds, ``0`` for none: the key then never expires, and a TTL it had is removed
(``PERSIST``), so that ``volatile-*`` eviction policies never evict it either. The script sets
the value only if the key is absent, sets the key's lifetime and answers the value stored,
atomically, in one round trip. Reading a value that is there writes nothing that needs memory
(``PERSIST`` and ``PEXPIRE`` are allowed under ``maxmemory``), so a full Redis still answers it.
A key of another type is ours and garbage: it is replaced, as the limit keys are repaired. Only
commands of :data:`~flask_distlimit.storage.translate.ACL_GRANTS` are used.
"""

from __future__ import annotations

from typing import Final

__all__ = ["SHARED_VALUE_SOURCE"]

SHARED_VALUE_SOURCE: Final = """
local ok, value = pcall(redis.call, 'GET', KEYS[1])
if not ok then
  redis.call('UNLINK', KEYS[1])
  value = false
end
if not value then
  redis.call('SET', KEYS[1], ARGV[1])
  value = ARGV[1]
end
local ttl = tonumber(ARGV[2])  -- seconds; 0: never expires
if ttl > 0 then
  redis.call('PEXPIRE', KEYS[1], ttl * 1000)
else
  redis.call('PERSIST', KEYS[1])
end
return value
"""
