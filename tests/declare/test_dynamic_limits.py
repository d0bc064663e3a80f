"""Limits that depend on who is asking: a callable limit value, a mapping tier -> limit (issue 12).

Each case runs on memory, fakeredis and a real redis-server (the ``backend`` fixture).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
from flask import Flask, g, request

from flask_distlimit import ALGORITHMS, ConfigurationError, Limiter
from flask_distlimit.cli import distlimit_cli
from flask_distlimit.storage.base import Storage
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import backend, clock, make_app

__all__ = ["backend", "clock"]  # fixtures used below

Backend = Callable[[], Storage]


def statuses(app: Flask, path: str, n: int, **kwargs: Any) -> list[int]:
    client = app.test_client()
    return [client.get(path, **kwargs).status_code for _ in range(n)]


def tenant_app(
    backend: Backend, clock: FakeClock, plans: dict[str, object], **config: Any
) -> tuple[Flask, list[str]]:
    """``/orders`` limited per tenant by ``plans[tenant]``; the tenant is set by a hook
    registered after ``init_app``. Answers the app and the tenants the callable was asked for."""
    app, limiter, _ = make_app(backend(), clock, **config)
    asked: list[str] = []

    @app.before_request
    def load_tenant() -> None:
        g.tenant = request.headers.get("X-Tenant", "none")

    def plan_of_tenant() -> object:
        asked.append(g.tenant)
        value = plans[g.tenant]
        if isinstance(value, Exception):
            raise value
        return value

    @app.get("/orders")
    @limiter.limit(plan_of_tenant, key_func=lambda: g.tenant)
    def orders() -> str:
        return "orders"

    return app, asked


def test_a_callable_limit_is_asked_per_tenant_after_the_hooks(
    backend: Backend, clock: FakeClock
) -> None:
    plans: dict[str, object] = {"a": "2/minute", "b": "3/minute"}
    app, asked = tenant_app(backend, clock, plans)
    assert statuses(app, "/orders", 3, headers={"X-Tenant": "a"}) == [200, 200, 429]
    assert statuses(app, "/orders", 4, headers={"X-Tenant": "b"}) == [200, 200, 200, 429]
    # Kept per tenant for DISTLIMIT_DYNAMIC_LIMIT_TTL (60 s): asked once each.
    assert asked == ["a", "b"]
    response = app.test_client().get("/orders", headers={"X-Tenant": "a"})
    assert response.headers["X-RateLimit-Limit"] == "2"


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_changed_value_takes_effect_when_its_answer_expires(
    backend: Backend, clock: FakeClock, algorithm: str
) -> None:
    plans: dict[str, object] = {"a": "2/minute"}
    app, asked = tenant_app(
        backend,
        clock,
        plans,
        DISTLIMIT_ALGORITHM=algorithm,
        DISTLIMIT_DYNAMIC_LIMIT_TTL=10,
    )
    assert statuses(app, "/orders", 3, headers={"X-Tenant": "a"}) == [200, 200, 429]
    plans["a"] = "5/minute"  # the tenant upgrades
    assert statuses(app, "/orders", 1, headers={"X-Tenant": "a"}) == [429]  # answer still kept
    clock.advance(11)  # within the minute: the old value's counter would still refuse
    assert statuses(app, "/orders", 6, headers={"X-Tenant": "a"}) == [200] * 5 + [429]
    assert asked == ["a", "a"]


def test_ttl_zero_asks_on_every_request(backend: Backend, clock: FakeClock) -> None:
    plans: dict[str, object] = {"a": "2/minute"}
    app, asked = tenant_app(backend, clock, plans, DISTLIMIT_DYNAMIC_LIMIT_TTL=0)
    assert statuses(app, "/orders", 3, headers={"X-Tenant": "a"}) == [200, 200, 429]
    plans["a"] = "4/minute"
    assert statuses(app, "/orders", 1, headers={"X-Tenant": "a"}) == [200]
    assert len(asked) == 4


@pytest.mark.parametrize(
    "answer",
    [
        RuntimeError("database down"),
        42,
        "lots per fortnight",
    ],
    ids=["raises", "not-a-string", "not-a-limit"],
)
def test_a_failing_callable_falls_back_and_logs_never_a_500(
    backend: Backend, clock: FakeClock, caplog: pytest.LogCaptureFixture, answer: object
) -> None:
    app, limiter, _ = make_app(backend(), clock)

    @app.get("/guarded")
    @limiter.limit(lambda: answer, fallback="2/minute")  # type: ignore[arg-type, return-value]
    def guarded() -> str:
        return "ok"

    @app.get("/open")
    @limiter.limit(lambda: answer)  # type: ignore[arg-type, return-value]
    def open_() -> str:
        return "ok"

    with caplog.at_level(logging.ERROR, logger="flask_distlimit"):
        assert statuses(app, "/guarded", 3) == [200, 200, 429]
        assert statuses(app, "/open", 5) == [200] * 5  # no fallback: no limit
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2  # once per limit and identity while the answer is kept
    assert "fallback" in errors[0].getMessage()


def test_an_answer_of_more_rates_than_the_request_has_room_for_applies_the_first(
    backend: Backend, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """As a mapping's value does; before, the whole answer was a failure (no limit under open).
    Flask-Limiter applies them all; a request here carries at most 8."""
    app, limiter, _ = make_app(backend(), clock)
    answer = ";".join(f"{n}/{n} minutes" for n in range(2, 12))  # 10 rates, 2/2 minutes first

    @app.get("/many")
    @limiter.limit(lambda: answer)
    def many() -> str:
        return "ok"

    with caplog.at_level(logging.ERROR, logger="flask_distlimit"):
        response = app.test_client().get("/many")
        assert statuses(app, "/many", 2) == [200, 429]
    assert "X-RateLimit-Degraded" not in response.headers
    assert response.headers["RateLimit-Policy"].count("many:") == 8  # the first 8
    assert "the first 8 apply" in caplog.text


def test_a_kept_answer_too_long_for_a_later_route_applies_its_first_rates(
    backend: Backend, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A callable global limit's answer, kept per client, met a route with less room than the
    one that asked it: its first rates apply there too (before, none did: the route was free of
    the global limit, silently, while the answer was kept), and the roomy route keeps them all."""
    app, limiter, _ = make_app(
        backend(), clock, DISTLIMIT_GLOBAL_LIMITS=lambda: "3/minute;100/hour;1000/day;5000/month"
    )

    @app.get("/home")
    def home() -> str:
        return "ok"

    @app.get("/report")
    @limiter.limit("50/second;500/minute;2000/hour;20000/day;100000/month")
    def report() -> str:
        return "ok"

    with caplog.at_level(logging.ERROR, logger="flask_distlimit"):
        assert statuses(app, "/home", 1) == [200]  # asked here, with room for all four
        assert statuses(app, "/report", 3) == [200, 200, 429]  # the global 3/minute
    assert "has room for 3; the first 3 apply" in caplog.text
    clock.advance(61)
    response = app.test_client().get("/home")
    assert response.headers["RateLimit-Policy"].count("global") == 4  # the whole answer kept


