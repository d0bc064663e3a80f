"""``DISTLIMIT_DEFAULT_LIMITS`` takes what ``limiter.limit`` takes (issue 26): a limit string, a
callable answering one per request, or a mapping tier -> limit string. Flask-Limiter's
``default_limits`` takes callables; a port used to have to declare them route by route.

Each case runs on memory, fakeredis and a real redis-server (the ``backend`` fixture).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from flask import Flask, g, request

from flask_distlimit import ConfigurationError, Limiter
from flask_distlimit.storage.base import Storage
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import backend, clock, make_app

__all__ = ["backend", "clock"]  # fixtures used below

Backend = Callable[[], Storage]


def statuses(app: Flask, path: str, n: int, **kwargs: Any) -> list[int]:
    client = app.test_client()
    return [client.get(path, **kwargs).status_code for _ in range(n)]


def routes(app: Flask, limiter: Limiter) -> None:
    @app.get("/a")
    def a() -> str:
        return "a"

    @app.get("/b")
    def b() -> str:
        return "b"

    @app.get("/own")
    @limiter.limit("1/minute")
    def own() -> str:
        return "own"


def test_a_callable_default_is_asked_per_request_after_the_hooks(
    backend: Backend, clock: FakeClock
) -> None:
    plans = {"acme": "2/minute", "initech": "3/minute"}
    asked: list[str] = []

    def plan() -> str:
        asked.append(g.tenant)
        return plans[g.tenant]

    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_DEFAULT_LIMITS=plan)
    routes(app, limiter)

    @app.before_request
    def tenant() -> None:
        g.tenant = request.headers.get("X-Tenant", "acme")

    acme, initech = {"X-Tenant": "acme"}, {"X-Tenant": "initech"}
    assert statuses(app, "/a", 3, headers=acme) == [200, 200, 429]
    assert statuses(app, "/b", 3, headers=acme) == [200, 200, 429]  # per route, as strings are
    # another identity (a different client address) on its own plan
    other = {"REMOTE_ADDR": "192.0.2.7"}
    assert statuses(app, "/a", 4, headers=initech, environ_base=other) == [200] * 3 + [429]
    assert statuses(app, "/own", 2, headers=acme) == [200, 429]  # a route's own limit wins
    assert set(asked) == {"acme", "initech"}


def test_a_mapping_default_follows_the_request_tier(backend: Backend, clock: FakeClock) -> None:
    app, limiter, _ = make_app(
        backend(),
        clock,
        DISTLIMIT_TIERS={"anonymous": "", "pro": ""},
        DISTLIMIT_DEFAULT_LIMITS={"pro": "3/minute", "*": "1/minute"},
    )
    routes(app, limiter)

    @limiter.identity_loader
    def user() -> tuple[str, str | None] | None:
        name = request.headers.get("X-User")
        return (name, request.headers.get("X-Tier")) if name else None

    pro = {"X-User": "bob", "X-Tier": "pro"}
    assert statuses(app, "/a", 4, headers=pro) == [200] * 3 + [429]
    assert statuses(app, "/a", 2) == [200, 429]  # anonymous: the "*" entry


def test_a_string_default_still_works(backend: Backend, clock: FakeClock) -> None:
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_DEFAULT_LIMITS="2/minute;10/month")
    routes(app, limiter)
    assert statuses(app, "/a", 3) == [200, 200, 429]


@pytest.mark.parametrize(
    ("value", "named"),
    [
        (["20/hour"], "a limit string"),
        ({"pro": "banana"}, "'pro'"),
        ({}, "at least one tier"),
        (42, "a callable answering one"),
    ],
)
def test_a_bad_default_is_refused_at_init_app_saying_what_it_takes(
    value: object, named: str
) -> None:
    app = Flask("bad-default")
    app.config.update(SECRET_KEY="default-values-" + "x" * 20, DISTLIMIT_DEFAULT_LIMITS=value)
    with pytest.raises(ConfigurationError, match="DISTLIMIT_DEFAULT_LIMITS") as info:
        Limiter(app)
    assert named in str(info.value)


def test_a_mapping_default_the_algorithm_cannot_enforce_is_refused_at_init_app() -> None:
    app = Flask("log-default")
    app.config.update(
        SECRET_KEY="default-values-" + "x" * 20,
        DISTLIMIT_ALGORITHM="sliding_window_log",
        DISTLIMIT_DEFAULT_LIMITS={"*": "5000/day"},
    )
    with pytest.raises(ConfigurationError, match="sliding_window_log"):
        Limiter(app)
