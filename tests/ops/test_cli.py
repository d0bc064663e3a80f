"""``flask distlimit status | inspect | reset`` through Flask's CLI runner, on memory:// and on a
real redis-server."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence

import pytest
import redis
from click.testing import Result
from flask import Flask
from flask.testing import FlaskCliRunner

from flask_distlimit import Limiter
from flask_distlimit.cli import distlimit_cli
from flask_distlimit.core.decision import Check, Evaluation
from flask_distlimit.errors import StorageResponseError
from flask_distlimit.storage.base import Storage
from flask_distlimit.storage.memory import MemoryStorage
from tests.servers import RedisProcess, free_port, start_redis_with_acl

BACKENDS = [
    pytest.param("memory", id="memory"),
    pytest.param("redis", marks=pytest.mark.redis, id="redis"),
]


def make_app(storage_url: str, **config: object) -> Flask:
    app = Flask(__name__)
    app.config.update(
        TESTING=True,
        SECRET_KEY="cli-test",
        DISTLIMIT_STORAGE_URL=storage_url,
        # Exact algorithms with no window boundary a test could straddle.
        DISTLIMIT_ALGORITHM="sliding_window_log",
        DISTLIMIT_TIERS={"anonymous": "100/hour", "pro": "1000/hour"},
        DISTLIMIT_KEY_PREFIX="clitest",
        # These tests read what a request stored: a first call (connect, load the script) that
        # missed the default 100 ms on a loaded machine failed open and stored nothing (seen
        # once in CI). Deadlines have tests of their own (test_deadline.py).
        DISTLIMIT_REDIS_TIMEOUT=5.0,
    )
    app.config.update(config)
    limiter = Limiter()

    @limiter.api_key_verifier
    def verify(raw: str) -> str | None:
        return "pro" if raw == "sesame" else None

    @app.get("/search")
    @limiter.limit("5/hour")
    def search() -> str:
        return "ok"

    @app.post("/login")
    @limiter.limit("3/hour", key_func=lambda: "account:alice", algorithm="token_bucket")
    def login() -> str:
        return "ok"

    limiter.init_app(app)
    return app


@pytest.fixture(params=BACKENDS)
def app(request: pytest.FixtureRequest) -> Iterator[Flask]:
    url = "memory://"
    if request.param == "redis":
        client: redis.Redis = request.getfixturevalue("redis_client")
        url = f"redis://127.0.0.1:{client.connection_pool.connection_kwargs['port']}/0"
    application = make_app(url)
    yield application
    application.extensions["distlimit"].storage.close()


@pytest.fixture
def runner(app: Flask) -> FlaskCliRunner:
    return app.test_cli_runner()


def rows(runner: FlaskCliRunner, *args: str) -> dict[str, dict[str, object]]:
    result = runner.invoke(distlimit_cli, ["inspect", *args, "--json"])
    assert result.exit_code == 0, result.output
    return {row["limit"]: row for row in json.loads(result.output)}


def test_status_reports_storage_latency_breaker_and_scripts(
    app: Flask, runner: FlaskCliRunner
) -> None:
    app.test_client().get("/search")  # loads the script on Redis
    result = runner.invoke(distlimit_cli, ["status"])
    assert result.exit_code == 0, result.output
    assert "breaker:           closed" in result.output
    assert "scripts loaded:    yes" in result.output
    assert " ms (PING round trip)" in result.output
    report = json.loads(runner.invoke(distlimit_cli, ["status", "--json"]).output)
    assert report["ok"] is True
    assert report["storage_url"] == app.config["DISTLIMIT_STORAGE_URL"]
    assert report["key_prefix"] == "clitest"


def test_status_of_an_unreachable_redis_fails_and_hides_the_password() -> None:
    app = make_app(f"redis://:s3cret@127.0.0.1:{free_port()}/0")
    try:
        result = app.test_cli_runner().invoke(distlimit_cli, ["status"])
    finally:
        app.extensions["distlimit"].storage.close()
    assert result.exit_code == 1
    assert "unreachable" in result.output
    assert "s3cret" not in result.output
    assert "redis://:***@127.0.0.1" in result.output


def failed_status(app: Flask) -> tuple[Result, str]:
    """``status`` of ``app``, which must fail cleanly: exit 1, no traceback; answers the result
    and its one ``error:`` line."""
    try:
        result = app.test_cli_runner().invoke(distlimit_cli, ["status"])
    finally:
        app.extensions["distlimit"].storage.close()
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)  # not an exception that escaped
    assert "Traceback" not in result.output
    [line] = [line for line in result.output.splitlines() if line.startswith("error:")]
    return result, line


def test_status_of_an_unreachable_redis_says_why_in_one_line() -> None:
    result, line = failed_status(make_app(f"redis://127.0.0.1:{free_port()}/0"))
    assert "Redis is unavailable" in line
    assert "latency:           unreachable" in result.output


@pytest.fixture(scope="module")
def acl_server() -> Iterator[RedisProcess]:
    server = start_redis_with_acl(
        "adm1n-pw", {"limited": ["on", ">pw", "~*", "+@all", "-evalsha", "-eval"]}
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.redis
def test_status_of_a_redis_refusing_the_password_says_how_to_fix_it(
    acl_server: RedisProcess,
) -> None:
    result, line = failed_status(make_app(f"redis://:wrong-pw@127.0.0.1:{acl_server.port}/0"))
    assert "WRONGPASS" in line and "Fix the user name and password" in line
    assert "latency:           refused (misconfigured)" in result.output
    assert "wrong-pw" not in result.output


@pytest.mark.redis
def test_status_of_a_redis_refusing_the_script_says_how_to_fix_it(
    acl_server: RedisProcess,
) -> None:
    """PING works for this ACL user; the status check's evaluation of cost 0 does not."""
    result, line = failed_status(make_app(f"redis://limited:pw@127.0.0.1:{acl_server.port}/0"))
    assert "NOPERM" in line and "'evalsha'" in line and "ACL SETUSER" in line
    assert " ms (PING round trip)" in result.output


