"""HEAD counts as GET wherever a method is part of a limit's identity, an OPTIONS that a view
answers itself is limited like any other request, and a request that costs more than its route
limit still counts against the global and tier limits (issue 24, findings 6, 9 and 10), on
memory, fakeredis and a real redis-server.

Flask answers HEAD with the GET view (``MethodView.get`` when the class has no ``head``), so a
limit counted per method would give HEAD a counter of its own and let the view run twice its
quota. Flask's own OPTIONS answer and a CORS preflight answered by flask-cors keep their
treatment: global limits only (``DISTLIMIT_CHARGE_PREFLIGHTS`` counts them on the route too).
A request no route matched has a method the client may have made up: a limit that runs for it
is bound once for every method.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
from flask import Flask, request
from flask.views import MethodView

from flask_distlimit import Limiter
from flask_distlimit.storage.base import Storage
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import backend, clock, make_app

__all__ = ["backend", "clock"]  # fixtures used below

Backend = Callable[[], Storage]


def _alternate(app: Flask, path: str, n: int) -> list[tuple[str, int]]:
    client = app.test_client()
    out = []
    for i in range(n):
        method = "HEAD" if i % 2 else "GET"
        out.append((method, client.open(path, method=method).status_code))
    return out


def test_a_methodview_get_limit_counts_head_in_the_same_quota(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(backend(), clock)
    ran: list[str] = []

    class Report(MethodView):
        @limiter.limit("3/minute")
        def get(self) -> str:
            ran.append("get")
            return "an expensive report"

    app.add_url_rule("/report", view_func=Report.as_view("report"))
    codes = [code for _, code in _alternate(app, "/report", 8)]
    assert codes == [200] * 3 + [429] * 5
    assert len(ran) == 3  # before: 6, HEAD had a counter of its own


def test_per_method_counts_head_as_get(backend: Backend, clock: FakeClock) -> None:
    app, limiter, _ = make_app(backend(), clock)

    @app.route("/items", methods=["GET", "POST"])
    @limiter.limit("3/minute", per_method=True)
    def items() -> str:
        return "items"

    assert [code for _, code in _alternate(app, "/items", 6)] == [200] * 3 + [429] * 3
    assert app.test_client().post("/items").status_code == 200  # POST has a counter of its own


PREFLIGHT = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}


def test_an_options_to_a_view_that_answers_options_is_limited_like_any_request(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(
        backend(), clock, DISTLIMIT_GLOBAL_LIMITS="100/minute", DISTLIMIT_TIERS={"anonymous": ""}
    )
    ran: list[str] = []

    @app.route("/search", methods=["POST", "OPTIONS"])  # the view answers OPTIONS itself
    @limiter.limit("3/minute")
    def search() -> str:
        ran.append("search")
        return "an expensive search"

    class Items(MethodView):
        @limiter.limit("3/minute")
        def options(self) -> str:
            ran.append("items")
            return "items"

    app.add_url_rule("/items", view_func=Items.as_view("items"))
    client = app.test_client()
    for path in ("/search", "/items"):
        codes = [client.options(path, headers=PREFLIGHT).status_code for _ in range(5)]
        assert codes == [200] * 3 + [429] * 2, path
    assert len(ran) == 6  # before: 10, every such OPTIONS skipped the route's limit


def test_flask_and_flask_cors_preflights_keep_counting_against_the_global_limits_only(
    backend: Backend, clock: FakeClock
) -> None:
    from flask_cors import CORS, cross_origin

    app, limiter, counting = make_app(
        backend(), clock, DISTLIMIT_GLOBAL_LIMITS="100/minute", DISTLIMIT_TIERS={"anonymous": ""}
    )
    CORS(app, resources={r"/auto": {"origins": "*"}})

    @app.post("/auto")  # Flask answers OPTIONS, flask-cors adds its headers
    @limiter.limit("3/minute")
    def auto() -> str:
        return "auto"

    @app.post("/decorated")
    @cross_origin()  # flask-cors answers the preflight itself: the view never runs
    @limiter.limit("3/minute")
    def decorated() -> str:
        return "decorated"

    client = app.test_client()
    for path in ("/auto", "/decorated"):
        answers = [client.options(path, headers=PREFLIGHT) for _ in range(5)]
        assert [r.status_code for r in answers] == [200] * 5, path
        assert all("Access-Control-Allow-Origin" in r.headers for r in answers)
    assert counting.evaluations == 10  # each counted against the global limit
    for path in ("/auto", "/decorated"):  # the routes' quotas are whole
        assert [client.post(path).status_code for _ in range(4)] == [200] * 3 + [429], path


def test_a_request_costing_more_than_its_limit_still_counts_against_global_and_tier_limits(
    backend: Backend, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    app, limiter, _ = make_app(
        backend(),
        clock,
        DISTLIMIT_GLOBAL_LIMITS="5/minute",
        DISTLIMIT_TIERS={"anonymous": "8/minute"},
    )

    @app.post("/batch")
    @limiter.limit("10/minute", cost=lambda: int(request.args.get("n", "1")))
    def batch() -> str:
        return "done"

    client = app.test_client()
    with caplog.at_level(logging.INFO, logger="flask_distlimit"):
        refused = [client.post("/batch?n=100") for _ in range(20)]
    assert [r.status_code for r in refused] == [429] * 20
    assert "Retry-After" not in refused[0].headers  # it can never pass
    assert "Retry-After" in refused[5].headers  # the global limit refuses from the 6th on
    assert "global" in refused[5].get_json()["violated-policies"][0]
    assert client.post("/batch?n=1").status_code == 429  # the flood spent the per-IP budget
    lines = [r.getMessage() for r in caplog.records if "costing 100" in r.getMessage()]
    assert len(lines) == 1, lines  # before: one INFO line per request


def test_a_tier_limit_counts_requests_that_cost_more_than_their_route_limit(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_TIERS={"anonymous": "3/minute"})

    @app.post("/batch")
    @limiter.limit("10/minute", cost=lambda: int(request.args.get("n", "1")))
    def batch() -> str:
        return "done"

    client = app.test_client()
    assert [client.post("/batch?n=11").status_code for _ in range(3)] == [429] * 3
    assert client.post("/batch?n=1").status_code == 429  # the tier's 3 are spent
    clock.advance(120)
    assert client.post("/batch?n=1").status_code == 200


@pytest.mark.parametrize("declared", ["wrapper", "with"])
def test_a_limit_that_runs_for_a_request_no_route_matched_counts_every_method_together(
    backend: Backend, clock: FakeClock, declared: str
) -> None:
    """A limit wrapper (a helper the app's hook calls) or a ``with limiter.limit(...)`` block
    that runs for a 404 or a 405 was bound for the method the client sent, which no route
    vouches for (gunicorn passes any 3-20 letter token): each made-up method got a counter of
    its own under ``per_method``, and the process kept every wrapper's binding, a few KB per
    method, without end. Such a request's limits now count every method in one counter."""
    app, limiter, counting = make_app(backend(), clock)

    @limiter.limit("3/minute", per_method=True)
    def authenticate() -> None:
        return None

    @app.before_request
    def hook() -> None:
        if declared == "wrapper":
            authenticate()
        else:
            with limiter.limit("3/minute", per_method=True):
                pass

    app.add_url_rule("/", "index", lambda: "ok")
    client = app.test_client()
    codes = [client.open(f"/missing{i}", method=f"M{i:04d}").status_code for i in range(6)]
    assert codes == [404] * 3 + [429] * 3  # before: 404 every time, a fresh counter per method
    assert len({c.key for checks in counting.checks for c in checks}) == 1
    for i in range(6, 50):
        client.open(f"/missing{i}", method=f"M{i:04d}")
    carried = Limiter.state(app).enforcer._planner._carried
    assert len(carried) <= 1  # before: one binding kept per method (wrapper)
    # A routed request still counts per method, as per_method says.
    assert [client.open("/", method="GET").status_code for _ in range(4)] == [200] * 3 + [429]
    assert client.open("/", method="OPTIONS").status_code == 200


@pytest.mark.parametrize("shadow", [False, True], ids=["refused", "shadow"])
def test_a_made_up_method_reaches_the_refusal_log_line_escaped(
    backend: Backend, clock: FakeClock, caplog: pytest.LogCaptureFixture, shadow: bool
) -> None:
    """The werkzeug and gevent.pywsgi servers pass any request-line word as the method, control
    characters and all (gunicorn passes tokens only); a 405 that the global limit refuses (or
    would, in shadow) wrote it raw into the INFO line: an ESC sequence cleared an operator's
    terminal. It is quoted now, as log_text quotes what a client may have chosen."""
    app, _, _ = make_app(
        backend(), clock, DISTLIMIT_GLOBAL_LIMITS="1/minute", DISTLIMIT_SHADOW=shadow
    )
    app.add_url_rule("/", "index", lambda: "ok")
    client = app.test_client()
    forged = "G\x1b[2J\x1b]0;owned\x07\nINFO forged"
    with caplog.at_level(logging.INFO, logger="flask_distlimit"):
        codes = [client.open("/", method=forged).status_code for _ in range(2)]
    assert codes == [405, 405 if shadow else 429]
    heads = ("Rate limit exceeded", "Shadow rate limit would have refused")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(heads)]
    assert len(lines) == 1, lines
    assert "\x1b" not in lines[0] and "\n" not in lines[0] and "\x07" not in lines[0]
    assert repr(forged.upper()) in lines[0]


def test_a_tier_reaches_the_refusal_log_line_escaped(
    backend: Backend, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """With no tier table a tier is any text an identity hook (here the tier resolver) or a
    token's claim gives, which may come from what a client sent: it was written raw into the
    refusal's INFO line."""
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_TIERS={})  # no tier table
    forged = "pro\x1b[2J\nINFO forged"
    limiter.tier_resolver(lambda identity: forged)
    app.add_url_rule("/", "index", limiter.limit("1/minute")(lambda: "ok"))
    client = app.test_client()
    with caplog.at_level(logging.INFO, logger="flask_distlimit"):
        codes = [client.get("/").status_code for _ in range(2)]
    assert codes == [200, 429]
    lines = [r.getMessage() for r in caplog.records if "Rate limit exceeded" in r.getMessage()]
    assert len(lines) == 1 and "\x1b" not in lines[0] and "\n" not in lines[0], lines
    assert f"tier {forged!r}," in lines[0]