def test_a_global_answer_leaves_room_for_the_tier_and_the_routes_own_dynamic_limit(
    backend: Backend, clock: FakeClock
) -> None:
    """A callable global limit's room ignored the tier limits added after it: a route's
    callable limit was then cut to a room of -2 and applied none of its rates (its 2/day never
    counted; a review), and a route of static limits sent more checks than a request carries."""
    app, limiter, counting = make_app(
        backend(),
        clock,
        DISTLIMIT_GLOBAL_LIMITS=lambda: "100/second;101/minute;102/hour;103/day",
        DISTLIMIT_TIERS={"anonymous": "200/second;201/minute;202/hour"},
    )

    @app.get("/dyn")
    @limiter.limit("300/second;301/minute;302/hour")
    @limiter.limit(lambda: "2/day;400/hour")
    def dyn() -> str:
        return "ok"

    @app.get("/many")
    @limiter.limit("300/second;301/minute;302/hour;3/day")
    def many() -> str:
        return "ok"

    assert statuses(app, "/dyn", 3) == [200, 200, 429]  # its own 2/day
    assert statuses(app, "/many", 4) == [200, 200, 200, 429]
    assert max(map(len, counting.checks)) <= 8


def test_none_or_empty_answer_means_no_limit(backend: Backend, clock: FakeClock) -> None:
    plans: dict[str, object] = {"a": None, "b": ""}
    app, _ = tenant_app(backend, clock, plans)
    assert statuses(app, "/orders", 5, headers={"X-Tenant": "a"}) == [200] * 5
    assert statuses(app, "/orders", 5, headers={"X-Tenant": "b"}) == [200] * 5


