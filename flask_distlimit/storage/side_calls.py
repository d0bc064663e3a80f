"""The Redis storages' calls off the hot path: the small scripts, ``SCRIPT EXISTS`` and ``DEL``.

:class:`RedisSideCalls` makes them for a single node, a Sentinel's master and a Cluster alike,
through a stock redis-py client and its ``Script`` (which reloads on ``NOSCRIPT``): one round trip
each on its keys' node, ``DEL`` in groups one command may delete. It raises only
:class:`~flask_distlimit.errors.StorageError` (:mod:`.translate`).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator
from typing import Any, Final, Protocol, cast

import redis
from redis.cluster import RedisCluster
from redis.commands.core import Script

from flask_distlimit.engine.lua_source import lua_text
from flask_distlimit.engine.scripts import SCRIPT_SOURCE
from flask_distlimit.storage.base import GiveBack, Storage
from flask_distlimit.storage.give_back import GIVE_BACK_SOURCE, give_back_call, given_back
from flask_distlimit.storage.heartbeat import HEARTBEAT_SOURCE, Fleet, fleet_from_reply, peak_key
from flask_distlimit.storage.lease_records import (
    LEASE_RECORDS_SOURCE,
    Record,
    records_from_reply,
    records_key,
    repaired_from_reply,
)
from flask_distlimit.storage.tokens import RequestTokens
from flask_distlimit.storage.translate import REDIS_FAILURES, storage_error, translated

#: ``Storage.shared_value``'s script: docs/design-notes.md, "The shared value".
SHARED_VALUE_SOURCE: Final = lua_text(__package__, "shared_value.lua")
#: Keys per ``DEL`` command.
_DELETE_CHUNK: Final = 500


class ScriptClient(Protocol):
    """What the side calls use of a redis-py client, typed here: redis-py's own annotations of
    these methods differ between the releases the project supports (5.0 types a Cluster's
    ``register_script`` for ``Redis`` only and its replies as ``Awaitable | Any``)."""

    def register_script(self, script: str) -> Script: ...

    def script_exists(self, *shas: str) -> Any: ...

    def delete(self, *names: str) -> int: ...


class SideScripts:
    """The limiter's scripts registered on one redis-py client (no I/O: a ``Script`` only
    hashes its source)."""

    __slots__ = ("client", "give_back", "heartbeat", "lease_records", "limit", "shared_value")

    def __init__(self, client: redis.Redis | RedisCluster) -> None:
        self.client = cast(ScriptClient, client)
        #: the limit script (:mod:`flask_distlimit.engine.scripts`): its ``sha``, and the
        #: Cluster's calls through redis-py's own path
        self.limit = self.client.register_script(SCRIPT_SOURCE)
        self.heartbeat = self.client.register_script(HEARTBEAT_SOURCE)
        self.shared_value = self.client.register_script(SHARED_VALUE_SOURCE)
        self.lease_records = self.client.register_script(LEASE_RECORDS_SOURCE)
        self.give_back = self.client.register_script(GIVE_BACK_SOURCE)


class RedisSideCalls(Storage):
    """The side calls of :class:`~flask_distlimit.storage.base.Storage` on a Redis storage."""

    #: The request tokens of the hot call (docs/design-notes.md, "One retry").
    tokens: RequestTokens

    @abc.abstractmethod
    def _side(self) -> SideScripts:
        """The scripts of the storage's client (connecting it first if need be); raises
        ``StorageError`` when it cannot be had."""

    @abc.abstractmethod
    def _scanned(self) -> list[redis.Redis]:
        """The clients of the nodes whose keys :meth:`scan` lists (a Cluster: every primary)."""

    @property
    def request_tokens(self) -> str:
        """When a hot call carries a request token (``DISTLIMIT_REQUEST_TOKENS``)."""
        return self.tokens.mode

    def scan(self, match: str) -> Iterator[str]:
        try:
            for client in self._scanned():
                for key in client.scan_iter(match=match, count=1000):
                    yield key.decode() if isinstance(key, bytes) else str(key)
        except REDIS_FAILURES as exc:
            raise storage_error(exc) from exc

    def _same_slot(self, keys: list[str]) -> Iterable[list[str]]:
        """``keys`` in groups that one ``DEL`` may delete: this default, one group (a single
        node; a Cluster groups them by slot)."""
        return [keys]

    def heartbeat(self, key: str, member: str, ttl: float) -> int:
        return self.heartbeat_fleet(key, member, ttl).live

    def heartbeat_fleet(self, key: str, member: str, ttl: float, known: int = 0) -> Fleet:
        # both keys in the heartbeat key's slot (peak_key)
        args: list[str | int] = [member, max(1, round(ttl * 1000)), max(0, int(known))]
        return fleet_from_reply(translated(self._side().heartbeat, [key, peak_key(key)], args), key)

    def publish_leases(self, key: str, process: str, record: str, hold: float) -> tuple[str, ...]:
        # both keys in one slot (records_key)
        args: list[str | int] = [process, record, max(1, round(hold * 1000))]
        reply = translated(self._side().lease_records, [key, records_key(key)], args)
        return repaired_from_reply(reply, key)

    def lease_records(self, key: str) -> list[Record]:
        reply = translated(self._side().lease_records, [key, records_key(key)], ["", "", 0])
        return records_from_reply(reply)

    def _give_back(self, back: GiveBack) -> int:
        return given_back(translated(self._side().give_back, *give_back_call(back)))

    def shared_value(self, key: str, candidate: str, ttl: int) -> str:
        value = translated(self._side().shared_value, [key], [candidate, int(ttl)])
        return value.decode() if isinstance(value, bytes) else str(value)

    def scripts_loaded(self) -> bool:
        """True when the limit script is loaded (on every primary of a Cluster)."""
        side = self._side()
        found = translated(side.client.script_exists, side.limit.sha)
        return bool(found) and all(found)

    def delete(self, keys: Iterable[str]) -> int:
        client = self._side().client
        deleted = 0
        for group in self._same_slot(list(keys)):
            for start in range(0, len(group), _DELETE_CHUNK):
                deleted += int(translated(client.delete, *group[start : start + _DELETE_CHUNK]))
        return deleted
