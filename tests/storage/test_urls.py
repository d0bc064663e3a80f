"""Storage URLs: every accepted form builds the right storage without connecting; a bad URL is a
clear ConfigurationError at start-up that names the URL (password masked) and the accepted forms."""

from __future__ import annotations

import pytest
import redis
from redis.sentinel import SentinelConnectionPool

from flask_distlimit.errors import ConfigurationError
from flask_distlimit.storage import Storage, from_url
from flask_distlimit.storage.cluster import ClusterStorage
from flask_distlimit.storage.memory import MemoryStorage
from flask_distlimit.storage.redis import RedisStorage
from flask_distlimit.storage.urls import mask_url

# Nothing listens on port 1: building a storage must not need the server.
UNREACHABLE = "127.0.0.1:1"


def redis_kwargs(storage: Storage) -> dict[str, object]:
    assert isinstance(storage, RedisStorage)
    pool = storage.client.connection_pool
    return dict(pool.connection_kwargs)


def test_memory() -> None:
    assert isinstance(from_url("memory://"), MemoryStorage)


def test_redis_url_host_port_db_password() -> None:
    storage = from_url(f"redis://user:s3cret@{UNREACHABLE}/2", timeout=0.25)
    kwargs = redis_kwargs(storage)
    assert storage.scheme == "redis"
    assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("127.0.0.1", 1, 2)
    assert (kwargs["username"], kwargs["password"]) == ("user", "s3cret")
    assert kwargs["socket_timeout"] == kwargs["socket_connect_timeout"] == 0.25


def test_redis_url_defaults() -> None:
    kwargs = redis_kwargs(from_url("redis://localhost"))
    assert (kwargs["host"], kwargs["port"]) == ("localhost", 6379)
    assert "db" not in kwargs
    assert kwargs["socket_timeout"] == 0.1


def test_redis_url_query_parameters() -> None:
    storage = from_url(f"redis://{UNREACHABLE}?db=3&password=p%40ss&max_connections=7")
    assert isinstance(storage, RedisStorage)
    kwargs = redis_kwargs(storage)
    assert (kwargs["db"], kwargs["password"]) == (3, "p@ss")
    assert storage.client.connection_pool.max_connections == 7


def test_rediss_uses_tls() -> None:
    storage = from_url(f"rediss://{UNREACHABLE}/0?ssl_cert_reqs=none")
    assert isinstance(storage, RedisStorage)
    assert storage.client.connection_pool.connection_class is redis.SSLConnection
    assert redis_kwargs(storage)["ssl_cert_reqs"] == "none"


def test_unix_socket() -> None:
    storage = from_url("unix:///run/redis/redis.sock?db=1")
    assert isinstance(storage, RedisStorage)
    assert storage.scheme == "unix"
    pool = storage.client.connection_pool
    assert pool.connection_class is redis.UnixDomainSocketConnection
    assert (pool.connection_kwargs["path"], pool.connection_kwargs["db"]) == (
        "/run/redis/redis.sock",
        1,
    )


def test_sentinel_url() -> None:
    storage = from_url(
        "redis+sentinel://:pw@127.0.0.1:1,127.0.0.1:2/mymaster/4?sentinel_password=spw",
        timeout=0.3,
    )
    assert isinstance(storage, RedisStorage)
    assert storage.scheme == "redis+sentinel"
    pool = storage.client.connection_pool
    assert isinstance(pool, SentinelConnectionPool)
    assert pool.service_name == "mymaster"
    assert storage.pool is not None and storage.pool.timeout == 0.3  # the hot call's pool
    assert (pool.connection_kwargs["db"], pool.connection_kwargs["password"]) == (4, "pw")
    assert pool.connection_kwargs["socket_timeout"] == 0.3
    sentinels = pool.sentinel_manager.sentinels
    assert [s.connection_pool.connection_kwargs["port"] for s in sentinels] == [1, 2]
    sentinel_kwargs = sentinels[0].connection_pool.connection_kwargs
    assert sentinel_kwargs["password"] == "spw"
    assert sentinel_kwargs["socket_timeout"] == 0.3


