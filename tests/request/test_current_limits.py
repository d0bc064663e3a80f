"""``limiter.current_limits`` and ``limiter.clear(name)`` inside a request (issue 12), on
memory, fakeredis and a real redis-server."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
from flask import Flask, jsonify, request
from flask.typing import ResponseReturnValue

from flask_distlimit import Limiter
from flask_distlimit.storage.base import Storage
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import backend, clock, make_app
from tests.servers import start_redis

__all__ = ["backend", "clock"]  # fixtures used below

Backend = Callable[[], Storage]


def test_current_limits_lists_every_evaluated_limit(backend: Backend, clock: FakeClock) -> None:
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_GLOBAL_LIMITS="100/minute")
    seen: list[Any] = []

    @app.get("/quota")
    @limiter.limit("3/minute;10/hour")
    def quota() -> ResponseReturnValue:
        seen.append(limiter.current_limits)
        return jsonify({lim.name: lim.remaining for lim in limiter.current_limits})

    client = app.test_client()
    body = client.get("/quota").get_json()
    assert body == {"global:100/minute": 99, "quota:3/minute": 2, "quota:10/hour": 9}
    first = {lim.name: lim for lim in seen[0]}
    assert first["quota:3/minute"].limit == 3
    assert not any(lim.denied for lim in seen[0])
    assert first["quota:3/minute"].reset_at == pytest.approx(
        clock.time() + first["quota:3/minute"].reset_after
    )


def test_current_limits_in_an_error_handler_names_the_denied_limit(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(backend(), clock)

    @app.errorhandler(429)
    def too_many(exc: Exception) -> ResponseReturnValue:
        return jsonify(denied=[lim.name for lim in limiter.current_limits if lim.denied]), 429

    @app.get("/x")
    @limiter.limit("1/minute")
    def x() -> str:
        return "x"

    client = app.test_client()
    client.get("/x")
    assert client.get("/x").get_json() == {"denied": ["x:1/minute"]}


def test_current_limits_outside_a_request_is_empty() -> None:
    assert Limiter().current_limits == []
    app = Flask("bare")
    with app.test_request_context():
        assert Limiter().current_limits == []  # no limiter on this app


def test_current_limit_is_the_one_the_headers_describe_as_in_flask_limiter(
    backend: Backend, clock: FakeClock
) -> None:
    """Flask-Limiter's ``limiter.current_limit``, read in views and 429 handlers, was no
    attribute here: a 500."""
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_GLOBAL_LIMITS="100/minute")

    def told() -> dict[str, object] | None:
        one = limiter.current_limit
        return None if one is None else {"name": one.name, "left": one.remaining, "no": one.denied}

    @app.errorhandler(429)
    def too_many(exc: Exception) -> ResponseReturnValue:
        return jsonify(told()), 429

    @app.get("/quota")
    @limiter.limit("2/minute;10/hour")
    def quota() -> ResponseReturnValue:
        return jsonify(told())

    @app.get("/free")
    def free() -> ResponseReturnValue:
        return jsonify(told())

    client = app.test_client()
    first = client.get("/quota")
    assert first.get_json() == {"name": "quota:2/minute", "left": 1, "no": False}
    assert first.headers["X-RateLimit-Remaining"] == "1"  # the limit the headers describe
    assert client.get("/quota").get_json() == {"name": "quota:2/minute", "left": 0, "no": False}
    refused = {"name": "quota:2/minute", "left": 0, "no": True}
    assert client.get("/quota").get_json() == refused  # decided by the storage
    assert client.get("/quota").get_json() == refused  # by the deny cache, no storage call
    # a refused request is charged nowhere: the global limit counted the two admitted and this
    assert client.get("/free").get_json() == {"name": "global:100/minute", "left": 97, "no": False}
    assert Limiter().current_limit is None  # outside a request


def login_app(backend: Backend, clock: FakeClock) -> tuple[Flask, Limiter]:
    app, limiter, _ = make_app(backend(), clock)

    @app.post("/login")
    @limiter.limit(
        "3/minute",
        key_func=lambda: request.form.get("user"),  # per account: what a success may clear
        deduct_when=lambda response: response.status_code == 401,
    )
    def login() -> ResponseReturnValue:
        if request.form.get("password") == "right":
            limiter.clear("login")  # a successful login forgets the account's failed attempts
            return "welcome"
        return "no", 401

    @app.get("/other")
    @limiter.limit("1/minute")
    def other() -> str:
        return str(limiter.clear("nothing-here"))

    return app, limiter


def test_clear_resets_the_login_limit_after_a_success(backend: Backend, clock: FakeClock) -> None:
    app, _ = login_app(backend, clock)
    client = app.test_client()

    def post(password: str) -> int:
        return client.post("/login", data={"user": "alice", "password": password}).status_code

    assert [post("wrong"), post("wrong"), post("right")] == [401, 401, 200]
    # Cleared: three failures again before the quota is spent.
    assert [post("wrong"), post("wrong"), post("wrong"), post("right")] == [401, 401, 401, 429]


def test_clear_only_touches_the_current_identity(backend: Backend, clock: FakeClock) -> None:
    app, _ = login_app(backend, clock)
    alice = app.test_client()
    bob = app.test_client()

    def post(client: Any, password: str, user: str) -> int:
        return client.post("/login", data={"user": user, "password": password}).status_code

    assert [post(bob, "wrong", "bob") for _ in range(3)] == [401] * 3
    assert post(alice, "right", "alice") == 200  # clears alice's counter only
    assert post(bob, "right", "bob") == 429


def test_clear_of_an_unknown_name_says_which_names_exist(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter = login_app(backend, clock)
    app.testing = True
    with pytest.raises(ValueError, match=r"other:1/minute"):
        app.test_client().get("/other")
    with pytest.raises(RuntimeError, match="inside a request"), app.app_context():
        limiter.clear("login")


@pytest.mark.parametrize("config", [{"DISTLIMIT_ENABLED": False}, {}], ids=["off", "on"])
def test_clear_of_a_limit_not_counted_for_this_request_is_a_no_op(
    backend: Backend, clock: FakeClock, config: dict[str, Any]
) -> None:
    app, limiter, _ = make_app(backend(), clock, **config)
    cleared: list[int] = []

    @app.post("/login")
    @limiter.limit("3/minute", exempt_when=lambda: request.form.get("skip") == "1")
    def login() -> str:
        cleared.append(limiter.clear("login"))
        return "welcome"

    client = app.test_client()
    assert client.post("/login", data={"skip": "1"}).status_code == 200
    assert cleared == [0]  # skipped by exempt_when (or limits off): nothing to clear


@pytest.mark.parametrize("policy", ["open", "closed", "local"])
def test_clear_after_the_storage_died_under_the_view_is_0_never_a_500(
    policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The login recipe's clear() on a success, with Redis gone between the request's check and
    the clear: the response stands, the clear counts as a failed side call (an attack review
    met a 500 under every policy)."""
    server = start_redis()
    app = Flask(__name__)
    app.config.update(
        DISTLIMIT_STORAGE_URL=server.url, DISTLIMIT_FAILURE_POLICY=policy, SECRET_KEY="s" * 32
    )
    limiter = Limiter(app)

    @app.post("/login")
    @limiter.limit("5/minute", key_func=lambda: "alice", deduct_when=lambda r: r.status_code == 401)
    def login() -> str:
        server.stop()  # kill -9, inside the view
        return str(limiter.clear("login"))

    try:
        with caplog.at_level(logging.WARNING, logger="flask_distlimit"):
            response = app.test_client().post("/login")
        assert (response.status_code, response.get_data()) == (200, b"0")
        assert "limiter.clear('login')" in caplog.text
        assert limiter.health(app)["side_call_failures"] >= 1
    finally:
        server.stop()
        limiter.state(app).storage.close()
