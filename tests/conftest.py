"""Real Redis servers for the tests, started on free loopback ports and stopped by PID.

- ``redis_server`` / ``redis_client``: one redis-server for the session (the client flushes it
  before a test and checks after it that every key carries a TTL).
- ``redis_cluster`` / ``cluster_client``: a real 3-primary Redis Cluster with one replica per
  primary for the session (``cluster_client`` flushes it and checks TTLs the same way).
- ``redis_sentinel``: 1 master, 1 replica and 3 Sentinels (quorum 2) for the session.
- ``cluster_factory`` / ``sentinel_factory``: fresh private servers for tests that kill or stop
  them, so destructive tests never break the shared session servers; stopped after the test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import redis
from redis.cluster import RedisCluster

from tests.faults import OPENED
from tests.servers import (
    ClusterServers,
    RedisProcess,
    SentinelServers,
    start_cluster,
    start_redis,
    start_sentinels,
)


def pytest_report_header() -> str:
    """The releases the run tests, first thing in its output (CI follows the newest)."""
    from importlib.metadata import version

    return "dependencies: " + ", ".join(
        f"{name} {version(name)}" for name in ("flask", "werkzeug", "redis", "pybreaker")
    )


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisProcess]:
    """One real redis-server for the session; tests flush what they use via ``redis_client``."""
    server = start_redis()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_client(redis_server: RedisProcess) -> Iterator[redis.Redis]:
    """A client of the session's server, flushed before the test and checked after it:
    every key a test leaves behind must carry a TTL (but the identity digest key, which must
    never expire: flask_distlimit.identity.digests)."""
    client = redis_server.client()
    client.flushall()
    yield client
    assert_every_key_has_ttl(client)
    client.close()


def assert_every_key_has_ttl(client: redis.Redis) -> None:
    forever = [
        k
        for k in client.scan_iter(count=1000)
        if client.pttl(k) == -1 and not k.endswith(b":identity-digest-key")
    ]
    assert not forever, f"keys without a TTL: {forever[:10]}"


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[ClusterServers]:
    """A real Redis Cluster (3 primaries, 1 replica each) for the session. Do not kill its
    nodes: use ``cluster_factory`` for that."""
    cluster = start_cluster()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster_client(redis_cluster: ClusterServers) -> Iterator[RedisCluster]:
    """A RedisCluster client of the session's cluster, flushed before the test; after it, every
    key on every primary must carry a TTL."""
    redis_cluster.flushall()
    client = RedisCluster(host="127.0.0.1", port=redis_cluster.nodes[0].port)
    yield client
    for node in redis_cluster.primary_nodes():
        node_client = node.client()
        try:
            assert_every_key_has_ttl(node_client)
        finally:
            node_client.close()
    client.close()


@pytest.fixture(scope="session")
def redis_sentinel() -> Iterator[SentinelServers]:
    """1 master + 1 replica + 3 Sentinels for the session. Do not kill its servers: use
    ``sentinel_factory`` for that."""
    group = start_sentinels()
    try:
        yield group
    finally:
        group.stop()


@pytest.fixture
def cluster_factory() -> Iterator[Callable[..., ClusterServers]]:
    """``cluster_factory(primaries=3, replicas=1, node_timeout_ms=2000)`` starts a private
    cluster that this test may damage; every cluster it started is stopped afterwards."""
    started: list[ClusterServers] = []

    def make(**options: int) -> ClusterServers:
        cluster = start_cluster(**options)
        started.append(cluster)
        return cluster

    try:
        yield make
    finally:
        for cluster in started:
            cluster.stop()


@pytest.fixture
def sentinel_factory() -> Iterator[Callable[..., SentinelServers]]:
    """``sentinel_factory()`` starts a private master/replica/3-Sentinel group that this test
    may damage; everything it started is stopped afterwards."""
    started: list[SentinelServers] = []

    def make(**options: int | str) -> SentinelServers:
        group = start_sentinels(**options)  # type: ignore[arg-type]
        started.append(group)
        return group

    try:
        yield make
    finally:
        for group in started:
            group.stop()


@pytest.fixture(autouse=True)
def _close_opened_storages() -> Iterator[None]:
    """Close the storages a test opened with ``tests.faults.opened``, whatever its outcome."""
    yield
    while OPENED:
        OPENED.pop().close()
