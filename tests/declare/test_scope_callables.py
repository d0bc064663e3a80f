"""A ``scope`` callable that reads the request (issue 26): Flask-Limiter calls one per request (its
"dynamic shared limit" recipe, ``scope=lambda endpoint: request.host``); here a scope is bound
once per route, which put every host in the first host's bucket without a word. Such a callable
is now refused when declared, with the port spelled out; the port runs, per host, on every
backend. A callable that answers from the endpoint alone keeps working (test_limit_options.py).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from flask import Flask, g, request

from flask_distlimit import ConfigurationError, Limiter
from flask_distlimit.storage.base import Storage
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import backend, clock, make_app

__all__ = ["backend", "clock"]  # fixtures used below

Backend = Callable[[], Storage]


def test_flask_limiters_dynamic_shared_limit_recipe_is_refused_with_the_port() -> None:
    limiter = Limiter()
    with pytest.raises(ConfigurationError) as info:
        limiter.shared_limit("100/hour", scope=lambda endpoint: request.host)
    message = str(info.value)
    assert "reads the request" in message and "bound once per route" in message
    assert "scope='per-host', key_func=lambda: request.host" in message
    assert "migrating-from-flask-limiter.md" in message


@pytest.mark.parametrize(
    "scope",
    [
        lambda endpoint: g.tenant,
        lambda endpoint: f"{endpoint}:{request.method}",
    ],
    ids=["g", "request.method"],
)
def test_a_scope_callable_reading_the_request_context_is_refused_on_limit_too(
    scope: Callable[[str], str],
) -> None:
    with pytest.raises(ConfigurationError, match="reads the request"):
        Limiter().limit("1/minute", scope=scope)


def test_a_scope_callable_declared_inside_a_request_is_refused() -> None:
    app = Flask("inside")
    with app.test_request_context("/"), pytest.raises(ConfigurationError, match="inside a request"):
        Limiter().shared_limit("1/minute", scope=lambda endpoint: endpoint)


def test_a_scope_callable_of_the_endpoint_and_a_string_scope_are_accepted() -> None:
    limiter = Limiter()
    limiter.shared_limit("1/minute", scope=lambda endpoint: endpoint.split(".")[0])
    limiter.shared_limit("1/minute", scope={"a.x": "a"}.__getitem__)  # KeyError: decided later
    limiter.shared_limit("1/minute", scope="search")


def test_the_port_counts_each_host_apart_shared_among_its_routes(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(backend(), clock)
    # the port the refusal spells out
    per_host = limiter.shared_limit("2/minute", scope="per-host", key_func=lambda: request.host)

    @app.get("/a")
    @per_host
    def a() -> str:
        return "a"

    @app.get("/b")
    @per_host
    def b() -> str:
        return "b"

    client = app.test_client()

    def get(path: str, host: str) -> int:
        return client.get(path, base_url=f"http://{host}").status_code

    assert [get("/a", "one.example"), get("/b", "one.example"), get("/a", "one.example")] == [
        200,
        200,
        429,
    ]
    assert [get("/b", "two.example"), get("/a", "two.example")] == [200, 200]  # its own
    assert get("/b", "two.example") == 429


def test_a_scope_callable_of_the_endpoint_is_asked_when_bound_not_per_request(
    backend: Backend, clock: FakeClock
) -> None:
    """Flask-Limiter asks a scope callable on every request; here it is asked when a route's
    limits are bound (and once at declaration, to find one that reads the request), so its
    count does not grow with the traffic. The endpoints it names share the counter."""
    app, limiter, _ = make_app(backend(), clock)
    asked: list[str] = []

    def family(endpoint: str) -> str:
        asked.append(endpoint)
        return "family"

    shared = limiter.shared_limit("3/minute", scope=family)

    @app.get("/t1")
    @shared
    def t1() -> str:
        return "t1"

    @app.get("/t2")
    @shared
    def t2() -> str:
        return "t2"

    client = app.test_client()
    assert [client.get("/t1").status_code for _ in range(2)] == [200, 200]
    after_first_requests = len(asked)
    assert {"t1", "t2"} <= set(asked)
    assert [client.get("/t2").status_code for _ in range(2)] == [200, 429]  # one counter
    assert [client.get("/t1").status_code for _ in range(5)] == [429] * 5
    assert len(asked) == after_first_requests
