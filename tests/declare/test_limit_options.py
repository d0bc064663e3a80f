"""The decorator options Flask-Limiter users reach for (issue 12): ``methods``,
``override_defaults``, a limit's own ``on_breach`` and ``error_message``, ``scope`` as a
callable, and the Limiter-wide ``request_filter``; on memory, fakeredis and a real redis-server.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import pytest
from flask import Blueprint, Flask, Response, request

from flask_distlimit import Breach, ConfigurationError, Limiter
from flask_distlimit.storage.base import Storage
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import backend, clock, make_app

__all__ = ["backend", "clock"]  # fixtures used below

Backend = Callable[[], Storage]


def statuses(app: Flask, path: str, n: int, method: str = "GET", **kwargs: Any) -> list[int]:
    client = app.test_client()
    return [client.open(path, method=method, **kwargs).status_code for _ in range(n)]


def test_methods_limits_only_those_methods(backend: Backend, clock: FakeClock) -> None:
    app, limiter, _ = make_app(backend(), clock)

    @app.route("/items", methods=["GET", "POST"])
    @limiter.limit("2/minute", methods=["post"])
    def items() -> str:
        return "items"

    assert statuses(app, "/items", 5) == [200] * 5
    assert statuses(app, "/items", 3, method="POST") == [200, 200, 429]


def test_a_get_limit_also_limits_head_which_runs_the_same_view(
    backend: Backend, clock: FakeClock
) -> None:
    """Flask answers HEAD with the GET view (the body is computed, then dropped). A limit
    declared for GET that let HEAD through unlimited gave an attacker the status of every
    lookup (user enumeration) and the view's whole cost, with no quota at all."""
    app, limiter, _ = make_app(backend(), clock)
    runs: list[str] = []

    @app.get("/users/<name>")
    @limiter.limit("3/minute", methods=["GET"])
    def lookup(name: str) -> tuple[str, int]:
        runs.append(name)
        return ("found", 200) if name == "alice" else ("no such user", 404)

    client = app.test_client()
    probes = [client.head(f"/users/u{i}").status_code for i in range(5)]
    assert probes == [404, 404, 404, 429, 429]
    assert len(runs) == 3
    assert client.get("/users/alice").status_code == 429  # one quota for GET and HEAD


def test_methods_of_a_route_fall_back_to_the_defaults_for_other_methods(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_DEFAULT_LIMITS="3/minute")

    @app.route("/items", methods=["GET", "POST"])
    @limiter.limit("1/minute", methods=["POST"])
    def items() -> str:
        return "items"

    assert statuses(app, "/items", 2, method="POST") == [200, 429]
    assert statuses(app, "/items", 4) == [200, 200, 200, 429]


def test_methods_of_a_limit_on_the_app_limit_only_those_methods(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(backend(), clock)
    limiter.limit("1/minute", methods=["POST"])(app)  # a default limit, for POST only

    @app.route("/items", methods=["GET", "POST"])
    def items() -> str:
        return "items"

    assert statuses(app, "/items", 3) == [200] * 3
    assert statuses(app, "/items", 2, method="POST") == [200, 429]


def test_override_defaults_false_keeps_the_defaults(backend: Backend, clock: FakeClock) -> None:
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_DEFAULT_LIMITS="2/minute")

    @app.get("/both")
    @limiter.limit("5/minute", override_defaults=False)
    def both() -> str:
        return "both"

    @app.get("/own")
    @limiter.limit("5/minute")
    def own() -> str:
        return "own"

    assert statuses(app, "/both", 3) == [200, 200, 429]  # the default's 2/minute applies too
    assert statuses(app, "/own", 6) == [200] * 5 + [429]  # replaced, as by default


def test_a_blueprint_limit_can_keep_the_defaults(backend: Backend, clock: FakeClock) -> None:
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_DEFAULT_LIMITS="2/minute")
    bp = Blueprint("api", __name__)
    limiter.limit("5/minute", override_defaults=False)(bp)

    @bp.get("/a")
    def a() -> str:
        return "a"

    app.register_blueprint(bp, url_prefix="/api")
    assert statuses(app, "/api/a", 3) == [200, 200, 429]