class _Broken(MemoryStorage):
    """A storage that fails its evaluations: with an error reply, or with a bug of its own."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def evaluate(self, checks: Sequence[Check], *, now_us: int | None = None) -> Evaluation:
        raise self.error


@pytest.mark.parametrize(
    ("error", "says"),
    [
        (StorageResponseError("Redis answered with an error: oops"), "answered with an error"),
        (RuntimeError("a bug\nover two lines"), "unexpected RuntimeError from the storage"),
    ],
)
def test_status_of_any_other_storage_failure_says_it_in_one_line(
    error: Exception, says: str
) -> None:
    app = Flask(__name__)
    app.config.update(SECRET_KEY="cli-test")
    storage: Storage = _Broken(error)
    Limiter(app, storage=storage)
    _, line = failed_status(app)
    assert says in line


def test_inspect_shows_usage_per_limit_and_consumes_nothing(
    app: Flask, runner: FlaskCliRunner
) -> None:
    client = app.test_client()
    for _ in range(3):
        assert client.get("/search").status_code == 200
    for _ in range(2):
        assert client.post("/login").status_code == 200
    for _ in range(3):  # peeking again and again changes nothing
        found = rows(runner, "ip:127.0.0.1")
    assert set(found) == {"tier-anonymous:100/hour", "search:5/hour"}
    assert found["search:5/hour"]["used"] == 3
    assert found["search:5/hour"]["remaining"] == 2
    assert found["tier-anonymous:100/hour"]["used"] == 5
    login = rows(runner, "func:account:alice")  # a key_func's value: a key space of its own
    assert login["login:3/hour"]["used"] == 2
    assert login["login:3/hour"]["algorithm"] == "token_bucket"
    # Exactly the two units the peeks left are still there.
    assert [client.get("/search").status_code for _ in range(3)] == [200, 200, 429]
    text = runner.invoke(distlimit_cli, ["inspect", "ip:127.0.0.1"]).output
    assert "search:5/hour" in text and "5/5" in text


def test_inspect_all_lists_limits_not_used_yet(runner: FlaskCliRunner) -> None:
    assert rows(runner, "ip:192.0.2.1") == {}
    listed = rows(runner, "ip:192.0.2.1", "--all")
    assert {"tier-anonymous:100/hour", "tier-pro:1000/hour", "search:5/hour"} <= set(listed)
    assert all(row["used"] == 0 and row["stored"] is False for row in listed.values())
    # only the limits that count such an identity: an account's key_func value is not an address
    assert "login:3/hour" not in listed
    assert set(rows(runner, "func:account:bob", "--all")) == {"login:3/hour"}


def test_inspect_normalizes_addresses_and_digests_api_keys(
    app: Flask, runner: FlaskCliRunner
) -> None:
    client = app.test_client()
    response = client.get("/search", environ_base={"REMOTE_ADDR": "2001:db8:1:2::7"})
    assert response.headers["X-RateLimit-Remaining"] == "4"  # counted, not failed open
    found = rows(runner, "--ip", "2001:db8:1:2:ffff::1")  # the same /64
    assert found["search:5/hour"]["used"] == 1
    # an address copied from a log as ip:<address>, a port or brackets with it: the same client
    for pasted in ("ip:2001:db8:1:2::7", "ip:[2001:db8:1:2::9]:443", "ip:2001:db8:1:2::/64"):
        assert rows(runner, pasted)["search:5/hour"]["used"] == 1, pasted
    typo = runner.invoke(distlimit_cli, ["inspect", "--ip", "2001:db8:1:2::7x"])
    assert typo.exit_code == 2 and "is no address" in typo.output  # not the shared ip:invalid
    client.get("/search", headers={"X-Api-Key": "sesame"})
    keyed = rows(runner, "--api-key", "sesame")
    assert keyed["tier-pro:1000/hour"]["used"] == 1
    text = runner.invoke(distlimit_cli, ["inspect", "--api-key", "sesame"]).output
    assert "sesame" not in text and "apikey:" in text


def test_reset_forgets_one_client_only(app: Flask, runner: FlaskCliRunner) -> None:
    client = app.test_client()
    for _ in range(5):
        client.get("/search")
        client.get("/search", environ_base={"REMOTE_ADDR": "192.0.2.9"})
    assert client.get("/search").status_code == 429
    dry = runner.invoke(distlimit_cli, ["reset", "ip:127.0.0.1", "--dry-run"])
    assert "2 key(s) would be deleted" in dry.output
    assert client.get("/search").status_code == 429  # a dry run deletes nothing
    result = runner.invoke(distlimit_cli, ["reset", "ip:127.0.0.1"])
    assert result.exit_code == 0, result.output
    assert "Deleted 2 key(s) of ip:127.0.0.1" in result.output
    assert client.get("/search").status_code == 200
    other = client.get("/search", environ_base={"REMOTE_ADDR": "192.0.2.9"})
    assert other.status_code == 429


def test_reset_one_limit_by_name(app: Flask, runner: FlaskCliRunner) -> None:
    client = app.test_client()
    for _ in range(5):
        client.get("/search")
    result = runner.invoke(distlimit_cli, ["reset", "ip:127.0.0.1", "--limit", "search"])
    assert result.exit_code == 0, result.output
    assert "Deleted 1 key(s)" in result.output
    found = rows(runner, "ip:127.0.0.1")
    assert set(found) == {"tier-anonymous:100/hour"}
    assert found["tier-anonymous:100/hour"]["used"] == 5


def test_an_identity_without_a_kind_is_refused_with_the_func_form(runner: FlaskCliRunner) -> None:
    for command in ("inspect", "reset"):
        result = runner.invoke(distlimit_cli, [command, "account:alice"])
        assert result.exit_code == 2
        assert "func:account:alice" in result.output and "names no kind" in result.output


def test_reset_an_unknown_limit_names_the_choices(runner: FlaskCliRunner) -> None:
    result = runner.invoke(distlimit_cli, ["reset", "ip:127.0.0.1", "--limit", "serch"])
    assert result.exit_code == 2
    assert "No limit named 'serch'" in result.output
    assert "search:5/hour" in result.output


@pytest.mark.redis
def test_reset_scans_and_never_sends_keys(redis_client: redis.Redis) -> None:
    port = redis_client.connection_pool.connection_kwargs["port"]
    # every call keeps its reply under a token: reset must leave those to expire
    app = make_app(f"redis://127.0.0.1:{port}/0", DISTLIMIT_REQUEST_TOKENS="always")
    try:
        client = app.test_client()
        for _ in range(3):
            client.get("/search")
        redis_client.config_resetstat()
        runner = app.test_cli_runner()
        assert runner.invoke(distlimit_cli, ["inspect", "ip:127.0.0.1"]).exit_code == 0
        assert runner.invoke(distlimit_cli, ["reset", "ip:127.0.0.1"]).exit_code == 0
        stats = redis_client.info("commandstats")
        kept_ms = app.extensions["distlimit"].storage.tokens.ttl_ms  # max(1 s, 2 x timeout)
    finally:
        app.extensions["distlimit"].storage.close()
    assert "cmdstat_scan" in stats
    assert "cmdstat_keys" not in stats
    # Nothing is left but the requests' tokens (their replies, kept a while for a retry) and
    # the tag of the secret the process started with (kept 120 s: identity.digests).
    left = [k for k in redis_client.keys("*") if not k.startswith(b"clitest:identity-secrets")]
    assert left and all(b":rq:{" in k for k in left)
    assert kept_ms == 10_000
    assert all(0 < redis_client.pttl(k) <= kept_ms for k in left)


def test_an_app_without_a_limiter_gets_a_clear_error() -> None:
    result = Flask(__name__).test_cli_runner().invoke(distlimit_cli, ["status"])
    assert result.exit_code == 1
    assert "has no Limiter" in result.output


@pytest.mark.parametrize("enabled", [True, False])
def test_status_says_whether_limiting_is_enabled(enabled: bool) -> None:
    app = make_app("memory://", DISTLIMIT_ENABLED=enabled)
    runner = app.test_cli_runner()
    result = runner.invoke(distlimit_cli, ["status"])
    assert result.exit_code == 0, result.output
    line = "yes" if enabled else "no (DISTLIMIT_ENABLED is False)"
    assert result.output.splitlines()[0] == f"enabled:           {line}"
    report = json.loads(runner.invoke(distlimit_cli, ["status", "--json"]).output)
    assert report["enabled"] is enabled
