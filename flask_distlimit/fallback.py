"""The local fallback: limits enforced in-process while the shared storage is away.

Under ``DISTLIMIT_FAILURE_POLICY = "local"`` every check of a request is decided by an in-process
:class:`~flask_distlimit.storage.memory.MemoryStorage` (the same five algorithms as the Lua, decided
the same way) at ``floor(limit / instances)``, at least 1. Each of ``instances`` processes admits
its share, so the fleet as a whole stays near the configured limit instead of multiplying it by the
number of processes.

The fallback's state is dropped when the storage answers again (:meth:`LocalFallback.drop`):
counters resume from Redis and nothing is written back; what was consumed locally during the
outage is simply forgotten.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence

from .decision import Check, Evaluation
from .storage.base import Storage

__all__ = ["LocalFallback", "divided_limit"]


def divided_limit(limit: int, instances: int) -> int:
    """One instance's share of ``limit``: ``floor(limit / instances)``, at least 1."""
    if instances <= 1:
        return limit
    return max(1, limit // instances)


def _memory_storage() -> Storage:
    from .storage.memory import MemoryStorage

    return MemoryStorage()


class LocalFallback:
    """Decides checks in-process at each limit's per-instance share.

    ``factory`` builds the in-process store (default: a fresh ``MemoryStorage``); it is called
    lazily, on the first degraded request, and again after every :meth:`drop`.
    """

    def __init__(self, factory: Callable[[], Storage] | None = None) -> None:
        self._factory = factory or _memory_storage
        self._storage: Storage | None = None
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        """True while the fallback holds state (between the first degraded request and a drop)."""
        return self._storage is not None

    def evaluate(
        self, checks: Sequence[Check], *, instances: int, now_us: int | None = None
    ) -> Evaluation:
        """Decide ``checks`` locally, each limit divided by ``instances``."""
        storage = self._storage
        if storage is None:
            with self._lock:
                storage = self._storage
                if storage is None:
                    storage = self._storage = self._factory()
        if instances > 1:
            checks = [
                dataclasses.replace(c, limit=divided_limit(c.limit, instances)) for c in checks
            ]
        return storage.evaluate(checks, now_us=now_us)

    def drop(self) -> None:
        """Forget every local counter (the storage is back; nothing is written back to it)."""
        with self._lock:
            storage, self._storage = self._storage, None
        if storage is not None:
            storage.close()

    def _after_fork(self) -> None:
        self._lock = threading.Lock()
        self._storage = None
