"""Shadow limits (issue 13, item 1): decided and counted exactly as if enforced, never refusing.

The engine tests run the real Lua (fakeredis and a real redis-server) and its twin (memory) over
the same traffic: a shadow limit's would-be decisions and stored counts equal those of the same
limit enforced, and a shadow limit that would refuse neither refuses nor leaves the request's
enforced limits uncharged. The app tests check what a client and an operator see.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry

from flask_distlimit import ConfigurationError, Limiter
from flask_distlimit.core.algorithms import ALGORITHMS, Algorithm
from flask_distlimit.core.decision import Check, Decision
from flask_distlimit.storage.base import Storage
from flask_distlimit.telemetry.metrics import metrics_for
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import backend, clock, make_app
from tests.engines import ENGINE_PARAMS, Engine, make_engine

__all__ = ["backend", "clock"]  # fixtures used below

Backend = Callable[[], Storage]
T0 = 1_700_000_040_000_000  # us, on a whole minute


@pytest.fixture(params=ENGINE_PARAMS)
def engine(request: pytest.FixtureRequest) -> Engine:
    return make_engine(request.param, request)


def _traffic(seed: int, n: int) -> list[tuple[int, int]]:
    """(time step in us, cost) of ``n`` requests: bursts and pauses, costs 0..3 (reproducible)."""
    out, x = [], seed
    for _ in range(n):
        x = (x * 1_103_515_245 + 12_345) % 2**31
        step = (0, 0, 0, 150_000, 900_000, 4_000_000)[x % 6]
        out.append((step, (x >> 8) % 4))
    return out


def _would_deny(d: Decision) -> bool:
    return d.shadow_denied if d.allowed else True


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_shadow_counts_equal_enforced_counts_on_the_same_traffic(
    engine: Engine, algorithm: Algorithm
) -> None:
    """The same requests against an enforced limit and a shadow limit (each in a request with a
    generous enforced limit beside it): the same would-be decisions, the same stored counts."""
    enforced = Check("e:{a}:x", algorithm, 5, 10)
    shadow = Check("s:{a}:x", algorithm, 5, 10, shadow=True)
    other = Check("o:{a}:x", "fixed_window", 1000, 10)  # generous, enforced, beside the shadow
    now, refusals = T0, 0
    for step, cost in _traffic(7, 120):
        now += step
        e = engine.evaluate([dataclasses.replace(enforced, cost=cost)], now_us=now)
        s = engine.evaluate(
            [dataclasses.replace(other, cost=cost), dataclasses.replace(shadow, cost=cost)],
            now_us=now,
        )
        ed, sd = e.decisions[0], s.decisions[1]
        assert s.allowed  # a shadow limit never refuses
        assert sd.allowed and sd.shadow_denied == (not ed.allowed)
        assert (sd.limit, sd.remaining, sd.reset_after, sd.retry_after) == (
            ed.limit, ed.remaining, ed.reset_after, ed.retry_after,
        )  # fmt: skip
        refusals += not ed.allowed
        peek_e = engine.evaluate([dataclasses.replace(enforced, cost=0)], now_us=now)
        peek_s = engine.evaluate([dataclasses.replace(shadow, cost=0, shadow=False)], now_us=now)
        assert peek_s.decisions == peek_e.decisions  # the stored counts are the same
    assert refusals > 10  # the traffic did exceed the limit, often


def test_a_shadow_limit_that_would_refuse_leaves_the_enforced_limits_charged(
    engine: Engine,
) -> None:
    enforced = Check("e:{b}:x", "fixed_window", 10, 60)
    shadow = Check("s:{b}:x", "fixed_window", 2, 60, shadow=True)
    results = [engine.evaluate([enforced, shadow], now_us=T0) for _ in range(4)]
    assert all(r.allowed for r in results)
    assert [r.decisions[0].remaining for r in results] == [9, 8, 7, 6]  # charged every time
    assert [r.decisions[1].shadow_denied for r in results] == [False, False, True, True]
    assert [r.decisions[1].remaining for r in results] == [1, 0, 0, 0]  # not charged past 2


def test_an_enforced_refusal_charges_the_shadow_limit_nothing(engine: Engine) -> None:
    enforced = Check("e:{c}:x", "gcra", 1, 60)
    shadow = Check("s:{c}:x", "token_bucket", 5, 60, shadow=True)
    first = engine.evaluate([enforced, shadow], now_us=T0)
    second = engine.evaluate([enforced, shadow], now_us=T0)
    assert first.allowed and not second.allowed
    assert second.denied_indexes() == [0]
    assert second.decisions[1].remaining == 4  # the refused request was not counted on it
    assert (
        engine.evaluate([dataclasses.replace(shadow, cost=0)], now_us=T0).decisions[0].remaining
        == 4
    )


# -- the app ---------------------------------------------------------------------------------


def _metrics(app: object) -> CollectorRegistry:
    registry = CollectorRegistry()
    Limiter.state(app).guard.use_metrics(metrics_for(registry))  # type: ignore[arg-type]
    return registry


def test_a_shadow_limit_never_refuses_but_logs_and_counts_what_it_would_have(
    backend: Backend, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    app, limiter, _ = make_app(backend(), clock)
    registry = _metrics(app)

    @app.get("/search")
    @limiter.limit("2/minute", shadow=True)
    def search() -> str:
        return "ok"

    client = app.test_client()
    with caplog.at_level(logging.INFO, logger="flask_distlimit"):
        responses = [client.get("/search") for _ in range(6)]
    assert [r.status_code for r in responses] == [200] * 6
    # No rate-limit headers: the client must not slow down for a limit that is not enforced.
    assert not [h for r in responses for h, _ in r.headers if "ratelimit" in h.lower()]
    lines = [r.getMessage() for r in caplog.records if "Shadow rate limit" in r.getMessage()]
    assert len(lines) == 1  # once per client and limit per window, never once per request
    assert "search:2/minute" in lines[0] and "not enforced" in lines[0]
    label = {"limit": "r_search_2/60:sliding_window_counter"}
    assert registry.get_sample_value("distlimit_shadow_denials_total", label) == 4
    clock.advance(120)  # past the sliding window's previous window too
    with caplog.at_level(logging.INFO, logger="flask_distlimit"):
        client.get("/search")
        client.get("/search")
        client.get("/search")
    assert sum("Shadow rate limit" in r.getMessage() for r in caplog.records) == 2
    assert registry.get_sample_value("distlimit_shadow_denials_total", label) == 5


def test_a_shadow_limit_charged_after_the_response_never_refuses(
    backend: Backend, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``deduct_when`` limit (and, under ``DISTLIMIT_CONDITIONAL_COST=0``, a conditional GET's
    route limit) peeks before the view and refused once its quota was spent, even as a shadow
    limit: turning shadow mode on for a rollout refused real logins."""
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_CONDITIONAL_COST=0)
    registry = _metrics(app)

    @app.post("/login")
    @limiter.limit("2/minute", shadow=True, deduct_when=lambda r: r.status_code == 401)
    def login() -> tuple[str, int]:
        return "who?", 401

    @app.get("/search")
    @limiter.limit("2/minute", shadow=True)
    def search() -> str:
        return "ok"

    client = app.test_client()
    bogus = {"If-None-Match": '"bogus"'}
    with caplog.at_level(logging.INFO, logger="flask_distlimit"):
        assert [client.post("/login").status_code for _ in range(4)] == [401] * 4
        assert [client.get("/search", headers=bogus).status_code for _ in range(4)] == [200] * 4
    lines = [r.getMessage() for r in caplog.records if "Shadow rate limit" in r.getMessage()]
    assert len(lines) == 2
    assert "login:2/minute" in lines[0] and "search:2/minute" in lines[1]
    # and counted, as every shadow limit's would-be refusal is: the last two of each route
    counted = {
        sample.labels["limit"].split(":")[0]: sample.value
        for metric in registry.collect()
        if metric.name == "distlimit_shadow_denials"
        for sample in metric.samples
        if sample.name == "distlimit_shadow_denials_total"
    }
    assert counted == {"r_login_2/60": 2, "r_search_2/60": 2}, counted


