from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from tests.servers import RedisProcess, start_redis


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisProcess]:
    """One real redis-server for the session; tests flush what they use via ``redis_client``."""
    server = start_redis()
    yield server
    server.stop()


@pytest.fixture
def redis_client(redis_server: RedisProcess) -> Iterator[redis.Redis]:
    """A client of the session's server, flushed before the test and checked after it:
    every key a test leaves behind must carry a TTL."""
    client = redis_server.client()
    client.flushall()
    yield client
    assert_every_key_has_ttl(client)
    client.close()


def assert_every_key_has_ttl(client: redis.Redis) -> None:
    forever = [k for k in client.scan_iter(count=1000) if client.pttl(k) == -1]
    assert not forever, f"keys without a TTL: {forever[:10]}"
