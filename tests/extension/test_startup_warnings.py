"""Start-up warnings of ``init_app``: one WARNING line each, at start-up, never per request.

- A Redis client passed in that retries (redis-py's own retries may send an ``EVALSHA`` again
  after its reply was lost and count a request twice; the clients the library builds never
  retry): real redis-py clients of real servers (single node, Sentinel, Cluster), built with and
  without retries. The same module runs on redis-py 5.0 (``.ci/run``), whose clients retry
  only when told to and whose ``Retry`` has no public count.
- uWSGI without the options that make its workers run Python's fork hooks: uWSGI is not
  installed, so its ``uwsgi`` module (importable only inside uWSGI) is stood for by a fake.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import redis
from flask import Flask
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry
from redis.sentinel import Sentinel

from flask_distlimit import Limiter, forks
from flask_distlimit.storage import from_url
from flask_distlimit.storage.base import Storage
from flask_distlimit.storage.client_retries import client_retries
from flask_distlimit.storage.cluster import ClusterStorage
from flask_distlimit.storage.redis import RedisStorage
from tests.servers import ClusterServers, RedisProcess, SentinelServers

#: redis-py 6+ (``Retry.get_retries``): ``redis.Redis()`` and ``RedisCluster()`` retry by default.
REDIS_PY_6 = hasattr(Retry, "get_retries")
#: A RedisCluster that never retries: before redis-py 6, the whole command's retries are
#: ``cluster_error_retry_attempts`` (3 by default); from 6, ``retry``'s count (the argument
#: is deprecated then, and would warn).
QUIET_CLUSTER: dict[str, object] = {"retry": Retry(NoBackoff(), 0)}
if not REDIS_PY_6:
    QUIET_CLUSTER["cluster_error_retry_attempts"] = 0

RETRIES_LOG = "flask_distlimit.storage.client_retries"
TIMEOUTS_LOG = "flask_distlimit.storage.client_retries.timeouts"
FORKS_LOG = "flask_distlimit.forks"
QUIET = {"DISTLIMIT_TIERS": {"anonymous": ""}, "SECRET_KEY": "test-secret-" + "x" * 20}


def warnings_of(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == logger and r.levelno >= logging.WARNING
    ]


def serve(storage: Storage, requests: int = 0) -> Flask:
    """An app limited on ``storage`` (one route, 100/minute), asked ``requests`` times."""
    app = Flask("warned")
    app.config.update(QUIET)
    limiter = Limiter(app, storage=storage)

    @app.get("/")
    @limiter.limit("100/minute")
    def index() -> str:
        return "ok"

    with app.test_client() as client:
        for _ in range(requests):
            response = client.get("/")
            assert response.status_code == 200
            assert "X-RateLimit-Degraded" not in response.headers  # Redis decided
    return app


@pytest.fixture(autouse=True)
def outside_uwsgi(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test is a process outside uWSGI that has not warned yet."""
    monkeypatch.delitem(sys.modules, "uwsgi", raising=False)
    monkeypatch.setattr(forks, "_warned_in", None)


# -- a Redis client passed in that retries ------------------------------------------------------


