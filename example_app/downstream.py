"""The "downstream" counter: how often the protected handlers really ran.

A rate limiter exists to protect something behind it (a database, a payment provider). Every
handler the limiter guards calls :meth:`Downstream.hit`, and ``GET /downstream`` shows the totals,
so a load test can check that the work done stayed within the quota whatever the number of
requests sent.

With a Redis storage URL the counts live in Redis (``INCR``, shared by every worker and replica);
on ``memory://`` each process counts for itself, and the answer says so.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Final
from urllib.parse import urlsplit

import redis
import redis.cluster

__all__ = ["Downstream"]

log = logging.getLogger(__name__)

_KEY: Final = "example:downstream"
_TTL: Final = 86400  # seconds; every key we write expires
_SEP: Final = " by "  # field "<route> by <caller>" counts one caller's runs


class Downstream:
    """Counts handler runs per route, in Redis when it can, else in this process."""

    def __init__(self, storage_url: str) -> None:
        self._url = storage_url
        self._redis_url = _plain_redis_url(storage_url)
        self._cluster = storage_url.startswith("redis+cluster://")
        self._lock = threading.Lock()
        self._local: dict[str, int] = {}
        self._client: redis.Redis | redis.cluster.RedisCluster | None = None
        self._pid = 0

    @property
    def shared(self) -> bool:
        """True when the counts are shared by every process (kept in Redis)."""
        return self._redis_url is not None

    def _redis(self) -> redis.Redis | redis.cluster.RedisCluster:
        # One client per process: a connection inherited across gunicorn's fork is never reused.
        with self._lock:
            if self._client is None or self._pid != os.getpid():
                assert self._redis_url is not None
                options = {"socket_timeout": 0.5, "socket_connect_timeout": 0.5}
                if self._cluster:
                    self._client = redis.cluster.RedisCluster.from_url(self._redis_url, **options)
                else:
                    self._client = redis.Redis.from_url(self._redis_url, **options)
                self._pid = os.getpid()
            return self._client

    def hit(self, route: str, caller: str = "anonymous") -> None:
        """Record one run of the handler ``route`` for ``caller`` (never fails the request: while
        Redis is unreachable the run is counted in this process and a warning is logged)."""
        fields = (route, f"{route}{_SEP}{caller}")
        if self._redis_url is not None:
            try:
                pipe = self._redis().pipeline(transaction=False)
                for field in fields:
                    pipe.hincrby(_KEY, field, 1)
                pipe.expire(_KEY, _TTL)
                pipe.execute()
                return
            except redis.RedisError as exc:
                log.warning("downstream counter: Redis unreachable (%s); counting locally", exc)
        with self._lock:
            for field in fields:
                self._local[field] = self._local.get(field, 0) + 1

    def _fields(self) -> dict[str, int]:
        """The counts in Redis; while it is unreachable, this process's (as ``hit`` keeps)."""
        if self._redis_url is not None:
            try:
                raw = self._redis().hgetall(_KEY)
                return {k.decode(): int(v) for k, v in raw.items()}  # type: ignore[union-attr]
            except redis.RedisError as exc:
                log.warning("downstream counter: Redis unreachable (%s); showing local counts", exc)
        with self._lock:
            return dict(self._local)

    def counts(self) -> dict[str, int]:
        """Runs per route so far."""
        return {k: v for k, v in self._fields().items() if _SEP not in k}

    def by_caller(self) -> dict[str, dict[str, int]]:
        """Runs per route and caller (``anonymous``, ``user:alice``, ``key:acme-pro``...)."""
        found: dict[str, dict[str, int]] = {}
        for field, n in self._fields().items():
            if _SEP in field:
                route, caller = field.split(_SEP, 1)
                found.setdefault(route, {})[caller] = n
        return found

    def describe(self) -> dict[str, object]:
        """The JSON body of ``GET /downstream``."""
        if self.shared:
            where = "redis: shared by every worker and replica"
        else:
            where = (
                f"process {os.getpid()}: memory:// keeps counts per process, so each gunicorn "
                "worker shows only its own runs (set DISTLIMIT_STORAGE_URL to a Redis to share)"
            )
        return {
            "counts": self.counts(),
            "by_caller": self.by_caller(),
            "shared": self.shared,
            "where": where,
        }


def _plain_redis_url(url: str) -> str | None:
    """A redis-py URL for the storage URL's server, or ``None`` when counts stay in-process."""
    scheme = urlsplit(url).scheme
    if scheme in ("redis", "rediss", "unix"):
        return url
    if scheme == "redis+cluster":
        # The first node is enough for redis-py to discover the cluster.
        rest = url.split("://", 1)[1]
        first = rest.split("/", 1)[0].split(",", 1)[0]
        return f"redis://{first}"
    return None  # memory:// and redis+sentinel:// (would need the sentinel client): per process