def test_a_limit_own_on_breach_and_error_message(backend: Backend, clock: FakeClock) -> None:
    app, limiter, _ = make_app(backend(), clock)
    app_wide: list[Breach] = []
    own: list[Breach] = []
    limiter.on_breach(app_wide.append)

    def login_breach(breach: Breach) -> Response:
        own.append(breach)
        return Response("slow down, " + ",".join(breach.violated_policies), status=429)

    @app.post("/login")
    @limiter.limit("1/minute", on_breach=login_breach)
    def login() -> str:
        return "ok"

    @app.get("/search")
    @limiter.limit("1/minute", error_message="Search is limited to one query a minute.")
    def search() -> str:
        return "ok"

    @app.get("/report")
    @limiter.limit("1/minute", error_message=lambda: f"Reports for {request.args['who']}.")
    def report() -> str:
        return "ok"

    client = app.test_client()
    client.post("/login")
    refused = client.post("/login")
    assert (refused.status_code, refused.get_data(as_text=True)) == (
        429,
        "slow down, login:1/minute",
    )
    assert len(own) == 1 and len(app_wide) == 1  # both told; the limit's response is sent
    client.get("/search")
    problem = client.get("/search").get_json()
    assert problem["detail"] == "Search is limited to one query a minute."
    assert len(app_wide) == 2
    client.get("/report?who=ann")
    assert client.get("/report?who=ann").get_json()["detail"] == "Reports for ann."


