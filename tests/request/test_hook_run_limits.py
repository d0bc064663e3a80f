"""Limits a ``before_request`` hook runs (a limited helper it calls, a ``with limiter.limit``
block there), and ``exempt_when`` that raises: on memory, fakeredis and a real redis-server."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
from flask import Flask, Response, jsonify, request
from flask.typing import ResponseReturnValue

from flask_distlimit import ExemptionScope, Limiter
from flask_distlimit.storage.base import Storage
from flask_distlimit.storage.memory import MemoryStorage
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import backend, clock, make_app

__all__ = ["backend", "clock"]  # fixtures used below

Backend = Callable[[], Storage]


def _hook_runs_a_limit(app: Flask, limiter: Limiter, run: str, value: str) -> None:
    @limiter.limit(value)
    def check_session() -> None:
        return None

    @app.before_request
    def hook() -> None:
        if run == "wrapper":
            check_session()
        else:
            with limiter.limit(value):
                pass


def _codes(app: Flask, path: str, n: int, **kwargs: Any) -> list[int]:
    client = app.test_client()
    return [client.get(path, **kwargs).status_code for _ in range(n)]


@pytest.mark.parametrize("run", ["wrapper", "with"])
def test_a_limit_a_hook_runs_counts_every_request_limits_once(
    backend: Backend, clock: FakeClock, run: str
) -> None:
    """The hook's call counted the global limit (the gate had not run); the gate then counted
    it again, with fresh request data: the second request got the 429 of a 3/minute limit, and
    the view never saw the hook's limit. Now the gate decides the route's limits alone, on the
    request's data."""
    app, limiter, counting = make_app(backend(), clock, DISTLIMIT_GLOBAL_LIMITS="3/minute")
    _hook_runs_a_limit(app, limiter, run, "100/minute")

    @app.get("/orders")
    @limiter.limit("10/minute")
    def orders() -> ResponseReturnValue:
        return jsonify(sorted(lim.name for lim in limiter.current_limits))

    response = app.test_client().get("/orders")
    assert sorted(response.get_json()) == sorted(
        ["global:3/minute", "orders:10/minute", f"{counting.checks[0][-1].bound.name}"]
    )
    assert len(counting.checks) == 2  # the hook's call, then the gate's
    assert [c.bound.name for c in counting.checks[1]] == ["orders:10/minute"]
    counting.checks.clear()
    assert _codes(app, "/nowhere", 1) == [404]  # counted once, in the hook's call
    assert len(counting.checks) == 1
    assert _codes(app, "/orders", 2) == [200, 429]  # before: [429, 429]


@pytest.mark.parametrize("run", ["wrapper", "with"])
def test_an_exempt_route_is_counted_by_no_limit_a_hook_runs(
    backend: Backend, clock: FakeClock, run: str
) -> None:
    """An exempt route's request met the global limit in the hook's call: the fourth request to
    an exempt /health got the 429 of a global 3/minute. ``ExemptionScope.APPLICATION`` lifts
    the global limit from a hook's call as well; a request filter, every limit."""
    app, limiter, counting = make_app(backend(), clock, DISTLIMIT_GLOBAL_LIMITS="3/minute")
    _hook_runs_a_limit(app, limiter, run, "2/minute")
    limiter.request_filter(lambda: request.headers.get("X-Probe") == "1")

    @app.get("/health")
    @limiter.exempt
    def health() -> str:
        return "ok"

    @app.get("/admin")
    @limiter.exempt(flags=ExemptionScope.APPLICATION)
    def admin() -> str:
        return "ok"

    @app.get("/orders")
    def orders() -> str:
        return "ok"

    assert _codes(app, "/health", 5) == [200] * 5  # before: [200, 200, 429, 429, 429]
    assert _codes(app, "/orders", 3, headers={"X-Probe": "1"}) == [200] * 3
    assert counting.evaluations == 0
    assert _codes(app, "/admin", 3) == [200, 200, 429]  # the hook's 2/minute applies, alone
    assert {c.bound.name for checks in counting.checks for c in checks} == {
        counting.checks[0][0].bound.name
    }


def test_a_request_whose_hook_ran_a_limit_takes_its_place_in_the_worker(clock: FakeClock) -> None:
    """The gate still counts the request into the worker's load (worker shedding) when a hook's
    limit opened the request's data."""
    app, limiter, _ = make_app(MemoryStorage(clock=clock), clock, DISTLIMIT_WORKER_THREADS=2)
    _hook_runs_a_limit(app, limiter, "with", "100/minute")
    limiter.priority_resolver(lambda: request.args.get("p"))  # decided in the gate

    @app.get("/export")
    def export() -> Response:
        return Response(iter(["a", "b"]))

    client = app.test_client()
    streaming = client.get("/export", buffered=False)  # holds 1 of the 2 threads
    assert client.get("/export?p=sheddable").status_code == 503
    streaming.close()
    assert client.get("/export?p=sheddable").status_code == 200


def test_an_exempt_when_that_raises_does_not_exempt(
    backend: Backend, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Under the default policy (open) an ``exempt_when`` that raised skipped the limit: a
    client who could make it raise (here a header it reads) switched the limit off. It is
    logged now, as a request filter that raises is, and the limit applies."""
    app, limiter, _ = make_app(backend(), clock)

    @app.get("/orders")
    @limiter.limit("2/minute", exempt_when=lambda: int(request.headers["X-Level"]) > 9)
    def orders() -> str:
        return "ok"

    client = app.test_client()
    with caplog.at_level(logging.ERROR, logger="flask_distlimit"):
        answers = [client.get("/orders", headers={"X-Level": "x"}) for _ in range(3)]
    assert [r.status_code for r in answers] == [200, 200, 429]  # before: [200, 200, 200]
    assert not any("X-RateLimit-Degraded" in r.headers for r in answers)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors  # paced: once a minute per limit
    assert "orders:2/minute" in errors[0] and "exempt_when raised ValueError" in errors[0]
    assert client.get("/orders", headers={"X-Level": "10"}).status_code == 200  # true exempts