def tier_app(backend: Backend, clock: FakeClock, mapping: dict[str, str]) -> Flask:
    app, limiter, _ = make_app(
        backend(),
        clock,
        DISTLIMIT_TIERS={"anonymous": "", "free": "", "pro": "", "staff": ""},
    )

    @limiter.identity_loader
    def load_user() -> tuple[str, str | None] | None:
        user = request.headers.get("X-User")
        return (user, request.headers.get("X-Tier")) if user else None

    @app.get("/reports")
    @limiter.limit(mapping)
    def reports() -> str:
        return "reports"

    return app


def test_a_mapping_resolves_the_request_tier(backend: Backend, clock: FakeClock) -> None:
    app = tier_app(backend, clock, {"free": "2/minute", "pro": "4/minute", "*": "1/minute"})
    free = {"X-User": "ann", "X-Tier": "free"}
    pro = {"X-User": "bob", "X-Tier": "pro"}
    staff = {"X-User": "cat", "X-Tier": "staff"}
    assert statuses(app, "/reports", 3, headers=free) == [200, 200, 429]
    assert statuses(app, "/reports", 5, headers=pro) == [200] * 4 + [429]
    assert statuses(app, "/reports", 2, headers=staff) == [200, 429]  # missing: "*"
    assert statuses(app, "/reports", 2) == [200, 429]  # anonymous: "*"


def test_a_tier_missing_from_a_mapping_without_star_is_unlimited(
    backend: Backend, clock: FakeClock
) -> None:
    app = tier_app(backend, clock, {"free": "2/minute"})
    assert statuses(app, "/reports", 3, headers={"X-User": "a", "X-Tier": "free"}) == [
        200,
        200,
        429,
    ]
    assert statuses(app, "/reports", 5, headers={"X-User": "b", "X-Tier": "pro"}) == [200] * 5


def test_an_upgraded_tier_takes_effect_on_the_next_request(
    backend: Backend, clock: FakeClock
) -> None:
    app = tier_app(backend, clock, {"free": "2/minute", "pro": "4/minute"})
    assert statuses(app, "/reports", 3, headers={"X-User": "a", "X-Tier": "free"}) == [
        200,
        200,
        429,
    ]
    assert statuses(app, "/reports", 5, headers={"X-User": "a", "X-Tier": "pro"}) == (
        [200] * 4 + [429]
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"free": "ten per minute"}, "entry 'free'"),
        ({"free": 10}, "entry 'free'"),
        ({}, "at least one tier"),
        ({1: "10/minute"}, "tier names"),
        (42, "callable"),
        ({"a": ";".join(["1/second"] * 9)}, "at most 8"),
    ],
)
def test_mapping_values_are_checked_at_declaration(value: object, message: str) -> None:
    limiter = Limiter()
    with pytest.raises(ConfigurationError, match=message):
        limiter.limit(value)  # type: ignore[arg-type]


def test_a_mapping_rate_the_algorithm_cannot_enforce_is_refused_at_declaration() -> None:
    with pytest.raises(ConfigurationError, match="sliding_window_log"):
        Limiter().limit({"free": "100000/minute"}, algorithm="sliding_window_log")


def test_fallback_is_for_callables_only() -> None:
    with pytest.raises(ConfigurationError, match="fallback"):
        Limiter().limit("1/minute", fallback="2/minute")
    with pytest.raises(ConfigurationError, match="fallback"):
        Limiter().limit(lambda: "1/minute", fallback="often")


def test_ttl_setting_is_validated() -> None:
    app = Flask("t")
    app.config["DISTLIMIT_DYNAMIC_LIMIT_TTL"] = -1
    with pytest.raises(ConfigurationError, match=r"DISTLIMIT_DYNAMIC_LIMIT_TTL.*how long"):
        Limiter(app)


def test_a_mapping_counts_as_its_largest_value_at_start_up() -> None:
    limiter = Limiter()
    app = Flask("eight")
    app.config.update(SECRET_KEY="x" * 32, DISTLIMIT_GLOBAL_LIMITS="1/second;2/minute;3/hour")

    @app.get("/r")
    @limiter.limit(
        {"free": "1/second;2/minute;3/hour", "pro": "1/second;2/minute;3/hour;4/day;9/2 days"}
    )
    @limiter.limit("5/day")
    def r() -> str:
        return "r"

    with pytest.raises(ConfigurationError, match="make 9 limits"):
        limiter.init_app(app)


# -- a callable DISTLIMIT_GLOBAL_LIMITS (Flask-Limiter's callable application_limits) ----------


