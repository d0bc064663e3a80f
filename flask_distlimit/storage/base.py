"""The storage interface every backend implements.

A backend evaluates all the checks of one request atomically in one round trip (one per Cluster
slot group), raises only the project's storage errors (never a library's), and names the node
each call goes to, so that the guard keeps one breaker per node. Design: docs/design-notes.md,
"The storage interface".
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import ClassVar, NamedTuple

from flask_distlimit.core.decision import Check, Evaluation
from flask_distlimit.errors import StorageError
from flask_distlimit.storage.heartbeat import Fleet
from flask_distlimit.storage.lease_records import Record

_shared_lock = threading.Lock()


class GiveBack(NamedTuple):
    """The arguments of one :meth:`Storage.give_back` call."""

    key: str
    algorithm: str
    period: int  #: seconds
    window: int  #: the window's index (the time in ``period`` since the epoch)
    units: int
    now_us: int | None  #: the time injected (tests only), else ``None``: the store's clock


class Route(NamedTuple):
    """Checks evaluated together, atomically, on one node (:meth:`Storage.route`)."""

    node: str  #: the node's name, as :meth:`Storage.node` gives it
    indexes: list[int]  #: the checks', in the order they were given


class Storage(abc.ABC):
    """A rate-limit store. Instances are thread-safe and cheap to share within a process."""

    #: The URL scheme this backend was built from, e.g. ``"redis"`` or ``"memory"``.
    scheme: str = ""

    @abc.abstractmethod
    def evaluate(self, checks: Sequence[Check], *, now_us: int | None = None) -> Evaluation:
        """Apply every check at once; consume their costs only if all of them allow.

        ``now_us`` injects the current time in microseconds since the epoch, for tests only;
        production leaves it ``None`` and the store uses its own clock (Redis ``TIME``).
        """

    # -- nodes, for one circuit breaker per node (flask_distlimit.resilience.breakers)
    # ---------------------

    #: True when one request's checks may go to several nodes (Redis Cluster): the guard then
    #: routes them with :meth:`route` and calls :meth:`evaluate_parts`, never :meth:`evaluate`.
    routed: ClassVar[bool] = False

    def node(self, refresh: bool = False) -> str:
        """The node this storage's calls go to now, e.g. ``"127.0.0.1:6379"``; no I/O unless
        ``refresh``, which may ask the topology again (Sentinel), within the storage's timeout,
        and never raises. This default, for a store with one node: ``"redis"``."""
        return "redis"

    def nodes(self) -> Collection[str] | None:
        """The nodes the storage's topology lists now (no I/O); ``None`` when unknown."""
        return None

    def route(self, checks: Sequence[Check]) -> list[Route]:
        """The checks in groups, each evaluated atomically on one node, in order of first
        appearance; no I/O. Default: one group on :meth:`node`."""
        return [Route(self.node(), list(range(len(checks))))]

    def evaluate_parts(
        self, parts: Sequence[Sequence[Check]], *, now_us: int | None = None
    ) -> list[Evaluation | StorageError]:
        """Evaluate each part on its own (each atomic, as :meth:`evaluate`; no all-or-nothing
        across parts: the caller gives back with :meth:`refund`); per part, its evaluation or
        the :class:`~flask_distlimit.errors.StorageError` it failed with."""
        results: list[Evaluation | StorageError] = []
        for part in parts:
            try:
                results.append(self.evaluate(part, now_us=now_us))
            except StorageError as exc:
                results.append(exc)
        return results

    def refund(self, checks: Sequence[Check], *, now_us: int | None = None) -> Evaluation:
        """Give back the costs of ``checks`` that an allowed evaluation consumed (the script's
        refund mode). Needed by ``routed`` storages only."""
        raise NotImplementedError(f"{type(self).__name__} cannot give back consumed units")

    @abc.abstractmethod
    def ping(self) -> float:
        """Round-trip latency to the store in seconds; raises ``StorageUnavailable``."""

    @abc.abstractmethod
    def scan(self, match: str) -> Iterator[str]:
        """Keys matching a glob pattern (``SCAN``, never ``KEYS``; every master on a cluster)."""

    @abc.abstractmethod
    def delete(self, keys: Iterable[str]) -> int:
        """Delete keys; answer how many existed."""

    @abc.abstractmethod
    def heartbeat(self, key: str, member: str, ttl: float) -> int:
        """Mark ``member`` alive in the set ``key`` for ``ttl`` seconds; answer the live count.

        Used by ``DISTLIMIT_INSTANCES = "auto"``: one member per process.
        """

    def heartbeat_fleet(self, key: str, member: str, ttl: float, known: int = 0) -> Fleet:
        """:meth:`heartbeat`, and the fleet size that survives: report ``known`` (the largest
        live count this process saw in its last beats, 0 for none) for ``ttl`` seconds beside
        ``key``, and answer the live count, the largest size any process reported within
        ``ttl`` and the keys found holding garbage and replaced (:mod:`.heartbeat`).

        This default keeps nothing beside ``key``, as suits a store private to one process
        (``memory://``); the Redis storages override it.
        """
        live = self.heartbeat(key, member, ttl)
        return Fleet(live, max(live, known))

    def shared_value(self, key: str, candidate: str, ttl: int) -> str:
        """The value every process of a deployment reads at ``key``: ``candidate`` is stored
        there first when the key is absent; either way the key then lives ``ttl`` seconds (``0``:
        it never expires, and a TTL it had is removed).

        Used for the identity digest key when the app sets no secret
        (:mod:`flask_distlimit.identity.digests`). This default keeps the value in the storage
        object, as suits a store private to one process (``memory://``); a store shared by several
        processes must override it (the Redis storages do: :mod:`.side_calls`).
        """
        with _shared_lock:
            kept: dict[str, str] = self.__dict__.setdefault("_shared_values", {})
            return kept.setdefault(key, candidate)

    def publish_leases(self, key: str, process: str, record: str, hold: float) -> tuple[str, ...]:
        """Publish ``record``, the leases ``process`` holds, under ``key`` for ``hold``
        seconds, dropping the records whose time is up; answer the keys found holding garbage
        and replaced (:mod:`.lease_records`).

        This default keeps the records in the storage object, as suits a store private to one
        process (``memory://``); the Redis storages override it.
        """
        now = time.monotonic()
        with _shared_lock:
            kept: dict[str, dict[str, tuple[float, float, str]]] = self.__dict__.setdefault(
                "_lease_records", {}
            )
            records = kept.setdefault(key, {})
            records[process] = (now + hold, now, record)
            for gone in [p for p, (until, _, _) in records.items() if until <= now]:
                del records[gone]
        return ()

    def lease_records(self, key: str) -> list[Record]:
        """The records published under ``key`` whose time is not up (a read; no write)."""
        now = time.monotonic()
        with _shared_lock:
            records = self.__dict__.get("_lease_records", {}).get(key, {})
            return [
                Record(process, now - at, text)
                for process, (until, at, text) in records.items()
                if until > now
            ]

    def give_back(
        self,
        key: str,
        algorithm: str,
        period: int,
        window: int,
        units: int,
        *,
        now_us: int | None = None,
    ) -> int:
        """Take up to ``units`` off the count of ``key``'s window ``window`` (``period``
        seconds long, a fixed window or sliding window counter) while that window is the
        storage's current one and the key holds it; answer the units taken off
        (:mod:`.give_back`). ``now_us`` injects the time, for tests only.

        A storage that can give back overrides :meth:`_give_back`, which this method calls with
        the arguments as one :class:`GiveBack`."""
        return self._give_back(GiveBack(key, algorithm, period, window, units, now_us))

    def _give_back(self, back: GiveBack) -> int:
        """:meth:`give_back` of ``back``. This default gives nothing back (the units expire
        with their window), as suits a store that cannot; the memory and Redis storages
        override it."""
        return 0

    def scripts_loaded(self) -> bool:
        """True when the store holds the rate-limit scripts (always true for memory)."""
        return True

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections. The storage must not be used afterwards."""

    def reset_after_fork(self) -> None:  # noqa: B027 - optional hook
        """Drop connections inherited from a parent process (called in a forked child)."""