def test_sentinel_default_port_and_shared_credentials() -> None:
    storage = from_url("redis+sentinel://:pw@sentinel-a,sentinel-b:26380/svc")
    assert isinstance(storage, RedisStorage)
    sentinels = storage.client.connection_pool.sentinel_manager.sentinels
    ports = [s.connection_pool.connection_kwargs["port"] for s in sentinels]
    assert ports == [26379, 26380]
    assert sentinels[0].connection_pool.connection_kwargs["password"] == "pw"


def test_cluster_url_does_not_connect() -> None:
    storage = from_url("redis+cluster://:pw@127.0.0.1:1,[::1]:2", timeout=0.2)
    assert isinstance(storage, ClusterStorage)
    assert storage.scheme == "redis+cluster"
    assert storage.timeout == 0.2


def test_scheme_is_case_insensitive_and_whitespace_is_trimmed() -> None:
    assert isinstance(from_url(f"  REDIS://{UNREACHABLE}  "), RedisStorage)


BAD_URLS = [
    ("", "empty"),
    ("localhost:6379", "no scheme"),
    ("http://localhost", "unknown scheme 'http'"),
    ("memcached://localhost", "unknown scheme"),
    ("memory://somewhere", "memory:// takes nothing"),
    ("redis://", "needs a host"),
    ("redis://localhost:notaport", "not a number"),
    ("redis://localhost:70000", "out of range"),
    ("redis://localhost/abc", "database number"),
    ("redis://localhost/1?db=2", "both in the path"),
    ("redis://a:1,b:2", "takes one host"),
    ("redis://localhost?socket_timeout=5", "unknown query parameter 'socket_timeout'"),
    ("redis://localhost?db=x", "invalid value"),
    ("redis://localhost?db=1&db=2", "more than once"),
    ("redis://localhost?max_connections=0", "at least 1"),
    ("redis://localhost?ssl_cert_reqs=none", "need TLS"),
    ("redis://localhost#frag", "fragment"),
    ("unix://", "needs the socket's path"),
    ("unix://host/path.sock", "takes a path"),
    ("redis+sentinel://127.0.0.1:26379", "service name"),
    ("redis+sentinel://127.0.0.1:26379/a/b/c", "/service or /service/db"),
    ("redis+sentinel:///svc", "needs a host"),
    ("redis+cluster://127.0.0.1:7000/0", "takes no path"),
    ("redis+cluster://127.0.0.1:7000?db=1", "unknown query parameter 'db'"),
    ("redis+cluster://[::1:7000", "malformed"),
]


@pytest.mark.parametrize(("url", "reason"), BAD_URLS, ids=[u or "empty" for u, _ in BAD_URLS])
def test_bad_url_is_a_clear_configuration_error(url: str, reason: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        from_url(url)
    message = str(caught.value)
    assert isinstance(caught.value, ValueError)
    assert reason in message
    assert "Accepted forms: memory://, redis://" in message
    assert "redis+sentinel://" in message and "redis+cluster://" in message
    if url:
        assert repr(url.strip()) in message


@pytest.mark.parametrize(
    "url",
    [
        "redis://user:hunter2@localhost:notaport",
        "redis://:hunter2@localhost/abc",
        "redis+sentinel://:hunter2@h:1",
        "redis://localhost:bad?password=hunter2",
        "redis://localhost?password=hunter2&sentinel_password=x",
    ],
)
def test_passwords_are_masked_in_errors(url: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        from_url(url)
    assert "hunter2" not in str(caught.value)
    assert "***" in str(caught.value)


def test_mask_url() -> None:
    assert mask_url("redis://u:p@h:1/0") == "redis://u:***@h:1/0"
    assert mask_url("redis://:p@h") == "redis://:***@h"
    assert mask_url("redis://h?password=p&db=1") == "redis://h?password=***&db=1"
    assert mask_url("redis://h/0") == "redis://h/0"
    assert mask_url("redis://u:p@ss:w@rd@h:1/0") == "redis://u:***@h:1/0"
    assert mask_url("redis+sentinel://:pw@a:1,b:2/svc?sentinel_password=x") == (
        "redis+sentinel://:***@a:1,b:2/svc?sentinel_password=***"
    )
    assert mask_url("no scheme at all") == "no scheme at all"


@pytest.mark.parametrize("timeout", [0, -1, float("inf"), float("nan")])
def test_bad_timeout(timeout: float) -> None:
    with pytest.raises(ConfigurationError, match="DISTLIMIT_REDIS_TIMEOUT"):
        from_url("redis://localhost", timeout=timeout)
