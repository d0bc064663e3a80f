"""The shared value of a deployment: one small Lua script (``Storage.shared_value``).

``KEYS[1]`` is the key, ``ARGV[1]`` the value to store when the key is absent, ``ARGV[2]`` its
time to live in seconds. The script sets the value only if the key is absent (``SET NX``),
extends the key's lifetime and answers the value stored, atomically, in one round trip.
"""

from __future__ import annotations

from typing import Final

__all__ = ["SHARED_VALUE_SOURCE"]

SHARED_VALUE_SOURCE: Final = """
redis.call('SET', KEYS[1], ARGV[1], 'NX')
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[2]))
return redis.call('GET', KEYS[1])
"""
