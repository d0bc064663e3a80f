"""Valkey as a server (issue 27): its URL schemes are read as the Redis ones, and a suite run with
``REDIS_TEST_SERVER=valkey`` really talks to valkey-server (tests/servers.py; .ci/run runs
the storage-facing suites that way against the valkey-server 8 of a pinned registry wheel)."""

from __future__ import annotations

import os

import pytest
import redis
from flask import Flask
from redis.sentinel import SentinelConnectionPool

from flask_distlimit import Limiter
from flask_distlimit.errors import ConfigurationError
from flask_distlimit.storage import from_url
from flask_distlimit.storage.cluster import ClusterStorage
from flask_distlimit.storage.redis import RedisStorage
from tests.servers import RedisProcess

UNREACHABLE = "127.0.0.1:1"  # building a storage never connects


@pytest.mark.parametrize(
    ("valkey", "redis_url"),
    [
        (f"valkey://u:pw@{UNREACHABLE}/2", f"redis://u:pw@{UNREACHABLE}/2"),
        (f"VALKEY://{UNREACHABLE}?db=3", f"redis://{UNREACHABLE}?db=3"),
        (f"valkeys://{UNREACHABLE}/0?ssl_cert_reqs=none", f"rediss://{UNREACHABLE}/0?ssl_cert_reqs=none"),
    ],
)  # fmt: skip
def test_valkey_urls_build_what_the_redis_ones_build(valkey: str, redis_url: str) -> None:
    got, want = from_url(valkey, timeout=0.3), from_url(redis_url, timeout=0.3)
    assert isinstance(got, RedisStorage) and isinstance(want, RedisStorage)
    got_pool, want_pool = got.client.connection_pool, want.client.connection_pool
    assert got_pool.connection_class is want_pool.connection_class
    plain = (str, int, float, bool, type(None))  # per-pool objects (registries) differ
    got_kwargs = {k: v for k, v in got_pool.connection_kwargs.items() if isinstance(v, plain)}
    want_kwargs = {k: v for k, v in want_pool.connection_kwargs.items() if isinstance(v, plain)}
    assert got_kwargs == want_kwargs and "host" in got_kwargs


def test_valkey_sentinel_and_cluster_urls() -> None:
    sentinel = from_url("valkey+sentinel://:pw@127.0.0.1:1,127.0.0.1:2/mymaster/4", timeout=0.3)
    assert isinstance(sentinel, RedisStorage)
    pool = sentinel.client.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and pool.service_name == "mymaster"
    assert (pool.connection_kwargs["db"], pool.connection_kwargs["password"]) == (4, "pw")
    cluster = from_url("valkey+cluster://:pw@127.0.0.1:1,[::1]:2", timeout=0.2)
    assert isinstance(cluster, ClusterStorage) and cluster.timeout == 0.2


def test_a_bad_valkey_url_is_refused_as_a_redis_one_would_be() -> None:
    with pytest.raises(ConfigurationError, match=r"unknown query parameter 'nope'") as info:
        from_url(f"valkey://:s3cret@{UNREACHABLE}?nope=1")
    assert "s3cret" not in str(info.value) and "valkey://" in str(info.value)


@pytest.mark.redis
@pytest.mark.parametrize("scheme", ["valkey", "VALKEY"])
def test_an_app_configured_with_a_valkey_url_is_limited(
    redis_server: RedisProcess, scheme: str
) -> None:
    """``DISTLIMIT_STORAGE_URL`` takes the Valkey schemes (init_app used to refuse them)."""
    app = Flask(__name__)
    app.config["DISTLIMIT_STORAGE_URL"] = f"{scheme}://127.0.0.1:{redis_server.port}/0"
    app.config["DISTLIMIT_KEY_PREFIX"] = f"valkey-url-{scheme}"
    limiter = Limiter(app)

    @app.get("/")
    @limiter.limit("2/minute")
    def index() -> str:
        return "ok"

    client = app.test_client()
    statuses = [client.get("/").status_code for _ in range(3)]
    assert statuses == [200, 200, 429]
    assert not any(r.headers.get("X-RateLimit-Degraded") for r in [client.get("/")])
    Limiter.state(app).storage.close()


@pytest.mark.redis
def test_the_fixtures_start_the_server_asked_for(redis_server: RedisProcess) -> None:
    """``REDIS_TEST_SERVER=valkey`` must run the suite on Valkey, not silently on Redis."""
    wanted = os.environ.get("REDIS_TEST_SERVER", "redis")
    client = redis.Redis(host="127.0.0.1", port=redis_server.port)
    try:
        info = client.info("server")
    finally:
        client.close()
    # Valkey answers server_name:valkey (and a redis_version for compatibility); Redis 7 none.
    assert info.get("server_name", "redis") == wanted, info
    if wanted == "valkey":
        assert int(str(info["valkey_version"]).split(".")[0]) >= 8
