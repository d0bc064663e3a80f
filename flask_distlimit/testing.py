"""Helpers for testing an app that uses Flask-DistLimit::

    clock = FakeClock()
    limiter = Limiter(clock=clock)   # the storage and the deny cache follow this clock
    clock.advance(60)                # a minute passes, instantly
    limiter.reset(app)               # forget every counter between tests

:class:`CountingStorage` wraps a storage and counts its calls, to assert round trips.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable, Iterator, Sequence

from flask_distlimit.core.decision import Check, Evaluation
from flask_distlimit.errors import StorageError
from flask_distlimit.storage.base import GiveBack, Route, Storage
from flask_distlimit.storage.heartbeat import Fleet
from flask_distlimit.storage.lease_records import Record

__all__ = ["CountingStorage", "FakeClock"]


class FakeClock:
    """A clock in microseconds since the epoch that moves only when told to.

    Pass it as ``Limiter(clock=...)``: requests then run at this time in the storage (``now_us``)
    and in the deny cache, and headers count from it.
    """

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._us = int(start * 1_000_000)
        self._lock = threading.Lock()

    def __call__(self) -> int:
        return self._us

    @property
    def now_us(self) -> int:
        return self._us

    def time(self) -> float:
        """The time in seconds since the epoch."""
        return self._us / 1_000_000

    def advance(self, seconds: float) -> None:
        """Move forward by ``seconds`` (>= 0; fractions allowed, microsecond resolution)."""
        if seconds < 0:
            raise ValueError(f"A clock only moves forward; got advance({seconds!r}).")
        with self._lock:
            self._us += round(seconds * 1_000_000)


class CountingStorage(Storage):
    """A storage that forwards every call to ``inner`` and counts its evaluations (an
    ``evaluate`` call, or one ``evaluate_parts`` call of a routed storage such as a Cluster)
    and its lease publications."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.scheme = inner.scheme
        # a routed inner storage (Cluster) keeps its breaker per node through this wrapper
        self.routed = inner.routed  # type: ignore[misc]
        self.evaluations = 0
        self.publications = 0  #: ``publish_leases`` calls (the lease records of a process)
        self.checks: list[tuple[Check, ...]] = []
        self._lock = threading.Lock()

    @property
    def request_tokens(self) -> str | None:
        """The wrapped storage's (``DISTLIMIT_REQUEST_TOKENS`` is checked against it)."""
        return getattr(self.inner, "request_tokens", None)

    def evaluate(self, checks: Sequence[Check], *, now_us: int | None = None) -> Evaluation:
        with self._lock:
            self.evaluations += 1
            self.checks.append(tuple(checks))
        return self.inner.evaluate(checks, now_us=now_us)

    def evaluate_parts(
        self, parts: Sequence[Sequence[Check]], *, now_us: int | None = None
    ) -> list[Evaluation | StorageError]:
        with self._lock:
            self.evaluations += 1
            self.checks.append(tuple(c for part in parts for c in part))
        return self.inner.evaluate_parts(parts, now_us=now_us)

    def refund(self, checks: Sequence[Check], *, now_us: int | None = None) -> Evaluation:
        return self.inner.refund(checks, now_us=now_us)

    def node(self, refresh: bool = False) -> str:
        return self.inner.node(refresh)

    def nodes(self) -> Collection[str] | None:
        return self.inner.nodes()

    def route(self, checks: Sequence[Check]) -> list[Route]:
        return self.inner.route(checks)

    def ping(self) -> float:
        return self.inner.ping()

    def scan(self, match: str) -> Iterator[str]:
        return self.inner.scan(match)

    def delete(self, keys: Iterable[str]) -> int:
        return self.inner.delete(keys)

    def heartbeat(self, key: str, member: str, ttl: float) -> int:
        return self.inner.heartbeat(key, member, ttl)

    def heartbeat_fleet(self, key: str, member: str, ttl: float, known: int = 0) -> Fleet:
        return self.inner.heartbeat_fleet(key, member, ttl, known)

    def shared_value(self, key: str, candidate: str, ttl: int) -> str:
        return self.inner.shared_value(key, candidate, ttl)

    def publish_leases(self, key: str, process: str, record: str, hold: float) -> tuple[str, ...]:
        self.publications += 1
        return self.inner.publish_leases(key, process, record, hold)

    def lease_records(self, key: str) -> list[Record]:
        return self.inner.lease_records(key)

    def _give_back(self, back: GiveBack) -> int:
        key, algorithm, period, window, units, now_us = back
        return self.inner.give_back(key, algorithm, period, window, units, now_us=now_us)

    def scripts_loaded(self) -> bool:
        return self.inner.scripts_loaded()

    def close(self) -> None:
        self.inner.close()

    def reset_after_fork(self) -> None:
        self.inner.reset_after_fork()
