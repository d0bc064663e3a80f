"""The shared value of a deployment (``Storage.shared_value``): one small Lua script.

Atomically, in one round trip, it stores the value when the key is absent, sets the key's lifetime
(``0``: none, so no ``volatile-*`` policy evicts it) and answers the value stored. A read needs no
memory, so a full Redis still answers it; a key of another type is replaced; only commands of
:data:`~flask_distlimit.storage.translate.ACL_GRANTS`. Design: docs/design-notes.md, "The shared
value".
"""

from __future__ import annotations

from typing import Final

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
