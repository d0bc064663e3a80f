"""The leases each process holds, published where ``flask distlimit inspect`` reads them.

One Lua script on the server's clock, on two keys of one Cluster slot: publish stores a process's
record and drops the expired ones; read answers the live records (at most 1,000), writing nothing.
Garbage is replaced on publish, read as none; a record not ours is skipped
(:func:`records_from_reply`). KEYS and ARGV: docs/design-notes.md, "Lease records".
"""

from __future__ import annotations

from typing import Final, NamedTuple

from flask_distlimit.engine.lua_source import lua_text
from flask_distlimit.errors import StorageResponseError
from flask_distlimit.storage.slot_keys import same_slot_key

LEASE_RECORDS_SOURCE: Final = lua_text(__package__, "replace_key.lua", "lease_records.lua")


def records_key(key: str) -> str:
    """The hash of the records beside the sorted set ``key``, in its Redis Cluster slot:
    ``<key>:records:{<key>}`` (Redis hashes ``<key>`` for both when ``key`` has no braces),
    ``<key>:records`` when ``key`` has a hash tag of its own."""
    return same_slot_key(key, "records", "lease records")


class Record(NamedTuple):
    """One process's published record, as read."""

    process: str
    age: float  #: seconds since it was published (the storage's clock)
    text: str  #: the record as published (JSON: :mod:`flask_distlimit.resilience.holdings`)


def _text(value: object) -> str | None:
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return None
    return value if isinstance(value, str) else None


def records_from_reply(reply: object) -> list[Record]:
    """The read reply as records; a value that is not ``<ms>:<text>`` is skipped."""
    if not isinstance(reply, list | tuple):
        return []
    now_ms = int(reply[0])  # the script's TIME, first in each of its replies
    records: list[Record] = []
    for i in range(1, len(reply) - 1, 2):
        process, value = _text(reply[i]), _text(reply[i + 1])
        stamp, sep, text = (value or "").partition(":")
        if process is not None and sep and stamp.isdigit():
            records.append(Record(process, max(0, now_ms - int(stamp)) / 1000, text))
    return records


def repaired_from_reply(reply: object, key: str) -> tuple[str, ...]:
    """The keys a publication replaced (``{repaired key, repaired records}`` flags), or
    :class:`StorageResponseError` for a reply of another shape."""
    if not isinstance(reply, list | tuple) or len(reply) != 2:
        raise StorageResponseError(f"unexpected lease records reply {reply!r}")
    return tuple(k for k, flag in zip((key, records_key(key)), reply, strict=True) if flag == 1)
