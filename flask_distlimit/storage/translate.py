"""redis-py exceptions translated into the project's error tree.

Outages (:class:`~flask_distlimit.errors.StorageUnavailable`, counted by the circuit breaker):
connection refused or reset, timeouts, no free pooled connection in time, a Sentinel that knows
no master, a cluster that is down or resharding (``CLUSTERDOWN``, ``MASTERDOWN``, ``TRYAGAIN``,
uncovered slots), a server still loading its data (``LOADING``), busy with another script
(``BUSY``), out of memory (``OOM``) or demoted to a replica mid-failover (``READONLY``).

Everything else the server answers (a script error, ``WRONGTYPE``) is a bug or bad data:
:class:`~flask_distlimit.errors.StorageResponseError`, never an outage.
"""

from __future__ import annotations

from typing import Final

from redis import exceptions as rx

from ..errors import StorageError, StorageResponseError, StorageUnavailable

__all__ = ["REDIS_FAILURES", "storage_error"]

#: What a storage catches around a Redis call and passes to :func:`storage_error`.
REDIS_FAILURES: Final[tuple[type[Exception], ...]] = (
    rx.RedisError,
    rx.RedisClusterException,
    rx.ChildDeadlockedError,
    OSError,
)

_OUTAGES: Final[tuple[type[BaseException], ...]] = (
    rx.ConnectionError,  # includes BusyLoadingError, MasterNotFoundError, MaxConnectionsError
    rx.TimeoutError,
    rx.ClusterError,  # ClusterDownError, MasterDownError, "TTL exhausted"
    rx.TryAgainError,
    rx.RedisClusterException,  # SlotNotCoveredError, "cannot connect to any node"
    rx.ReadOnlyError,
    rx.OutOfMemoryError,
    rx.ChildDeadlockedError,
    rx.InvalidResponse,
    OSError,
)
_OUTAGE_CODES: Final = ("BUSY ", "MASTERDOWN", "CLUSTERDOWN", "LOADING", "NOREPLICAS")


def storage_error(exc: BaseException) -> StorageError:
    """The :class:`StorageError` to raise for an exception from redis-py (or the pool)."""
    if isinstance(exc, StorageError):
        return exc
    if isinstance(exc, _OUTAGES):
        return StorageUnavailable(f"Redis is unavailable: {type(exc).__name__}: {exc}")
    if isinstance(exc, rx.ResponseError):
        text = str(exc)
        if text.startswith(_OUTAGE_CODES):
            return StorageUnavailable(f"Redis is unavailable: {text}")
        return StorageResponseError(
            f"Redis answered with an error (a script bug or bad data, not an outage): {text}"
        )
    return StorageResponseError(f"Redis client error: {type(exc).__name__}: {exc}")