def test_a_retrying_client_is_warned_about_once_at_start_up_not_per_request(
    redis_server: RedisProcess, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    client = redis_server.client(retry=Retry(NoBackoff(), 2))
    app = Flask("warned")
    app.config.update(QUIET)
    limiter = Limiter()

    @app.get("/")
    @limiter.limit("100/minute")
    def index() -> str:
        return "ok"

    with caplog.at_level(logging.WARNING):
        limiter.init_app(app, storage=RedisStorage(client))
        [line] = warnings_of(caplog, RETRIES_LOG)  # at start-up, before any request
        with app.test_client() as http:
            left = [http.get("/").headers["X-RateLimit-Remaining"] for _ in range(5)]
    assert left == ["99", "98", "97", "96", "95"]  # each request counted once, by Redis
    assert warnings_of(caplog, RETRIES_LOG) == [line]  # and never again
    if REDIS_PY_6:
        assert "retry=Retry(..., retries=2)" in line
    else:
        assert "redis-py 5 does not tell how often" in line
    for words in (
        "The Redis client passed to the rate limiter makes retries of its own",
        "a request can be counted twice",
        "retry=Retry(NoBackoff(), 0)",
        "retry_on_timeout",
        "DISTLIMIT_STORAGE_URL",
    ):
        assert words in line
    client.close()


def _pool_client(server: RedisProcess, **kwargs: object) -> redis.Redis:
    pool = redis.ConnectionPool(host="127.0.0.1", port=server.port, **kwargs)  # type: ignore[arg-type]
    return redis.Redis(connection_pool=pool)


@pytest.mark.parametrize(
    ("build", "named"),
    [
        pytest.param(
            lambda s: s.client(retry=Retry(NoBackoff(), -1)), "retries forever", id="forever"
        ),
        pytest.param(
            lambda s: _pool_client(s, retry_on_timeout=True),
            "retry_on_timeout=True (without retry=, redis-py retries once)",
            id="retry_on_timeout",
        ),
        pytest.param(
            lambda s: _pool_client(s, retry_on_error=[redis.TimeoutError]),
            "retry_on_error=[TimeoutError] (without retry=, redis-py retries once)",
            id="retry_on_error",
        ),
    ],
)
def test_each_retry_setting_is_named(
    redis_server: RedisProcess,
    redis_client: redis.Redis,
    caplog: pytest.LogCaptureFixture,
    build: object,
    named: str,
) -> None:
    assert callable(build)
    client = build(redis_server)
    with caplog.at_level(logging.WARNING):
        serve(RedisStorage(client), requests=2)
    [line] = warnings_of(caplog, RETRIES_LOG)
    if named == "retries forever" and not REDIS_PY_6:
        named = "redis-py 5 does not tell how often"
    assert named in line
    client.close()


def test_the_default_client_retries_from_redis_py_6(
    redis_server: RedisProcess, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """``redis.Redis()`` retries with a backoff by default since redis-py 6; not before."""
    client = redis_server.client()
    with caplog.at_level(logging.WARNING):
        serve(RedisStorage(client), requests=2)
    found = warnings_of(caplog, RETRIES_LOG)
    assert len(found) == (1 if REDIS_PY_6 else 0)
    client.close()


class _RetryOfRedisPy5(Retry):
    """A ``Retry`` without ``get_retries``, as redis-py 5's: its count is asked of
    ``call_with_retry`` (on redis-py 5, every Retry is one)."""

    get_retries = None  # type: ignore[assignment]


@pytest.mark.parametrize(("count", "retries"), [(0, False), (1, True), (3, True), (-1, True)])
def test_a_retry_without_a_public_count_is_asked_how_it_behaves(
    redis_server: RedisProcess, count: int, retries: bool
) -> None:
    given = _RetryOfRedisPy5(NoBackoff(), count)
    client = redis_server.client(retry=given)
    found = client_retries(client)
    assert found == (
        ["retry=Retry(...), which retries (redis-py 5 does not tell how often)"] if retries else []
    )
    assert client.ping()  # the probe ran on a copy: the client's own Retry still works
    client.close()


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda s: s.client(retry=Retry(NoBackoff(), 0)), id="retry-0"),
        pytest.param(
            lambda s: s.client(retry=Retry(NoBackoff(), 0), retry_on_error=[redis.TimeoutError]),
            id="retry-0-with-retry_on_error",
        ),
        pytest.param(lambda s: redis.Redis.from_url(s.url), id="from_url"),
    ],
)
def test_a_client_that_never_retries_is_not_warned_about(
    redis_server: RedisProcess,
    redis_client: redis.Redis,
    caplog: pytest.LogCaptureFixture,
    build: object,
) -> None:
    assert callable(build)
    client = build(redis_server)
    assert client_retries(client) == []
    with caplog.at_level(logging.DEBUG):
        serve(RedisStorage(client), requests=2)
    assert [r for r in caplog.records if r.name == RETRIES_LOG] == []
    client.close()


def test_the_librarys_own_clients_never_retry_and_are_not_warned_about(
    redis_server: RedisProcess,
    redis_client: redis.Redis,
    redis_sentinel: SentinelServers,
    redis_cluster: ClusterServers,
    caplog: pytest.LogCaptureFixture,
) -> None:
    storages: list[Storage] = [
        from_url(redis_server.url),
        RedisStorage(host="127.0.0.1", port=redis_server.port),
        from_url(redis_sentinel.url),
        from_url(redis_cluster.url),
    ]
    with caplog.at_level(logging.WARNING):
        for storage in storages:
            app = Flask("own")
            app.config.update(QUIET)
            Limiter(app, storage=storage)
    assert warnings_of(caplog, RETRIES_LOG) == []
    assert warnings_of(caplog, TIMEOUTS_LOG) == []  # their calls end by DISTLIMIT_REDIS_TIMEOUT
    for storage in storages:
        assert isinstance(storage, RedisStorage | ClusterStorage)
        assert client_retries(storage.client) == [], storage.scheme  # the Cluster connects here
        storage.close()


