"""The instance heartbeat: one small Lua script on the Redis server's clock.

Atomically it records this process, drops expired members and fleet sizes, and answers the live
count and the largest size reported within the TTL (:func:`peak_key`, same slot); garbage is
replaced and reported as repaired; only the ACL's commands are used. KEYS and ARGV:
docs/design-notes.md, "The heartbeat script".
"""

from __future__ import annotations

from typing import Final, NamedTuple

from flask_distlimit.engine.lua_source import lua_text
from flask_distlimit.errors import StorageResponseError
from flask_distlimit.storage.slot_keys import same_slot_key

#: The largest fleet size a heartbeat accepts (``DISTLIMIT_INSTANCES`` accepts as much).
MAX_FLEET: Final = 100_000

HEARTBEAT_SOURCE: Final = lua_text(__package__, "replace_key.lua", "heartbeat.lua")


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
    """The script's reply as a :class:`Fleet` (``key`` is its ``KEYS[1]``), or
    :class:`StorageResponseError` for a reply of another shape."""
    if not isinstance(reply, list | tuple) or [type(x) for x in reply] != [int] * 4:
        raise StorageResponseError(f"unexpected heartbeat reply {reply!r}")
    live, largest, repaired_live, repaired_peak = reply
    repaired = (key,) * bool(repaired_live) + (peak_key(key),) * bool(repaired_peak)
    return Fleet(live, max(live, largest), repaired)