def test_headers_describe_the_enforced_limit_and_never_the_shadow_one(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_HEADERS="legacy")

    @app.get("/")
    @limiter.limit("3/minute", shadow=True)
    @limiter.limit("10/minute")
    def index() -> str:
        return "ok"

    client = app.test_client()
    seen = [client.get("/") for _ in range(5)]
    assert [r.status_code for r in seen] == [200] * 5
    assert [r.headers["X-RateLimit-Limit"] for r in seen] == ["10"] * 5
    assert [r.headers["X-RateLimit-Remaining"] for r in seen] == ["9", "8", "7", "6", "5"]


def test_turning_shadow_off_enforces_with_the_counts_already_in_place(
    backend: Backend, clock: FakeClock
) -> None:
    """Two deployments of the same app on one store: the first with the limit in shadow, the
    second enforcing it (a roll-out). The second refuses at once: the counts were kept."""
    store = backend()

    def deploy(shadow: bool) -> object:
        app, limiter, _ = make_app(store, clock, name=f"app-{shadow}")

        @app.get("/export")
        @limiter.limit("3/minute", shadow=shadow)
        def export() -> str:
            return "ok"

        return app

    before, after = deploy(True), deploy(False)
    assert [before.test_client().get("/export").status_code for _ in range(5)] == [200] * 5  # type: ignore[attr-defined]
    assert after.test_client().get("/export").status_code == 429  # type: ignore[attr-defined]