def test_a_sentinel_managed_client_is_checked_as_any(
    redis_sentinel: SentinelServers, caplog: pytest.LogCaptureFixture
) -> None:
    sentinels = Sentinel([("127.0.0.1", s.port) for s in redis_sentinel.sentinels])
    quiet = sentinels.master_for(redis_sentinel.service)  # no retry unless asked for
    retrying = sentinels.master_for(redis_sentinel.service, retry=Retry(NoBackoff(), 2))
    with caplog.at_level(logging.WARNING):
        serve(RedisStorage(quiet), requests=2)
        assert warnings_of(caplog, RETRIES_LOG) == []
        serve(RedisStorage(retrying), requests=2)
    [line] = warnings_of(caplog, RETRIES_LOG)
    assert "retry=Retry(" in line


def test_a_retrying_cluster_client_is_warned_about(
    redis_cluster: ClusterServers, cluster_client: RedisCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """``RedisCluster`` retries the whole command (``EVALSHA`` included) on a connection error
    or a timeout, by default: 3 times before redis-py 6, ``retry``'s count since."""
    with caplog.at_level(logging.WARNING):
        serve(ClusterStorage(client=cluster_client), requests=3)
    [line] = warnings_of(caplog, RETRIES_LOG)
    assert "The RedisCluster client passed to the rate limiter makes retries" in line
    if REDIS_PY_6:
        assert "(the whole command's retries)" in line and "cluster_error_retry" not in line
    else:
        assert "cluster_error_retry_attempts=3" in line
        assert "cluster_error_retry_attempts=0 (redis-py before 6)" in line  # the fix


def test_a_cluster_client_that_never_retries_is_not_warned_about(
    redis_cluster: ClusterServers, cluster_client: RedisCluster, caplog: pytest.LogCaptureFixture
) -> None:
    quiet = RedisCluster(host="127.0.0.1", port=redis_cluster.nodes[0].port, **QUIET_CLUSTER)  # type: ignore[arg-type]
    assert client_retries(quiet) == []
    with caplog.at_level(logging.WARNING):
        serve(ClusterStorage(client=quiet), requests=3)
    assert warnings_of(caplog, RETRIES_LOG) == []
    # no socket_timeout, and no warning: the hot path goes through the storage's own pools,
    # whose waits end by the deadline
    assert warnings_of(caplog, TIMEOUTS_LOG) == []
    quiet.close()


# -- a Redis client passed in that waits long for a reply -----------------------------------------


def test_a_client_passed_in_that_waits_long_for_a_reply_is_warned_about_at_start_up(
    redis_server: RedisProcess, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """redis-py's default read timeout is none (before 8.0) or 5 s: a stalled Redis would hold
    every request that long, and DISTLIMIT_REDIS_TIMEOUT (0.1 s here) does not reach a client
    passed in. One line at start-up, none per request."""
    never = Retry(NoBackoff(), 0)
    bounded = redis.Redis(
        port=redis_server.port, retry=never, socket_timeout=0.1, socket_connect_timeout=0.1
    )
    slow = redis.Redis(port=redis_server.port, retry=never, socket_timeout=5)
    forever = redis.Redis(port=redis_server.port, retry=never, socket_timeout=None)
    with caplog.at_level(logging.WARNING):
        serve(RedisStorage(bounded), requests=3)
        assert warnings_of(caplog, TIMEOUTS_LOG) == []
        serve(RedisStorage(slow), requests=5)
        serve(RedisStorage(forever), requests=5)
    waits_5, waits_forever = warnings_of(caplog, TIMEOUTS_LOG)
    assert "has socket_timeout=5" in waits_5 and "5 s (DISTLIMIT_REDIS_TIMEOUT is 0.1 s)" in waits_5
    assert "has no socket_timeout" in waits_forever
    assert "until the operating system gives up" in waits_forever
    for line in (waits_5, waits_forever):
        assert "socket_timeout=0.1 and socket_connect_timeout=0.1" in line
        assert "DISTLIMIT_REDIS_TIMEOUT does not reach a client passed in" in line
    assert warnings_of(caplog, RETRIES_LOG) == []  # the other setting: no retries here
    for client in (bounded, slow, forever):
        client.close()


# -- uWSGI without Python's fork hooks -----------------------------------------------------------


def as_uwsgi(monkeypatch: pytest.MonkeyPatch, opt: object, **more: object) -> None:
    """Make this process look like a uWSGI worker given the options ``opt`` (one process: no
    memory:// warning either)."""
    fake = types.SimpleNamespace(opt=opt, numproc=1, **more)
    monkeypatch.setitem(sys.modules, "uwsgi", fake)


def init_memory_app() -> None:
    app = Flask("under_uwsgi")
    app.config.update(QUIET)
    Limiter(app)


def test_no_warning_outside_uwsgi(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        init_memory_app()
    assert [r for r in caplog.records if r.name == FORKS_LOG] == []


@pytest.mark.parametrize(
    "opt",
    [
        pytest.param({}, id="nothing"),
        pytest.param({"master": True, "processes": b"4", "enable-threads": True}, id="master"),
        pytest.param({"lazy-apps": b"false"}, id="lazy-apps-false"),
        pytest.param({"lazy-apps": b"0"}, id="lazy-apps-0"),
        pytest.param({b"lazy-apps": b"No"}, id="bytes-key-No"),
        pytest.param({"py-call-osafterfork": b"OFF"}, id="osafterfork-OFF"),
        pytest.param({"lazy-apps": [b"true", b"false"]}, id="given-twice-last-off"),
    ],
)
def test_uwsgi_without_fork_hooks_is_warned_about_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, opt: dict[object, object]
) -> None:
    as_uwsgi(monkeypatch, opt, has_threads=1)
    with caplog.at_level(logging.WARNING):
        init_memory_app()
        init_memory_app()  # a second app in the same process: still one line
    [line] = warnings_of(caplog, FORKS_LOG)
    assert "none of lazy-apps, py-call-osafterfork and py-call-uwsgi-fork-hooks is set" in line
    assert "same request tokens" in line and "leases" in line
    assert "lazy-apps = true" in line and "py-call-osafterfork = true" in line


@pytest.mark.parametrize(
    ("opt", "threads"),
    [
        pytest.param({"lazy-apps": True}, 0, id="lazy-apps-flag"),
        pytest.param({"lazy-apps": b"true"}, 0, id="lazy-apps-true"),
        pytest.param({b"lazy-apps": b"1"}, 0, id="bytes-key"),
        pytest.param({"lazy": True}, 0, id="lazy"),
        pytest.param({"py-call-osafterfork": True}, 0, id="osafterfork-flag"),
        pytest.param({"py-call-osafterfork": b"yes"}, 0, id="osafterfork-yes"),
        pytest.param({"lazy-apps": [b"false", b"true"]}, 0, id="given-twice-last-on"),
        pytest.param({"py-call-uwsgi-fork-hooks": True}, 1, id="uwsgi-fork-hooks-threads"),
    ],
)
def test_uwsgi_with_a_good_option_is_not_warned_about(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    opt: dict[object, object],
    threads: int,
) -> None:
    as_uwsgi(monkeypatch, opt, has_threads=threads)
    with caplog.at_level(logging.DEBUG):
        init_memory_app()
    assert [r for r in caplog.records if r.name == FORKS_LOG] == []


def test_uwsgi_fork_hooks_without_threads_call_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """uWSGI runs ``py-call-uwsgi-fork-hooks`` only with threads, and then ignores
    ``py-call-osafterfork`` (threads are off before 2.0.27 unless asked for)."""
    as_uwsgi(
        monkeypatch,
        {"py-call-uwsgi-fork-hooks": True, "py-call-osafterfork": True},
        has_threads=0,
    )
    with caplog.at_level(logging.WARNING):
        init_memory_app()
    [line] = warnings_of(caplog, FORKS_LOG)
    assert "py-call-uwsgi-fork-hooks is set but threads are off" in line


@pytest.mark.parametrize(
    ("opt", "warned"),
    [
        pytest.param({"py-call-uwsgi-fork-hooks": True, "enable-threads": True}, False, id="on"),
        pytest.param({"py-call-uwsgi-fork-hooks": True, "threads": b"4"}, False, id="threads"),
        pytest.param({"py-call-uwsgi-fork-hooks": True}, True, id="off"),
    ],
)
def test_threads_read_from_the_options_when_uwsgi_does_not_say(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    opt: dict[object, object],
    warned: bool,
) -> None:
    as_uwsgi(monkeypatch, opt)  # no uwsgi.has_threads
    with caplog.at_level(logging.WARNING):
        init_memory_app()
    assert len(warnings_of(caplog, FORKS_LOG)) == (1 if warned else 0)


def test_unreadable_uwsgi_options_never_break_the_start(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    as_uwsgi(monkeypatch, "lazy-apps")  # not a mapping
    with caplog.at_level(logging.DEBUG):
        init_memory_app()
    assert warnings_of(caplog, FORKS_LOG) == []
    assert [r.getMessage() for r in caplog.records if r.name == FORKS_LOG] == [
        "Could not read uWSGI's options"
    ]
