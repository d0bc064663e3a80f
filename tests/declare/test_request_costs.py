"""What a request costs, as an attacker of the limiter would probe it (issue 10, findings 4, 6, 7).

Conditional requests cannot make limits free, a request that can never pass is refused at once
without a false ``Retry-After``, bad callables and numbers are refused before any request, and
CORS preflights are not charged to route quotas. On memory, fakeredis and a real redis-server.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable

import pytest
from flask import Flask, Response, g, make_response, request

from flask_distlimit import Breach, ConfigurationError, Limiter
from flask_distlimit.storage.base import Storage
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import backend, clock, make_app

__all__ = ["backend", "clock"]  # fixtures used below

Backend = Callable[[], Storage]
ETAG = {"If-None-Match": '"v1"'}


def test_a_conditional_header_makes_no_post_and_no_global_limit_free(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(
        backend(), clock, DISTLIMIT_CONDITIONAL_COST=0, DISTLIMIT_GLOBAL_LIMITS="8/minute"
    )

    @app.route("/login", methods=["GET", "POST"])
    @limiter.limit("3/minute", key_func=lambda: request.form.get("username", "-"))
    def login() -> str:
        return "ok"

    client = app.test_client()
    posts = [
        client.post("/login", data={"username": "alice"}, headers=ETAG).status_code
        for _ in range(4)
    ]
    assert posts == [200, 200, 200, 429]  # POST: the conditional cost does not apply
    # A conditional GET answered by a full 200 is charged its whole cost on the route limit
    # (after the response) and 1 on the global limit: the 4th GET meets a spent route quota.
    gets = [client.get("/login", headers=ETAG).status_code for _ in range(4)]
    assert gets == [200] * 3 + [429]


def test_only_a_304_is_free_a_conditional_header_alone_is_not(
    backend: Backend, clock: FakeClock
) -> None:
    """With ``DISTLIMIT_CONDITIONAL_COST=0`` a revalidation that the view answers with 304 is
    free on route limits; but the header is the client's claim: ``If-None-Match: "bogus"`` on
    every request got every full response free, and the route limit never applied."""
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_CONDITIONAL_COST=0)

    @app.get("/search")
    @limiter.limit("3/minute")
    def search() -> Response:
        response = make_response("results")
        response.set_etag("v1")
        return response.make_conditional(request)

    @app.get("/login")
    @limiter.limit("3/minute", deduct_when=lambda response: response.status_code >= 400)
    def login() -> tuple[str, int]:
        return "who?", 401

    client = app.test_client()
    revalidations = [client.get("/search", headers=ETAG).status_code for _ in range(5)]
    assert revalidations == [304] * 5  # free
    bogus = {"If-None-Match": '"bogus"'}
    assert [client.get("/search", headers=bogus).status_code for _ in range(4)] == [200] * 3 + [429]
    assert client.get("/search", headers=ETAG).status_code == 429  # the quota is spent
    assert [client.get("/login", headers=bogus).status_code for _ in range(4)] == [401] * 3 + [429]


def test_a_request_that_costs_more_than_the_limit_is_refused_at_once_and_honestly(
    backend: Backend, clock: FakeClock
) -> None:
    breaches: list[Breach] = []
    app, limiter, counting = make_app(backend(), clock, DISTLIMIT_GLOBAL_LIMITS="100/minute")
    limiter.on_breach(lambda b: breaches.append(b) or None)

    @app.post("/batch")
    @limiter.limit("100/minute", cost=lambda: int(request.args.get("n", "1")))
    def batch() -> str:
        return "ok"

    client = app.test_client()
    denied = client.post("/batch?n=101")
    assert denied.status_code == 429
    assert "Retry-After" not in denied.headers  # no promise of a success that cannot come
    policies = denied.headers["RateLimit-Policy"]  # the refusing quota is listed, decided here
    assert '"global:100/minute";q=100' in policies and '"batch:100/minute";q=100' in policies
    body = json.loads(denied.get_data(as_text=True))
    assert "retry_after" not in body and "never be admitted" in body["detail"]
    assert "101" in body["detail"] and "100 per 60 s" in body["detail"]
    # one storage call, for the global limit (issue 24): the route's limit is never asked
    assert counting.evaluations == 1
    assert [c.key.split("}:")[1] for c in counting.checks[0]] == ["g_100/60:sliding_window_counter"]
    assert breaches[-1].retry_after is None
    assert client.post("/batch?n=100").status_code == 200  # the whole quota is affordable


def test_a_cost_function_returning_a_bad_value_names_the_limit(
    backend: Backend, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Logged at ERROR with the limit and the value, then the limit applies at the default cost
    (the failure policy, here ``open``, does not admit it unlimited); never a 500."""
    app, limiter, counting = make_app(backend(), clock)

    @app.get("/report")
    @limiter.limit("10/minute", cost=lambda: g.rows)
    def report() -> str:
        return "ok"

    @app.before_request
    def rows() -> None:
        g.rows = request.args.get("rows", "1")  # a string: a bug in the app

    app.testing = True  # an exception would propagate to the test
    with caplog.at_level(logging.ERROR, logger="flask_distlimit"):
        response = app.test_client().get("/report?rows=7")
    assert (response.status_code, response.headers["X-RateLimit-Remaining"]) == (200, "9")
    assert "X-RateLimit-Degraded" not in response.headers
    assert re.search(r"report:10/minute.*'7'", caplog.text), caplog.text
    assert counting.evaluations == 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"key_func": "tenant"}, "not callable"),
        ({"exempt_when": True}, "not callable"),
        ({"cost": -1}, "cost=-1"),
        ({"cost": True}, "cost=True"),
        ({"on_failure": "maybe"}, "Unknown failure policy"),
    ],
)
def test_bad_callables_and_numbers_are_refused_when_declared(
    options: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Limiter().limit("10/minute", **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("DISTLIMIT_REDIS_TIMEOUT", 100),
        ("DISTLIMIT_CONDITIONAL_COST", 10**18),
        ("DISTLIMIT_INSTANCES", 10**9),
        ("DISTLIMIT_BREAKER_FAIL_MAX", 10**9),
        ("DISTLIMIT_BREAKER_RESET_TIMEOUT", 10**9),
        ("DISTLIMIT_CHARGE_PREFLIGHTS", "yes"),
    ],
)
def test_config_numbers_out_of_sane_bounds_are_refused_at_start_up(key: str, value: object) -> None:
    app = Flask(__name__)
    app.config[key] = value
    with pytest.raises(ConfigurationError, match=key):
        Limiter(app)