def test_an_error_message_callable_that_fails_keeps_the_standard_detail(
    backend: Backend, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    app, limiter, _ = make_app(backend(), clock)

    @app.get("/x")
    @limiter.limit("1/minute", error_message=lambda: 1 / 0)  # type: ignore[arg-type, return-value]
    def x() -> str:
        return "x"

    client = app.test_client()
    client.get("/x")
    with caplog.at_level(logging.ERROR, logger="flask_distlimit"):
        refused = client.get("/x")
    assert refused.status_code == 429
    assert "detail" in refused.get_json()
    assert any("error_message" in r.getMessage() for r in caplog.records)


def test_request_filter_exempts_a_request_from_every_limit(
    backend: Backend, clock: FakeClock
) -> None:
    limiter = Limiter(clock=clock, request_filter=lambda: request.headers.get("X-Probe") == "1")
    app, _, _ = make_app(
        backend(),
        clock,
        limiter=limiter,
        DISTLIMIT_GLOBAL_LIMITS="2/minute",
        DISTLIMIT_DEFAULT_LIMITS="2/minute",
    )

    @limiter.request_filter
    def internal() -> bool:
        return request.remote_addr == "10.9.9.9"

    @app.get("/health")
    def health() -> str:
        return "ok"

    probe = {"X-Probe": "1"}
    assert statuses(app, "/health", 5, headers=probe) == [200] * 5
    assert "X-RateLimit-Limit" not in app.test_client().get("/health", headers=probe).headers
    assert statuses(app, "/missing", 4, headers=probe) == [404] * 4  # no view: still exempt
    internal_ip = {"REMOTE_ADDR": "10.9.9.9"}
    assert statuses(app, "/health", 4, environ_base=internal_ip) == [200] * 4
    assert statuses(app, "/health", 3) == [200, 200, 429]


def test_a_request_filter_that_raises_does_not_exempt(
    backend: Backend, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    limiter = Limiter(clock=clock, request_filter=lambda: 1 / 0)  # type: ignore[arg-type, return-value]
    app, _, _ = make_app(backend(), clock, limiter=limiter, DISTLIMIT_DEFAULT_LIMITS="1/minute")

    @app.get("/x")
    def x() -> str:
        return "x"

    with caplog.at_level(logging.ERROR, logger="flask_distlimit"):
        assert statuses(app, "/x", 2) == [200, 429]
    assert any("request filter" in r.getMessage() for r in caplog.records)


def test_scope_as_a_callable_of_the_endpoint(backend: Backend, clock: FakeClock) -> None:
    app, limiter, _ = make_app(backend(), clock)
    by_area = limiter.shared_limit("2/minute", scope=lambda endpoint: endpoint.split("_")[0])

    @app.get("/books/list")
    @by_area
    def books_list() -> str:
        return "list"

    @app.get("/books/get")
    @by_area
    def books_get() -> str:
        return "get"

    @app.get("/music/list")
    @by_area
    def music_list() -> str:
        return "music"

    assert statuses(app, "/books/list", 1) == [200]
    assert statuses(app, "/books/get", 2) == [200, 429]  # one "books" counter
    assert statuses(app, "/music/list", 2) == [200, 200]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"methods": "POST"}, "methods="),
        ({"methods": []}, "methods=\\[\\]"),
        ({"deduct_when": 3}, "deduct_when"),
        ({"on_breach": "x"}, "on_breach"),
        ({"error_message": 5}, "error_message"),
        ({"settle": 7}, "settle"),
        ({"unit": "bytes"}, "unit='bytes'.*content-bytes"),
        ({"settle": lambda r: 1, "lease": True}, "lease= cannot be combined with .*settle="),
        ({"unit": "content-bytes", "lease": 5}, "lease= cannot be combined with .*unit="),
    ],
)
def test_bad_options_are_refused_at_declaration(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Limiter().limit("1/minute", **kwargs)


def test_shared_limit_and_concurrency_take_limit_s_options_with_its_defaults() -> None:
    """The options are read by name from the method's arguments (declare.options), so the
    three signatures must agree: a stray parameter would be ignored, a missing one a KeyError."""

    def options(method: Callable[..., object]) -> dict[str, object]:
        parameters = inspect.signature(method).parameters.values()
        return {p.name: p.default for p in parameters if p.kind is p.KEYWORD_ONLY}

    limit = options(Limiter.limit)
    assert options(Limiter.shared_limit) == {k: v for k, v in limit.items() if k != "scope"}
    assert options(Limiter.concurrency).keys() <= limit.keys()
    limiter = Limiter()
    view = limiter.concurrency(3, scope="pool", on_failure="closed")(lambda: "x")
    (spec,) = limiter.registry.views[view]
    assert (spec.kind, spec.algorithm, spec.scope, spec.on_failure) == (
        "shared",
        "concurrency",
        "pool",
        "closed",
    )
    assert (spec.unit, spec.per_method, spec.lease, spec.shadow) == (
        "requests",
        False,
        False,
        False,
    )


def test_a_request_filter_must_be_callable() -> None:
    with pytest.raises(ConfigurationError, match="request_filter"):
        Limiter(request_filter="yes")  # type: ignore[arg-type]


def test_override_defaults_false_on_a_route_keeps_its_blueprint_limits(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(backend(), clock)
    bp = Blueprint("api", __name__)
    limiter.limit("2/minute")(bp)

    @bp.get("/both")
    @limiter.limit("5/minute", override_defaults=False)
    def both() -> str:
        return "both"

    @bp.get("/own")
    @limiter.limit("5/minute")
    def own() -> str:
        return "own"

    app.register_blueprint(bp, url_prefix="/api")
    assert statuses(app, "/api/both", 3) == [200, 200, 429]
    assert statuses(app, "/api/own", 6) == [200] * 5 + [429]


def test_a_scope_callable_that_fails_names_the_limit_at_the_first_request(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(backend(), clock)

    @app.get("/x")
    @limiter.shared_limit("2/minute", scope=lambda endpoint: "")
    def x() -> str:
        return "x"

    app.testing = True
    with pytest.raises(ConfigurationError, match="non-empty string"):
        app.test_client().get("/x")
