"""Fixtures of the extension tests: one suite over memory, fakeredis and a real redis-server.

Import the fixtures a test module uses (``from tests.distlimit_fixtures import backend``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import fakeredis
import pytest
from flask import Flask

from flask_distlimit import ALGORITHMS, Limiter
from flask_distlimit.engine.registry import REGISTRY
from flask_distlimit.storage.base import Storage
from flask_distlimit.storage.memory import MemoryStorage
from flask_distlimit.storage.redis import RedisStorage
from flask_distlimit.testing import CountingStorage, FakeClock

#: The rate algorithms that never admit more than ``limit`` units in their window or burst.
EXACT_ALGORITHMS = frozenset(name for name in ALGORITHMS if REGISTRY[name].exact)

BACKENDS = [
    pytest.param("memory", id="memory"),
    pytest.param("fakeredis", id="fakeredis"),
    pytest.param("redis", marks=pytest.mark.redis, id="redis"),
]

#: No tier limits and no global limits unless a test asks for them.
QUIET = {"DISTLIMIT_TIERS": {"anonymous": ""}, "SECRET_KEY": "test-secret-" + "x" * 20}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(start=1_700_000_040.0)  # on a whole minute


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, clock: FakeClock) -> Iterator[Callable[[], Storage]]:
    """A factory of storages that share one store (one per test): several apps = several
    workers on one Redis."""
    kind = request.param
    if kind == "memory":
        shared = MemoryStorage(clock=clock)
        yield lambda: shared
    elif kind == "fakeredis":
        server = fakeredis.FakeServer()
        yield lambda: RedisStorage(fakeredis.FakeRedis(server=server))
    else:
        redis_client = request.getfixturevalue("redis_client")
        pool_kwargs = redis_client.connection_pool.connection_kwargs
        made: list[RedisStorage] = []

        def make() -> Storage:
            # A generous timeout: on a loaded machine the default 0.1 s can expire, and a policy
            # would then decide instead of Redis (tests of timeouts build their own storage).
            storage = RedisStorage(host=pool_kwargs["host"], port=pool_kwargs["port"], timeout=2.0)
            made.append(storage)
            return storage

        yield make
        for storage in made:
            storage.close()


@pytest.fixture
def redis_storage(redis_client: Any) -> Iterator[RedisStorage]:
    """A storage on the session's real redis-server (flushed by ``redis_client``), with a
    generous timeout, closed after the test: put a fault in front of it
    (:class:`tests.faults.FailingStorage`) to inject an outage."""
    kwargs = redis_client.connection_pool.connection_kwargs
    storage = RedisStorage(host=kwargs["host"], port=kwargs["port"], timeout=2.0)
    yield storage
    storage.close()


def make_app(
    storage: Storage,
    clock: FakeClock,
    *,
    limiter: Limiter | None = None,
    name: str = "app",
    **config: Any,
) -> tuple[Flask, Limiter, CountingStorage]:
    """An app with a Limiter on a counting wrapper of ``storage``."""
    app = Flask(name)
    app.config.update(QUIET)
    app.config.update(config)
    counting = CountingStorage(storage)
    limiter = limiter or Limiter(clock=clock)
    limiter.init_app(app, storage=counting)
    return app, limiter, counting
