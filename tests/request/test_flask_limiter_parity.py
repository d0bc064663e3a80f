"""What a team moving from Flask-Limiter meets on the wire and in its error handlers (issue 33,
items 10-12): the behaviour adopted from Flask-Limiter, and the differences the migration guide
names, each pinned here on memory://, fakeredis and a real redis-server."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from flask import Flask, request
from werkzeug.exceptions import TooManyRequests

from flask_distlimit import Limiter
from flask_distlimit.errors import ConfigurationError
from flask_distlimit.storage.base import Storage
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import backend, clock, make_app

__all__ = ["backend", "clock"]

Backend = Callable[[], Storage]


def app_with(backend: Backend, clock: FakeClock, **config: Any) -> tuple[Flask, Limiter]:
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_ALGORITHM="sliding_window_log", **config)
    return app, limiter


def described(app: Flask) -> list[str]:
    """What ``e.description`` said in the app's ``errorhandler(429)``, per refusal."""
    said: list[str] = []

    @app.errorhandler(429)
    def too_many(e: TooManyRequests) -> tuple[str, int]:
        said.append(str(e.description))
        return "slow down", 429

    return said


# -- item 12: e.description is Flask-Limiter's -------------------------------------------------


def test_the_description_is_the_refused_rate_as_flask_limiter_words_it(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter = app_with(backend, clock, DISTLIMIT_DEFAULT_LIMITS="1/day")
    said = described(app)

    @app.get("/default")
    def default() -> str:
        return "ok"

    @app.get("/half-minute")
    @limiter.limit("1/30 seconds;100/hour")
    def half_minute() -> str:
        return "ok"

    client = app.test_client()
    for path in ["/default", "/half-minute"]:
        assert client.get(path).status_code == 200
        assert client.get(path).status_code == 429
    assert said == ["1 per 1 day", "1 per 30 second"]


def test_the_description_is_the_error_message_when_the_limit_has_one(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter = app_with(backend, clock)
    said = described(app)

    @app.get("/search")
    @limiter.limit("1/hour", error_message=lambda: f"Slow down, {request.args['who']}")
    def search() -> str:
        return "ok"

    client = app.test_client()
    client.get("/search?who=ada")
    assert client.get("/search?who=ada").status_code == 429
    assert said == ["Slow down, ada"]


def test_the_problem_body_keeps_its_detail_beside_the_description(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter = app_with(backend, clock)

    @app.get("/search")
    @limiter.limit("1/hour")
    def search() -> str:
        return "ok"

    client = app.test_client()
    client.get("/search")
    body = client.get("/search").get_json()
    assert body["detail"].startswith("Rate limit search:1/hour: retry in ")
    assert body["violated-policies"] == ["search:1/hour"]


# -- item 10: Retry-After is a refusal's header ------------------------------------------------


def test_an_admitted_response_carries_no_retry_after(backend: Backend, clock: FakeClock) -> None:
    app, limiter = app_with(backend, clock, DISTLIMIT_HEADERS="both")

    @app.get("/search")
    @limiter.limit("5/hour")
    def search() -> str:
        return "ok"

    response = app.test_client().get("/search")
    assert response.status_code == 200
    assert response.headers["X-RateLimit-Remaining"] == "4"
    assert "Retry-After" not in response.headers


def test_a_views_own_retry_after_is_left_as_the_view_wrote_it(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter = app_with(backend, clock)
    when = "Wed, 21 Oct 2037 07:28:00 GMT"

    @app.get("/maintenance")
    @limiter.limit("5/hour")
    def maintenance() -> tuple[str, int, dict[str, str]]:
        return "back soon", 503, {"Retry-After": when}

    response = app.test_client().get("/maintenance")
    assert response.status_code == 503
    assert response.headers.getlist("Retry-After") == [when]


def test_a_refusal_carries_retry_after_even_with_the_headers_off(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter = app_with(backend, clock, DISTLIMIT_HEADERS="none")

    @app.get("/search")
    @limiter.limit("1/hour")
    def search() -> str:
        return "ok"

    client = app.test_client()
    admitted = client.get("/search")
    assert "X-RateLimit-Limit" not in admitted.headers
    refused = client.get("/search")
    assert refused.status_code == 429
    assert 3590 <= int(refused.headers["Retry-After"]) <= 3600
    assert "X-RateLimit-Limit" not in refused.headers


# -- item 11: the headers say what the admission decided ---------------------------------------


def test_remaining_is_the_admissions_figure_not_recounted_after_the_view(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter = app_with(backend, clock)

    @app.get("/report")
    @limiter.limit("5/hour")
    def report() -> str:
        if "inner" not in request.args:  # another request of the client, while this one runs
            inner = app.test_client().get("/report?inner=1")
            assert inner.headers["X-RateLimit-Remaining"] == "3"
        return "ok"

    response = app.test_client().get("/report")
    assert response.status_code == 200
    assert response.headers["X-RateLimit-Remaining"] == "4"  # Flask-Limiter would say 3


# -- item 14: default limits with options ------------------------------------------------------


def test_a_default_limit_declared_on_the_app_takes_exempt_when_and_cost(
    backend: Backend, clock: FakeClock
) -> None:
    """``default_limits_exempt_when`` / ``default_limits_cost``, ported as a limit declared on
    the app: its exemption lifts the default limit only, never the route's own limit (which
    ``request_filter`` would also lift)."""
    app, limiter = app_with(backend, clock)
    internal = lambda: request.headers.get("X-Internal") == "1"  # noqa: E731
    limiter.limit("4/hour", exempt_when=internal, cost=lambda: 2)(app)

    @app.get("/default")
    def default() -> str:
        return "ok"

    @app.get("/own")
    @limiter.limit("3/hour")
    def own() -> str:
        return "ok"

    client = app.test_client()
    # the default costs 2: two requests spend it
    assert [client.get("/default").status_code for _ in range(3)] == [200, 200, 429]
    # exempt from the default limit, not from limits at all
    assert [client.get("/default", headers={"X-Internal": "1"}).status_code] == [200]
    # a route with limits of its own does not meet the default; exempt_when does not lift them
    codes = [client.get("/own", headers={"X-Internal": "1"}).status_code for _ in range(4)]
    assert codes == [200, 200, 200, 429]


def test_a_default_limit_declared_on_the_app_can_count_only_some_responses(
    backend: Backend, clock: FakeClock
) -> None:
    """``default_limits_deduct_when``, ported as a limit declared on the app."""
    app, limiter = app_with(backend, clock)
    limiter.limit("2/hour", deduct_when=lambda r: r.status_code >= 400)(app)

    @app.get("/item/<int:n>")
    def item(n: int) -> tuple[str, int]:
        return "ok", 200 if n else 404

    client = app.test_client()
    assert [client.get("/item/1").status_code for _ in range(3)] == [200, 200, 200]
    assert [client.get("/item/0").status_code for _ in range(3)] == [404, 404, 429]


def test_a_limit_declared_on_the_app_after_it_served_is_refused(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter = app_with(backend, clock)

    @app.get("/")
    def index() -> str:
        return "ok"

    app.test_client().get("/")
    with pytest.raises(ConfigurationError, match=r"app .app. .* served its first request"):
        limiter.limit("1/hour")(app)
