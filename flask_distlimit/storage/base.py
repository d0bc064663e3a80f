"""The storage interface every backend implements.

A backend evaluates all the checks of one request atomically (all-or-nothing) and answers in one
round trip (one per Redis Cluster slot group). Backends raise
:class:`~flask_distlimit.errors.StorageUnavailable` for outages (its subclass
:class:`~flask_distlimit.errors.StorageMisconfigured` when the store refuses the limiter's
credentials, commands, keys or database) and
:class:`~flask_distlimit.errors.StorageResponseError` for errors the store answered with; they
never raise a backend library's own exception types.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Iterable, Iterator, Sequence

from ..decision import Check, Evaluation
from .heartbeat import Fleet

__all__ = ["Storage"]

_shared_lock = threading.Lock()


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
        there first when the key is absent; either way the key then lives ``ttl`` seconds.

        Used for the identity digest key when the app sets no secret
        (:mod:`flask_distlimit.digests`). This default keeps the value in the storage object,
        as suits a store private to one process (``memory://``); a store shared by several
        processes must override it (the Redis storages do, with ``SET NX`` and ``EXPIRE``).
        """
        with _shared_lock:
            kept: dict[str, str] = self.__dict__.setdefault("_shared_values", {})
            return kept.setdefault(key, candidate)

    def scripts_loaded(self) -> bool:
        """True when the store holds the rate-limit scripts (always true for memory)."""
        return True

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections. The storage must not be used afterwards."""

    def reset_after_fork(self) -> None:  # noqa: B027 - optional hook
        """Drop connections inherited from a parent process (called in a forked child)."""