def plan_app(backend: Backend, clock: FakeClock, value: object, **config: Any) -> Flask:
    """``/a`` and ``/b``, unlimited themselves, under ``DISTLIMIT_GLOBAL_LIMITS = value``."""
    app, _, _ = make_app(
        backend(), clock, DISTLIMIT_GLOBAL_LIMITS=value, DISTLIMIT_DYNAMIC_LIMIT_TTL=0, **config
    )
    app.get("/a")(lambda: "a")
    app.get("/b", endpoint="b")(lambda: "b")
    return app


def test_a_callable_global_limit_is_asked_per_request_and_counts_every_route(
    backend: Backend, clock: FakeClock
) -> None:
    def by_plan() -> str | None:
        plan = request.headers.get("X-Plan")
        return None if plan == "none" else "2/minute" if plan == "low" else "4/minute"

    app = plan_app(backend, clock, by_plan)
    client = app.test_client()
    low = {"X-Plan": "low"}
    assert [client.get(p, headers=low).status_code for p in ("/a", "/b", "/a")] == [200, 200, 429]
    assert [client.get(p).status_code for p in ("/a", "/b", "/a", "/b", "/a")] == [200] * 4 + [429]
    assert statuses(app, "/a", 3, headers={"X-Plan": "none"}) == [200] * 3  # None: no limit
    assert client.get("/b").headers["X-RateLimit-Limit"] == "4"


@pytest.mark.parametrize(("policy", "status"), [("open", 200), ("closed", 503)])
def test_a_global_limit_callable_that_raises_takes_the_failure_policy_loudly(
    backend: Backend,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
    policy: str,
    status: int,
) -> None:
    def broken() -> str:
        raise LookupError("no plan table")

    app = plan_app(backend, clock, broken, DISTLIMIT_FAILURE_POLICY=policy)
    with caplog.at_level(logging.ERROR, logger="flask_distlimit"):
        answers = [app.test_client().get("/a") for _ in range(3)]
    assert [r.status_code for r in answers] == [status] * 3  # never silently unlimited
    if policy == "open":
        assert all(r.headers.get("X-RateLimit-Degraded") for r in answers)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors and "LookupError" in errors[0] and "no plan table" in errors[0]


def test_a_mapping_as_global_limits_stops_init_app() -> None:
    app = Flask(__name__)
    app.config.update(DISTLIMIT_STORAGE_URL="memory://", DISTLIMIT_GLOBAL_LIMITS={"*": "1/hour"})
    with pytest.raises(ConfigurationError, match="DISTLIMIT_TIERS"):
        Limiter(app)


def test_the_cli_lists_a_callable_global_limit_and_reset_skips_it(
    backend: Backend, clock: FakeClock
) -> None:
    def plan() -> str:
        return "3/minute"

    app = plan_app(backend, clock, plan)
    assert statuses(app, "/a", 4) == [200] * 3 + [429]
    listed = app.test_cli_runner().invoke(distlimit_cli, ["limits"])
    assert listed.exit_code == 0, listed.output
    assert "every request" in listed.output and "plan" in listed.output
    reset = app.test_cli_runner().invoke(distlimit_cli, ["reset", "--ip", "127.0.0.1"])
    assert reset.exit_code == 0, reset.output


def test_two_dynamic_limits_of_one_view_both_apply_and_count_apart(
    backend: Backend, clock: FakeClock
) -> None:
    """Every dynamic value of a route is bound under the id ``r:<endpoint>:dyn``: a second one
    (a daily quota from the database beside a per-minute mapping) was taken for a repeat of the
    first and dropped, so it never applied. And two of them keyed by ``key_func`` that answered
    the same rate shared one counter per text, as static ones did before ``:k2``: a client that
    named itself after a tenant (a user ``acme``) spent that tenant's quota."""
    app, limiter, _ = make_app(backend(), clock)

    @app.get("/export")
    @limiter.limit(lambda: "2/day")
    @limiter.limit({"*": "100/minute"})
    def export() -> str:
        return "ok"

    @app.get("/orders")
    @limiter.limit(lambda: "2/minute", key_func=lambda: request.args["tenant"])
    @limiter.limit(lambda: "2/minute", key_func=lambda: request.args["user"])
    def orders() -> str:
        return "ok"

    assert statuses(app, "/export", 3) == [200, 200, 429]  # before: the 2/day never applied
    client = app.test_client()
    orders_of = ["tenant=x&user=acme", "tenant=acme&user=y", "tenant=acme&user=z"]
    # tenant acme: 2 of 2, user acme: 1 of 2 (before: 3 of 2 in one counter, a 429)
    assert [client.get(f"/orders?{q}").status_code for q in orders_of] == [200] * 3
    assert client.get("/orders?tenant=acme&user=w").status_code == 429
