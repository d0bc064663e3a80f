"""Start-up tells the truth about the storage (``DISTLIMIT_STARTUP_CHECK``): one line at
``init_app``, before any request, for a Redis the limiter cannot use; nothing for a healthy one.

Real servers only: a port with nothing listening, a socket that accepts and never answers, a
redis-server with a password and an ACL user without scripting, a private Cluster that stops
serving a primary's slots.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Iterator

import pytest
import redis
from flask import Flask

from flask_distlimit import Limiter
from flask_distlimit.errors import ConfigurationError, StorageMisconfigured, StorageUnavailable
from flask_distlimit.storage.redis import RedisStorage
from tests.servers import ClusterServers, RedisProcess, free_port, start_redis_with_acl

LOG = "flask_distlimit.storage.startup_check"
SECRET = "s3cret-in-the-url"


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOG]


def start(url: str, **config: object) -> Flask:
    """An app on ``url`` with one limited route, through ``init_app`` only (no request)."""
    app = Flask("probed")
    app.config.update(DISTLIMIT_STORAGE_URL=url, SECRET_KEY="test-secret-" + "x" * 20, **config)
    limiter = Limiter(app)

    @app.get("/")
    @limiter.limit("5/minute")
    def index() -> str:
        return "ok"

    return app


def only_line(caplog: pytest.LogCaptureFixture, url: str, *words: str) -> str:
    [line] = lines(caplog)
    [record] = [r for r in caplog.records if r.name == LOG]
    assert record.levelno == logging.WARNING
    assert SECRET not in line and url.replace(SECRET, "***") in line  # the URL, masked
    assert "failure policy ('open'" in line and "DISTLIMIT_STARTUP_CHECK" in line
    assert ". Until it is fixed" in line  # each sentence ends (old code: "default user Until")
    for word in words:
        assert word in line
    return line


@pytest.fixture(scope="module")
def guarded() -> Iterator[RedisProcess]:
    """A redis-server whose default user needs a password, with a user denied scripting."""
    server = start_redis_with_acl(
        "right-password", {"noscript": ["on", f">{SECRET}", "~*", "+@all", "-@scripting"]}
    )
    yield server
    server.stop()


def test_nothing_listening_is_said_at_init_app(caplog: pytest.LogCaptureFixture) -> None:
    url = f"redis://:{SECRET}@127.0.0.1:{free_port()}/0"
    with caplog.at_level(logging.WARNING):
        app = start(url)
    only_line(caplog, url, "cannot be reached", "Connection refused", "Check the host, port")
    with app.test_client() as client:  # and then requests meet the policy, as before
        assert client.get("/").headers["X-RateLimit-Degraded"] == "true"


def test_a_server_that_never_answers_costs_the_start_one_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A socket that accepts (the kernel's backlog) and never answers: the probe ends by
    DISTLIMIT_REDIS_TIMEOUT and says so; init_app returns."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"redis://:{SECRET}@127.0.0.1:{silent.getsockname()[1]}/0"
        with caplog.at_level(logging.WARNING):
            start(url, DISTLIMIT_REDIS_TIMEOUT=0.05)
    only_line(caplog, url, "cannot be reached", "within DISTLIMIT_REDIS_TIMEOUT (0.05 s)")


def test_a_wrong_password_is_said_at_init_app(
    guarded: RedisProcess, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"redis://:{SECRET}@127.0.0.1:{guarded.port}/0"
    with caplog.at_level(logging.WARNING):
        start(url)
    only_line(caplog, url, "refuses the limiter", "WRONGPASS", "Fix the user name and password")


def test_a_user_without_scripting_is_said_at_init_app(
    guarded: RedisProcess, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"redis://noscript:{SECRET}@127.0.0.1:{guarded.port}/0"
    with caplog.at_level(logging.WARNING):
        start(url)
    only_line(caplog, url, "NOPERM", "'evalsha'", "ACL SETUSER <user> +evalsha")


def test_scripting_renamed_away_is_said_at_init_app(caplog: pytest.LogCaptureFixture) -> None:
    """A server that does not offer EVALSHA at all (renamed away, as a proxy or a managed
    service that disables scripting answers)."""
    server = RedisProcess(port=free_port(), args=["--rename-command", "EVALSHA", '""']).start()
    try:
        url = f"redis://127.0.0.1:{server.port}/0"
        with caplog.at_level(logging.WARNING):
            start(url)
    finally:
        server.stop()
    only_line(caplog, url, "does not offer a command the limiter needs", "unknown command")


def test_error_mode_refuses_to_start(
    guarded: RedisProcess, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"redis://:{SECRET}@127.0.0.1:{guarded.port}/0"
    with pytest.raises(StorageMisconfigured) as raised:
        start(url, DISTLIMIT_STARTUP_CHECK="error")
    text = str(raised.value)
    assert "WRONGPASS" in text and SECRET not in text and "redis://:***@127.0.0.1" in text
    assert "DISTLIMIT_STARTUP_CHECK = 'error'" in text
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(StorageUnavailable, match="cannot be reached"):
        start(unreachable, DISTLIMIT_STARTUP_CHECK="error")
    assert lines(caplog) == []


@pytest.mark.parametrize(
    "config",
    [
        pytest.param({"DISTLIMIT_STARTUP_CHECK": "off"}, id="off"),
        pytest.param({"DISTLIMIT_ENABLED": False}, id="disabled"),
        pytest.param(
            {"DISTLIMIT_ENABLED": False, "DISTLIMIT_STARTUP_CHECK": "error"}, id="disabled-error"
        ),
    ],
)
def test_off_and_disabled_make_no_call(
    caplog: pytest.LogCaptureFixture, config: dict[str, object]
) -> None:
    with caplog.at_level(logging.DEBUG):
        start(f"redis://127.0.0.1:{free_port()}/0", **config)
    assert lines(caplog) == []


def test_the_setting_is_checked() -> None:
    with pytest.raises(ConfigurationError, match="DISTLIMIT_STARTUP_CHECK = 'loud'"):
        start("memory://", DISTLIMIT_STARTUP_CHECK="loud")


def test_a_client_passed_in_that_could_stall_the_start_is_not_probed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No socket_timeout: a probe could wait for ever on a server that never answers."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        client = redis.Redis(port=silent.getsockname()[1], socket_timeout=None)
        with caplog.at_level(logging.WARNING):
            app = Flask("passed")
            app.config.update(SECRET_KEY="test-secret-" + "x" * 20)
            Limiter(app, storage=RedisStorage(client))
        client.close()
    assert lines(caplog) == []


def test_a_healthy_server_logs_nothing_and_keeps_nothing(
    redis_server: RedisProcess, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        start(redis_server.url, DISTLIMIT_STARTUP_CHECK="error")
    assert lines(caplog) == []
    assert redis_client.keys("ratelimit:{startup}*") == []  # a peek: nothing written


def test_a_healthy_cluster_logs_nothing(
    redis_cluster: ClusterServers, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        start(redis_cluster.url, DISTLIMIT_STARTUP_CHECK="error")
    assert lines(caplog) == []


@pytest.mark.slow
@pytest.mark.parametrize("full_coverage", [True, False], ids=["full-coverage", "partial"])
def test_cluster_slots_not_served_are_said_at_init_app(
    cluster_factory: Callable[..., ClusterServers],
    caplog: pytest.LogCaptureFixture,
    full_coverage: bool,
) -> None:
    """One primary stops serving its slots (``CLUSTER DELSLOTSRANGE``): with
    ``cluster-require-full-coverage yes`` it answers ``cluster_state:fail``; with ``no`` the
    cluster stays ``ok`` and only that primary's keys fail. The probe's own key may live on
    a healthy primary either way: the slots are asked for."""
    cluster = cluster_factory(primaries=3, replicas=0, full_coverage=full_coverage)
    primary = cluster.primary_nodes()[-1]
    client = primary.client()
    [(first, last)] = [
        (r[0], r[1]) for r in client.execute_command("CLUSTER", "SLOTS") if r[2][1] == primary.port
    ]
    client.execute_command("CLUSTER", "DELSLOTSRANGE", first, last)
    client.close()
    with caplog.at_level(logging.WARNING):
        start(cluster.url)
    [line] = lines(caplog)
    assert f"127.0.0.1:{primary.port} answers cluster_state:" in line
    assert f"{16384 - (last - first + 1)} of 16384 slots served" in line
    assert "redis-cli --cluster fix" in line and cluster.url.split("/")[2] in line


def test_a_worker_forked_after_the_probe_opens_its_own_connection(
    redis_server: RedisProcess, redis_client: redis.Redis
) -> None:
    """gunicorn --preload: the probe's connection stays the parent's."""
    name = f"probe-fork-{os.getpid()}"
    # a deadline a loaded machine meets: this is about whose connection it is, not about time
    app = start(f"{redis_server.url}?client_name={name}", DISTLIMIT_REDIS_TIMEOUT=2.0)

    def ours() -> list[str]:
        return [c["id"] for c in redis_client.client_list() if c["name"] == name]

    parent = ours()
    assert len(parent) == 2  # the probe's, and the side call telling the secret's tag
    done, told = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        status = 1
        try:
            with app.test_client() as client:
                response = client.get("/")
            ok = response.status_code == 200 and "X-RateLimit-Degraded" not in response.headers
            os.write(done[1], b"1" if ok else b"0")
            os.read(told[0], 1)  # stay alive while the parent looks
            status = 0
        finally:
            os._exit(status)
    try:
        assert os.read(done[0], 1) == b"1"  # counted by Redis in the child
        both = ours()
        assert len(both) == 3 and set(parent) < set(both)  # the child's own, beside the parent's
    finally:
        os.write(told[1], b"x")
        os.waitpid(pid, 0)
        for fd in (*done, *told):
            os.close(fd)