PREFLIGHT = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}


@pytest.mark.parametrize("charge", [False, True])
def test_cors_preflights_spend_no_route_or_tier_quota_unless_asked(
    backend: Backend, clock: FakeClock, charge: bool
) -> None:
    app, limiter, counting = make_app(
        backend(),
        clock,
        DISTLIMIT_GLOBAL_LIMITS="100/minute",
        DISTLIMIT_TIERS={"anonymous": "4/minute"},
        DISTLIMIT_CHARGE_PREFLIGHTS=charge,
    )

    @app.post("/orders")  # Flask answers OPTIONS itself
    @limiter.limit("3/minute")
    def orders() -> str:
        return "ok"

    @app.route("/items", methods=["POST", "OPTIONS"])  # the view answers OPTIONS
    @limiter.limit("3/minute")
    def items() -> str:
        return "ok"

    client = app.test_client()
    if charge:  # counted like any request: the route's 3, then refused
        answers = [client.options("/orders", headers=PREFLIGHT).status_code for _ in range(4)]
        assert answers == [200, 200, 200, 429]
        return
    answers = [client.options("/orders", headers=PREFLIGHT).status_code for _ in range(4)]
    assert answers == [200] * 4
    assert counting.evaluations == 4  # the global flood limit counted every preflight
    # Neither the route's quota nor the anonymous tier's was spent by the 4 preflights.
    assert [client.post("/orders").status_code for _ in range(4)] == [200, 200, 200, 429]
    # A view that answers OPTIONS itself runs for it: limited like any request (issue 24).
    clock.advance(120)  # a fresh tier quota
    answers = [client.options("/items", headers=PREFLIGHT).status_code for _ in range(4)]
    assert answers == [200, 200, 200, 429]


@pytest.mark.parametrize("n", [2**53, 2**60, 10**30])
def test_under_policy_open_no_client_chosen_cost_makes_the_storage_fail(
    backend: Backend, clock: FakeClock, n: int
) -> None:
    """An error reply gets the failure policy: under ``open``, a client who could make the
    script refuse its arguments would switch the limiter off for itself. A cost the client
    chooses beyond what the script computes exactly (2^53) is refused before any call on a
    plain limit: 429, never a degraded 200. With ``deduct_when`` the callable cost is called
    after the response (Flask-Limiter's order): the view ran on a reservation of 1, and the
    cost is charged up to the whole limit, which it leaves spent. The storage never answered
    an error."""
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_FAILURE_POLICY="open")

    def cost() -> int:
        return int(request.args.get("n", "1"))

    @app.post("/batch")
    @limiter.limit("100/minute", cost=cost)
    def batch() -> str:
        return "ok"

    @app.post("/login")
    @limiter.limit("100/minute", cost=cost, deduct_when=lambda response: True)
    def login() -> str:
        return "ok"

    client = app.test_client()
    response = client.post(f"/batch?n={n}")
    assert response.status_code == 429
    assert "X-RateLimit-Degraded" not in response.headers
    assert client.post("/batch?n=100").status_code == 200  # the quota was not touched
    assert client.post("/batch?n=1").status_code == 429
    response = client.post(f"/login?n={n}")
    assert response.status_code == 200
    assert "X-RateLimit-Degraded" not in response.headers
    assert response.headers["X-RateLimit-Remaining"] == "0"  # charged the whole limit
    assert client.post("/login?n=1").status_code == 429
    assert limiter.state(app).guard.health()["unreadable_replies"] == 0
