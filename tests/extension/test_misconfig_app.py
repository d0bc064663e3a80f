"""A Flask app whose Redis refuses the limiter (an ACL user without EVALSHA, a wrong password, a
database index out of range, EVALSHA disabled) under each failure policy, through the test
client: never a 500; open answers 200 marked degraded, closed a problem+json 503, local enforces
the limits in-process; and the ERROR line that names the cause and the fix comes once a minute
(a fake clock, no sleeping). Real redis-server processes."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import pytest
from flask import Flask
from werkzeug.test import TestResponse

from flask_distlimit import Limiter
from flask_distlimit.testing import FakeClock
from tests.servers import RedisProcess, start_redis, start_redis_with_acl

pytestmark = pytest.mark.redis

PASSWORD = "adm1n-pw"
TEMPORARY = "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"
FAIL_MAX = 5  # the default: the breaker opens after 5 refusals
RESET = 30  # seconds the breaker stays open (DISTLIMIT_BREAKER_RESET_TIMEOUT)


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, RedisProcess]]:
    acl = start_redis_with_acl(
        PASSWORD, {"limited": ["on", ">pw", "~*", "+@all", "-evalsha", "-eval"]}
    )
    try:
        plain = start_redis("--rename-command", "EVALSHA", "")
    except BaseException:
        acl.stop()
        raise
    try:
        yield {"acl": acl, "no-evalsha": plain}
    finally:
        acl.stop()
        plain.stop()


Url = Callable[[dict[str, RedisProcess]], str]
MISCONFIGURED: list[tuple[str, Url, str]] = [
    ("noperm", lambda s: f"redis://limited:pw@127.0.0.1:{s['acl'].port}/0", "NOPERM"),
    ("wrongpass", lambda s: f"redis://:wrong@127.0.0.1:{s['acl'].port}/0", "WRONGPASS"),
    ("db 99", lambda s: f"redis://:{PASSWORD}@127.0.0.1:{s['acl'].port}/99", "DB index"),
    ("unknown command", lambda s: f"{s['no-evalsha'].url}", "unknown command 'EVALSHA'"),
]
CASES = [pytest.param(url, cause, id=name) for name, url, cause in MISCONFIGURED]


def make_app(url: str, policy: str, clock: FakeClock) -> Flask:
    app = Flask(f"misconfigured-{policy}")
    app.config.update(
        DISTLIMIT_STORAGE_URL=url,
        DISTLIMIT_FAILURE_POLICY=policy,
        DISTLIMIT_BREAKER_RESET_TIMEOUT=RESET,
        DISTLIMIT_REDIS_TIMEOUT=1.0,
        DISTLIMIT_TIERS={"anonymous": ""},
        DISTLIMIT_HEADERS="legacy",
    )
    limiter = Limiter(app, clock=clock)

    @app.get("/limited")
    @limiter.limit("3/minute", algorithm="fixed_window", key_func=lambda: "everyone")
    def limited() -> str:
        return "ok"

    return app


@pytest.fixture
def app_factory() -> Iterator[Callable[[str, str, FakeClock], Flask]]:
    made: list[Flask] = []

    def make(url: str, policy: str, clock: FakeClock) -> Flask:
        made.append(make_app(url, policy, clock))
        return made[-1]

    yield make
    for app in made:
        Limiter.state(app).storage.close()


def get(app: Flask, n: int) -> list[TestResponse]:
    client = app.test_client()
    return [client.get("/limited") for _ in range(n)]


def error_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize(("url", "cause"), CASES)
def test_policy_open_serves_everything_marked_degraded(
    servers: dict[str, RedisProcess],
    app_factory: Callable[[str, str, FakeClock], Flask],
    caplog: pytest.LogCaptureFixture,
    url: Url,
    cause: str,
) -> None:
    clock = FakeClock(start=1_700_000_040.0)
    app = app_factory(url(servers), "open", clock)
    with caplog.at_level(logging.ERROR):
        responses = get(app, 8)  # the breaker opens after FAIL_MAX: the others skip Redis
        assert [r.status_code for r in responses] == [200] * 8
        assert all(r.headers["X-RateLimit-Degraded"] == "true" for r in responses)
        [line] = error_lines(caplog)
        assert cause in line and "'open'" in line and "DISTLIMIT_STORAGE_URL" in line
        assert PASSWORD not in line
        clock.advance(RESET)  # the breaker's trial is refused again: within the minute, quiet
        assert [r.status_code for r in get(app, 3)] == [200] * 3
        assert len(error_lines(caplog)) == 1
        clock.advance(60 - RESET)  # a minute after the first line: the next trial says it again
        assert [r.status_code for r in get(app, 3)] == [200] * 3
        assert len(error_lines(caplog)) == 2


@pytest.mark.parametrize(("url", "cause"), CASES)
def test_policy_closed_answers_503_problem(
    servers: dict[str, RedisProcess],
    app_factory: Callable[[str, str, FakeClock], Flask],
    caplog: pytest.LogCaptureFixture,
    url: Url,
    cause: str,
) -> None:
    clock = FakeClock(start=1_700_000_040.0)
    app = app_factory(url(servers), "closed", clock)
    with caplog.at_level(logging.ERROR):
        responses = get(app, FAIL_MAX + 3)
    for response in responses:
        assert response.status_code == 503
        assert response.mimetype == "application/problem+json"
        assert response.get_json()["type"] == TEMPORARY
        assert int(response.headers["Retry-After"]) >= 1
        assert response.headers["X-RateLimit-Degraded"] == "true"
    [line] = error_lines(caplog)
    assert cause in line and "'closed'" in line


@pytest.mark.parametrize(("url", "cause"), CASES)
def test_policy_local_enforces_the_limits_in_process(
    servers: dict[str, RedisProcess],
    app_factory: Callable[[str, str, FakeClock], Flask],
    caplog: pytest.LogCaptureFixture,
    url: Url,
    cause: str,
) -> None:
    clock = FakeClock(start=1_700_000_040.0)
    app = app_factory(url(servers), "local", clock)
    with caplog.at_level(logging.ERROR):
        responses = get(app, 5)
        assert [r.status_code for r in responses] == [200, 200, 200, 429, 429]
        assert all(r.headers["X-RateLimit-Degraded"] == "true" for r in responses)
        assert [r.headers["X-RateLimit-Remaining"] for r in responses] == ["2", "1", "0", "0", "0"]
        clock.advance(60)  # a new window, locally too; and a new ERROR line
        assert [r.status_code for r in get(app, 4)] == [200, 200, 200, 429]
    lines = error_lines(caplog)
    assert len(lines) == 2
    assert all(cause in line and "'local'" in line for line in lines)


@pytest.mark.parametrize(("url", "cause"), CASES)
def test_health_says_what_is_refused(
    servers: dict[str, RedisProcess],
    app_factory: Callable[[str, str, FakeClock], Flask],
    url: Url,
    cause: str,
) -> None:
    app = app_factory(url(servers), "open", FakeClock())
    health = Limiter.state(app).health()
    assert health["ok"] is False
    assert health["error_type"] == "StorageMisconfigured"
    assert cause in str(health["error"])


@pytest.mark.parametrize(
    ("policy", "statuses"),
    [("open", [200] * 5), ("closed", [503] * 5), ("local", [200, 200, 200, 429, 429])],
)
def test_a_reply_the_limiter_cannot_read_gets_the_policy_never_a_500(
    servers: dict[str, RedisProcess],
    app_factory: Callable[[str, str, FakeClock], Flask],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    policy: str,
    statuses: list[int],
) -> None:
    """The real script on a real Redis answers an error reply (here: an argument with one field
    too many, as a bug would send): each request gets the failure policy, not a 500; the store
    answered, so the breaker stays closed; one ERROR line."""
    from flask_distlimit.storage import redis as redis_storage

    def one_field_too_many(*args: object, **kwargs: object) -> tuple[list[str], list[str]]:
        keys, argv = script_args(*args, **kwargs)
        return keys, [f"{argv[0]},7"]

    script_args = redis_storage.script_args
    monkeypatch.setattr(redis_storage, "script_args", one_field_too_many)
    server = servers["acl"]
    clock = FakeClock(start=1_700_000_040.0)
    app = app_factory(f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0", policy, clock)
    with caplog.at_level(logging.ERROR):
        responses = get(app, 5)
    assert [r.status_code for r in responses] == statuses
    assert all(
        r.headers["X-RateLimit-Degraded"] == "true" for r in responses if r.status_code == 200
    )
    if policy == "closed":
        assert all(r.mimetype == "application/problem+json" for r in responses)
    [line] = error_lines(caplog)
    assert "cannot read" in line and "expected 2 + 4" in line and repr(policy) in line
    breaker = Limiter.state(app).guard.breaker
    assert breaker.state == "closed" and breaker.failures == 0  # every call was answered


def test_an_operator_sees_replies_the_limiter_cannot_read(
    servers: dict[str, RedisProcess],
    app_factory: Callable[[str, str, FakeClock], Flask],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once error replies are no 500, nothing an operator watches showed them: the breaker
    stays closed (the store answered) and the health probe's own call is fine, so a bug or bad
    data that only some requests meet (here every other call) was an ERROR line a minute and
    ``degraded`` decisions that look like an outage. A Prometheus counter and the health report
    count every such reply and quote the last one."""
    from prometheus_client import CollectorRegistry

    from flask_distlimit.storage import redis as redis_storage
    from flask_distlimit.telemetry.metrics import metrics_for

    calls = [0]

    def every_other_call_wrong(*args: object, **kwargs: object) -> tuple[list[str], list[str]]:
        keys, argv = script_args(*args, **kwargs)
        calls[0] += 1
        return keys, [f"{argv[0]},7"] if calls[0] % 2 else argv

    script_args = redis_storage.script_args
    server = servers["acl"]
    clock = FakeClock(start=1_700_000_040.0)
    app = app_factory(f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0", "open", clock)
    guard = Limiter.state(app).guard
    registry = CollectorRegistry()
    guard.use_metrics(metrics_for(registry))
    assert guard.health()["unreadable_replies"] == 0
    monkeypatch.setattr(redis_storage, "script_args", every_other_call_wrong)
    responses = get(app, 2)  # the first call errs, the second is answered
    assert [r.status_code for r in responses] == [200, 200]
    assert responses[0].headers["X-RateLimit-Degraded"] == "true"
    assert "X-RateLimit-Degraded" not in responses[1].headers
    monkeypatch.setattr(redis_storage, "script_args", script_args)
    health = guard.health()
    assert health["ok"] is True  # the probe is answered: the store is up
    assert health["unreadable_replies"] == 1
    assert "expected 2 + 4" in str(health["unreadable_last"])
    assert registry.get_sample_value("distlimit_unreadable_replies_total") == 1.0
    assert guard.breaker.state == "closed" and guard.breaker.failures == 0


WRONG_SHAPES = ("fleet_from_reply", "given_back", "repaired_from_reply")


def test_calls_beside_and_after_the_request_never_raise_on_replies_the_limiter_cannot_read(
    servers: dict[str, RedisProcess],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every storage call that is not the request's own decision meets an error reply or a
    reply of the wrong shape, on a real Redis: the deferred charge of a ``deduct_when`` limit
    (after the response), the give-back of a concurrency slot (when the response closes), the
    instance heartbeat, and a lease's give-back and record. No exception reaches Flask (testing
    mode would raise it here instead of a 500), and each request is answered as usual. Each
    such reply is counted where an operator looks (``health()``), and all of them together log
    one ERROR line a minute, as the request's own do (they logged a traceback each: a heartbeat
    every 5 s, a lease's give-back up to 8 a second)."""
    from flask_distlimit.errors import StorageResponseError
    from flask_distlimit.resilience.lease import GIVE_BACK_AFTER_US
    from flask_distlimit.storage import redis as redis_storage
    from flask_distlimit.storage import side_calls  # where the side calls read their replies

    clock = FakeClock(start=1_700_000_040.0)
    app = Flask("unreadable-side-calls")
    app.testing = True  # an exception out of the limiter is raised, not turned into a 500
    app.config.update(
        DISTLIMIT_STORAGE_URL=f"redis://:{PASSWORD}@127.0.0.1:{servers['acl'].port}/0",
        DISTLIMIT_FAILURE_POLICY="open",
        DISTLIMIT_INSTANCES="auto",
        DISTLIMIT_TIERS={"anonymous": ""},
        SECRET_KEY="test-secret-" + "x" * 20,
    )
    limiter = Limiter(app, clock=clock)

    @app.post("/login")
    @limiter.limit("5/minute", key_func=lambda: "unread-login", deduct_when=lambda r: False)
    def login() -> str:
        return "ok"

    @app.get("/slot")
    @limiter.concurrency(10, scope="unread-slot")
    def slot() -> str:
        return "ok"

    @app.get("/hot")
    @limiter.limit("1000/minute", algorithm="fixed_window", key_func=lambda: "unread-hot", lease=8)
    def hot() -> str:
        return "ok"

    script_args = redis_storage.script_args

    def charges_and_releases_err(*args: object, **kwargs: object) -> tuple[list[str], list[str]]:
        keys, argv = script_args(*args, **kwargs)
        checks = args[0]
        assert isinstance(checks, list | tuple)
        for kind, met in (
            ("release", any(c.release and c.token for c in checks)),
            ("give-back", any(c.release and c.limit == 5 for c in checks)),
        ):
            if met:
                seen[kind] += 1
                return keys, [f"{argv[0]},7"]
        return keys, argv

    def wrong_shape(name: str) -> Callable[..., object]:
        def parse(*args: object, **kwargs: object) -> object:
            seen[name] += 1
            raise StorageResponseError("a reply of the wrong shape (injected)")

        return parse

    seen = dict.fromkeys(["release", "give-back", *WRONG_SHAPES], 0)
    monkeypatch.setattr(redis_storage, "script_args", charges_and_releases_err)
    for name in WRONG_SHAPES:
        monkeypatch.setattr(side_calls, name, wrong_shape(name))
    client = app.test_client()
    statuses = []
    caplog.set_level(logging.WARNING)
    for _ in range(3):
        statuses.append(client.post("/login").status_code)  # its give-back errs after it
        with client.get("/slot") as response:  # its slot's give-back errs: its lease frees it
            statuses.append(response.status_code)
        statuses.append(client.get("/hot").status_code)  # a lease taken and renewed
        clock.advance(GIVE_BACK_AFTER_US / 1_000_000 + 2)  # give-backs and records due
    assert statuses == [200] * 9
    assert all(seen.values()), seen  # each kind of call met a reply it cannot read
    assert limiter.state(app).guard.health()["unreadable_replies"] == sum(seen.values())
    [line] = error_lines(caplog)  # 9 s of the fake clock: one line
    assert "cannot read" in line
    # The dropped give-backs are side calls that failed: each counted, one WARNING line for all.
    dropped = [r.getMessage() for r in caplog.records if "after-response charge" in r.getMessage()]
    assert len(dropped) == 1 and "not decide" in dropped[0] and "down" not in dropped[0]
    assert limiter.state(app).guard.health()["side_call_failures"] == 3
    monkeypatch.setattr(redis_storage, "script_args", script_args)
    # The give-backs that met an error reply were dropped (logged): their reservations stay.
    response = client.post("/login")  # reserved and given back: 3 of 5 stay taken
    assert (response.status_code, response.headers["X-RateLimit-Remaining"]) == (200, "2")
