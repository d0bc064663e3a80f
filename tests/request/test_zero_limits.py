"""A limit of 0 refuses every request, as Flask-Limiter reads ``"0/hour"`` (it failed open under
the ``open`` policy when a callable answered it), and a shadow limit never refuses, even a
request that costs more than it allows in a whole window. On memory, fakeredis and a real
redis-server: no zero-limit check ever reaches a storage, whose scripts refuse a limit of 0.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable

import pytest
from flask import request
from prometheus_client import CollectorRegistry

from flask_distlimit import Limiter
from flask_distlimit.core.limits import Rate, parse_rates
from flask_distlimit.storage.base import Storage
from flask_distlimit.storage.memory import MemoryStorage
from flask_distlimit.telemetry.metrics import metrics_for
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import backend, clock, make_app

__all__ = ["backend", "clock"]  # fixtures used below

Backend = Callable[[], Storage]


def _metrics(app: object) -> CollectorRegistry:
    registry = CollectorRegistry()
    Limiter.state(app).guard.use_metrics(metrics_for(registry))  # type: ignore[arg-type]
    return registry


def test_a_count_of_zero_is_a_rate() -> None:
    assert parse_rates("0/hour") == (Rate(0, 3600),)
    assert parse_rates("0 per 30 seconds;10/minute") == (Rate(0, 30), Rate(10, 60))
    assert str(Rate(0, 60)) == "0/minute"


@pytest.mark.parametrize("policy", ["open", "closed", "local"])
def test_a_callable_answering_zero_refuses_every_request_under_every_policy(
    backend: Backend, clock: FakeClock, policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    app, limiter, counting = make_app(
        backend(),
        clock,
        DISTLIMIT_FAILURE_POLICY=policy,
        DISTLIMIT_GLOBAL_LIMITS="100/minute",
        DISTLIMIT_DYNAMIC_LIMIT_TTL=0,  # asked every request, as Flask-Limiter asks
    )

    @app.errorhandler(429)
    def refused(exc: Exception) -> tuple[str, int]:
        one = limiter.current_limit  # the refusing limit, as Flask-Limiter names it
        return ("-" if one is None else f"{one.name} {one.limit} {one.denied}"), 429

    @app.get("/api")
    @limiter.limit(lambda: "0/hour" if request.args.get("banned") else "5/hour")
    def api() -> str:
        return "ok"

    client = app.test_client()
    with caplog.at_level(logging.ERROR, logger="flask_distlimit"):
        refused = [client.get("/api?banned=1") for _ in range(3)]
    assert [r.status_code for r in refused] == [429] * 3
    assert not caplog.records  # an answer, not a failure of the app's code
    denied = refused[0]
    assert "X-RateLimit-Degraded" not in denied.headers
    assert "Retry-After" not in denied.headers  # it can never pass: no false promise
    assert '"api:0/hour";q=0;w=3600' in denied.headers["RateLimit-Policy"]
    assert denied.get_data(as_text=True) == "api:0/hour 0 True"
    # each refusal still spent the global limit (one storage call of it alone); the zero limit
    # never reached the storage, whose scripts refuse a limit of 0
    assert counting.evaluations == 3
    assert all(c.limit == 100 for checks in counting.checks for c in checks)
    assert [client.get("/api").status_code for _ in range(6)] == [200] * 5 + [429]


def test_zero_limits_in_config_and_tiers_refuse_those_clients(
    backend: Backend, clock: FakeClock
) -> None:
    app, _, counting = make_app(
        backend(),
        clock,
        DISTLIMIT_TIERS={"anonymous": "0/day", "pro": "10/minute"},
        DISTLIMIT_DEFAULT_LIMITS="20/minute",
    )

    @app.get("/")
    def index() -> str:
        return "ok"

    client = app.test_client()
    denied = client.get("/")
    assert denied.status_code == 429
    assert counting.evaluations == 0  # refused before any storage call: nothing to count
    body = json.loads(denied.get_data(as_text=True))
    assert "admits no request" in body["detail"] and "0 per 86400 s" in body["detail"]


def test_a_zero_limit_at_cost_zero_counts_nothing_and_admits(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, counting = make_app(backend(), clock)

    @app.get("/peek")
    @limiter.limit("0/minute", cost=lambda: int(request.args.get("n", "1")))
    def peek() -> str:
        return "ok"

    client = app.test_client()
    assert client.get("/peek?n=0").status_code == 200
    assert counting.evaluations == 0
    assert client.get("/peek?n=1").status_code == 429


def test_a_shadow_limit_never_refuses_a_request_that_costs_more_than_it_allows(
    backend: Backend, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A shadow limit refused a request whose cost exceeded its whole window (it was taken for
    an enforced limit's can-never-pass); and a shadow limit of 0 says it would refuse."""
    app, limiter, counting = make_app(backend(), clock)
    registry = _metrics(app)

    @app.post("/batch")
    @limiter.limit("5/minute", shadow=True, cost=lambda: int(request.args.get("n", "1")))
    @limiter.limit("0/minute", shadow=True)
    @limiter.limit("100/minute", cost=lambda: int(request.args.get("n", "1")))
    def batch() -> str:
        return "ok"

    client = app.test_client()
    with caplog.at_level(logging.INFO, logger="flask_distlimit"):
        answers = [client.post("/batch?n=10").status_code for _ in range(3)]
    assert answers == [200] * 3
    lines = [r.getMessage() for r in caplog.records if "Shadow rate limit" in r.getMessage()]
    assert any("batch:5/minute" in line for line in lines)
    assert any("batch:0/minute" in line for line in lines)
    for limit in ("r_batch_5/60:sliding_window_counter", "r_batch_0/60:sliding_window_counter"):
        assert registry.get_sample_value("distlimit_shadow_denials_total", {"limit": limit}) == 3
    # the enforced limit was charged every time: 30 of 100 spent, 70 left
    assert client.post("/batch?n=70").status_code == 200
    assert client.post("/batch?n=1").status_code == 429
    # the shadow 0 never went to the storage; the shadow 5 did, and was not written
    assert all(c.limit != 0 for checks in counting.checks for c in checks)


def test_a_refusal_made_without_a_storage_call_yields_to_the_event_loop_under_gevent(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Like the deny cache's (tests/defences/test_deny_cache.py): a flood of 429s decided in
    memory must not hold a gevent worker's admitted requests."""
    app, limiter, _ = make_app(MemoryStorage(clock=clock), clock)

    @app.get("/")
    @limiter.limit("0/hour")
    def index() -> str:
        return "ok"

    slept: list[float] = []
    monkeypatch.setattr(socket.socket, "__module__", "gevent._socket3")
    monkeypatch.setattr(time, "sleep", slept.append)
    assert [app.test_client().get("/").status_code for _ in range(3)] == [429] * 3
    assert slept == [0] * 3
