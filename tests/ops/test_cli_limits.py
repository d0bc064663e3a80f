"""``flask distlimit limits``: every endpoint's limits from the app's own declarations, through
Flask's CLI runner (issue 12). Nothing is read from the storage, so memory:// suffices."""

from __future__ import annotations

import json

import pytest
from flask import Blueprint, Flask, g

from flask_distlimit import Limiter
from flask_distlimit.cli import distlimit_cli


def make_app() -> Flask:
    app = Flask(__name__)
    app.config.update(
        SECRET_KEY="cli-limits-test",
        DISTLIMIT_GLOBAL_LIMITS="600/minute",
        DISTLIMIT_TIERS={"anonymous": "60/minute", "pro": "1000/minute"},
        DISTLIMIT_DEFAULT_LIMITS="100/hour",
        DISTLIMIT_ALGORITHM="sliding_window_counter",
    )
    limiter = Limiter()

    @app.post("/login")
    @limiter.limit(
        "5/minute",
        deduct_when=lambda r: r.status_code == 401,
        algorithm="fixed_window",
        on_failure="closed",
    )
    def login() -> str:
        return "ok"

    @app.get("/orders")
    @limiter.limit(lambda: "10/minute", key_func=lambda: g.tenant)
    def orders() -> str:
        return "ok"

    @app.post("/complete")
    @limiter.limit("100000/day", cost=lambda: 500, settle=lambda response: g.tokens_used)
    def complete() -> str:
        return "ok"

    @app.get("/download")
    @limiter.limit("2000000000/hour", unit="content-bytes")
    def download() -> str:
        return "ok"

    @app.get("/health")
    @limiter.exempt
    def health() -> str:
        return "ok"

    @app.get("/plain")
    def plain() -> str:
        return "ok"

    api = Blueprint("api", __name__)
    limiter.limit({"free": "10/minute", "*": "1/minute"}, algorithm="gcra")(api)

    @api.get("/items")
    def items() -> str:
        return "ok"

    app.register_blueprint(api, url_prefix="/api")
    limiter.init_app(app)
    return app


def test_limits_lists_every_endpoint_with_its_limits() -> None:
    app = make_app()
    result = app.test_cli_runner().invoke(distlimit_cli, ["limits", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    by = {(r["endpoint"], r["methods"], r["limit"]): r for r in rows}
    login = by[("login", "POST", "login:5/minute")]
    assert (login["algorithm"], login["key"], login["on_failure"], login["notes"]) == (
        "fixed_window",
        "identity",
        "closed",
        "deduct_when",
    )
    orders = by[("orders", "GET", "orders:make_app.<locals>.<lambda>()")]
    assert orders["key"].startswith("key_func ")
    assert orders["notes"] == "per identity (callable)"
    assert orders["on_failure"] == "open"
    items = by[("api.items", "GET", "api.items:{free=10/minute, *=1/minute}")]
    assert (items["algorithm"], items["notes"]) == ("gcra", "per tier")
    assert ("health", "GET", "exempt") in by
    complete = by[("complete", "POST", "complete:100000/day")]
    assert complete["notes"] == "settle, cost callable"
    download = by[("download", "GET", "download:2000000000/hour content-bytes")]
    assert download["notes"] == "content-bytes"
    assert by[("plain", "GET", "plain:100/hour")]["algorithm"] == "sliding_window_counter"
    assert by[("*", "*", "global:600/minute")]["key"] == "client ip"
    assert ("*", "*", "tier-pro:1000/minute") in by


def test_limits_prints_a_table() -> None:
    app = make_app()
    result = app.test_cli_runner().invoke(distlimit_cli, ["limits"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split()[:4] == ["Endpoint", "Methods", "Rule", "Limit"]
    login = next(line for line in lines if line.startswith("login "))
    assert login.split()[:6] == [
        "login",
        "POST",
        "/login",
        "login:5/minute",
        "fixed_window",
        "identity",
    ]
    assert "deduct_when" in login
    assert any(line.split()[:4] == ["health", "GET", "/health", "exempt"] for line in lines)


def test_limits_without_a_limiter_says_how_to_set_it_up() -> None:
    app = Flask("bare")
    result = app.test_cli_runner().invoke(distlimit_cli, ["limits"])
    assert result.exit_code == 1
    assert "init_app" in result.output


def listed(app: Flask, *args: str) -> set[tuple[object, object, object]]:
    result = app.test_cli_runner().invoke(distlimit_cli, ["limits", *args, "--json"])
    assert result.exit_code == 0, result.output
    return {(r["endpoint"], r["methods"], r["limit"]) for r in json.loads(result.output)}


EVERY_REQUEST = {
    ("*", "*", "global:600/minute"),
    ("*", "*", "tier-anonymous:60/minute"),
    ("*", "*", "tier-pro:1000/minute"),
}


def test_limits_of_one_endpoint_keep_the_limits_of_every_request() -> None:
    assert listed(make_app(), "--endpoint", "login") == {
        *EVERY_REQUEST,
        ("login", "POST", "login:5/minute"),
    }


def test_limits_of_a_path_are_those_of_the_endpoint_it_reaches() -> None:
    app = make_app()
    assert listed(app, "--path", "/api/items?page=2") == {
        *EVERY_REQUEST,
        ("api.items", "GET", "api.items:{free=10/minute, *=1/minute}"),
    }
    assert listed(app, "--path", "/login", "--method", "post") == {
        *EVERY_REQUEST,
        ("login", "POST", "login:5/minute"),
    }


def test_limits_of_one_method_list_only_that_method() -> None:
    rows = listed(make_app(), "--method", "POST")
    assert {r[1] for r in rows} == {"*", "POST"}
    assert ("login", "POST", "login:5/minute") in rows


def test_limits_of_head_are_those_of_get() -> None:
    """HEAD requests meet the GET limits (Flask answers them with the GET view): listing HEAD
    showed the route unlimited."""
    app = make_app()
    assert listed(app, "--method", "HEAD") == listed(app, "--method", "GET")
    assert any(r[1] == "GET" for r in listed(app, "--method", "HEAD"))


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--endpoint", "nope"], "no endpoint 'nope'"),
        (["--path", "/nope"], "GET /nope reaches no view of the app (404 Not Found)"),
        (["--path", "/login"], "GET /login reaches no view of the app (405 Method Not Allowed)"),
        (["--path", "/login", "--endpoint", "login"], "either --endpoint or --path"),
        (["--endpoint", "login", "--method", "GET"], "The endpoint 'login' takes no GET"),
    ],
)
def test_limits_filters_that_match_nothing_say_so(args: list[str], said: str) -> None:
    result = make_app().test_cli_runner().invoke(distlimit_cli, ["limits", *args])
    assert result.exit_code == 2
    assert said in " ".join(result.output.split())