def test_distlimit_shadow_true_makes_every_limit_a_shadow(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(
        backend(),
        clock,
        DISTLIMIT_SHADOW=True,
        DISTLIMIT_GLOBAL_LIMITS="2/minute",
        DISTLIMIT_DEFAULT_LIMITS="2/minute",
    )

    @app.get("/a")
    @limiter.shared_limit("1/minute", scope="s")
    def a() -> str:
        return "ok"

    @app.get("/b")
    def b() -> str:
        return "ok"

    client = app.test_client()
    assert [client.get(p).status_code for p in ("/a", "/b") * 3] == [200] * 6


def test_distlimit_shadow_names_the_config_limits_that_are_shadows(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(
        backend(),
        clock,
        DISTLIMIT_SHADOW=["global"],
        DISTLIMIT_GLOBAL_LIMITS="1/minute",
    )

    @app.get("/")
    @limiter.limit("3/minute")
    def index() -> str:
        return "ok"

    client = app.test_client()
    assert [client.get("/").status_code for _ in range(4)] == [200, 200, 200, 429]


@pytest.mark.parametrize("value", ["yes", 1, ["tiers"], ["tier:"], [3], {"global": True}], ids=repr)
def test_a_bad_distlimit_shadow_is_refused_at_start_up(clock: FakeClock, value: object) -> None:
    from flask_distlimit.storage.memory import MemoryStorage

    with pytest.raises(ConfigurationError, match="DISTLIMIT_SHADOW"):
        make_app(MemoryStorage(clock=clock), clock, DISTLIMIT_SHADOW=value)


@pytest.mark.parametrize("named", ["tier:gold", "global", "default"])
def test_distlimit_shadow_naming_a_limit_not_configured_is_refused(
    clock: FakeClock, named: str
) -> None:
    """A shadow setting that changes nothing: a tier, or the global or default limits, that the
    app does not configure ("global" and "default" passed silently)."""
    from flask_distlimit.storage.memory import MemoryStorage

    with pytest.raises(ConfigurationError, match=named):
        make_app(MemoryStorage(clock=clock), clock, DISTLIMIT_SHADOW=[named])
    make_app(  # configured: accepted
        MemoryStorage(clock=clock), clock, DISTLIMIT_SHADOW=["global", "default"],
        DISTLIMIT_GLOBAL_LIMITS="9/minute", DISTLIMIT_DEFAULT_LIMITS=lambda: "9/minute",
    )  # fmt: skip


def test_shadow_must_be_a_bool_on_a_declaration() -> None:
    limiter = Limiter()
    with pytest.raises(ConfigurationError, match="shadow="):
        limiter.limit("1/minute", shadow="yes")  # type: ignore[arg-type]


def test_under_policy_local_a_shadow_limit_counts_its_share_and_never_refuses(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis down, policy local, 2 instances: the enforced 8/minute refuses past its share of
    4; the shadow 2/minute (share 1) only logs what it would have refused."""
    from flask_distlimit.storage.memory import MemoryStorage
    from tests.faults import FailingStorage

    down = FailingStorage(MemoryStorage(clock=clock), fails=lambda n: True)
    app, limiter, _ = make_app(down, clock, DISTLIMIT_FAILURE_POLICY="local", DISTLIMIT_INSTANCES=2)

    @app.get("/")
    @limiter.limit("2/minute", shadow=True)
    @limiter.limit("8/minute", algorithm="fixed_window")
    def index() -> str:
        return "ok"

    client = app.test_client()
    with caplog.at_level(logging.INFO, logger="flask_distlimit"):
        statuses = [client.get("/").status_code for _ in range(6)]
    assert statuses == [200] * 4 + [429] * 2  # the enforced limit's share: 8 / 2
    assert any("Shadow rate limit" in r.getMessage() for r in caplog.records)
