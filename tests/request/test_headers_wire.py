"""The rate-limit headers on the wire: RateLimit-Policy lists every quota policy that applied,
RateLimit the one closest to denial, both valid RFC 9651 Lists read by an independent parser
(``http-sf``) for every algorithm and header mode; ``t`` never exceeds the window on an admitted
response and ``X-RateLimit-Reset`` never moves backwards for one policy (issue 26 item 5,
issue 27 item 3)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import http_sf
import pytest
from flask import Flask

from flask_distlimit import ALGORITHMS, Limiter
from flask_distlimit.storage.base import Storage
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import backend, clock, make_app

__all__ = ["backend", "clock"]

Backend = Callable[[], Storage]

_POLICIES = {
    "global:100/minute": {"q": 100, "w": 60},
    "tier-anonymous:50/minute": {"q": 50, "w": 60},
    "search:3/second": {"q": 3, "w": 1},
    "search:1000/hour": {"q": 1000, "w": 3600},
    "reads:20/minute": {"q": 20, "w": 60},
    "search:5 in flight": {"q": 5, "qu": "concurrent-requests"},
}


def _sf_list(value: str) -> list[tuple[Any, dict[str, Any]]]:
    """``value`` parsed as an RFC 9651 List (raises on anything else)."""
    parsed = http_sf.parse(value.encode("ascii"), tltype="list")
    assert isinstance(parsed, list)
    return parsed  # type: ignore[return-value]


def _app(storage: Storage, clock: FakeClock, **config: Any) -> tuple[Flask, Limiter]:
    app, limiter, _ = make_app(
        storage,
        clock,
        DISTLIMIT_GLOBAL_LIMITS="100/minute",
        DISTLIMIT_TIERS={"anonymous": "50/minute"},
        **config,
    )

    @app.get("/search")
    @limiter.limit("3/second;1000/hour")
    @limiter.shared_limit("20/minute", scope="reads")
    @limiter.concurrency(5)
    @limiter.limit("1/second", shadow=True)  # never advertised: it is not enforced
    def search() -> str:
        return "ok"

    return app, limiter


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ietf", "both", "legacy"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_policy_on_the_wire_as_valid_lists(
    backend: Backend, clock: FakeClock, algorithm: str, mode: str
) -> None:
    app, _ = _app(backend(), clock, DISTLIMIT_ALGORITHM=algorithm, DISTLIMIT_HEADERS=mode)
    client = app.test_client()
    responses = [client.get("/search") for _ in range(4)]
    shown = [(r.status_code, r.headers.get("X-RateLimit-Degraded")) for r in responses]
    assert [r.status_code for r in responses] == [200, 200, 200, 429], shown
    for response in responses:
        if mode == "legacy":
            assert "RateLimit-Policy" not in response.headers
            assert "RateLimit" not in response.headers
            assert response.headers["X-RateLimit-Limit"] == "3"
            continue
        (policy_value,) = response.headers.getlist("RateLimit-Policy")
        policies = _sf_list(policy_value)
        got = {name: params for name, params in policies}
        assert all(isinstance(name, str) for name, _ in policies)  # Strings, not Tokens
        assert len(got) == len(policies) == len(_POLICIES), policy_value
        assert got == _POLICIES
        (rate_value,) = response.headers.getlist("RateLimit")
        ((name, params),) = _sf_list(rate_value)  # one item: the policy closest to denial
        assert name == "search:3/second" == policies[0][0]  # and it leads RateLimit-Policy
        assert set(params) == {"r", "t"} and isinstance(params["r"], int)
        assert 0 <= params["t"] <= (1 if response.status_code == 200 else 2)
        if response.status_code == 429:
            assert params["r"] == 0
            assert params["t"] == int(response.headers["Retry-After"])
            # the 429 still names the policy it broke in its problem body
            body = json.loads(response.get_data(as_text=True))
            assert body["violated-policies"] == ["search:3/second"]


def test_a_concurrency_refusal_advertises_the_slot_policy(
    backend: Backend, clock: FakeClock
) -> None:
    """Today's code sends no rate-limit header at all on a concurrency 429 or on a route whose
    only limit is a concurrency limit: the draft's ``qu="concurrent-requests"`` says it."""
    app, limiter, _ = make_app(backend(), clock)
    inner: list[int] = []

    @app.get("/slow")
    @limiter.concurrency(1)
    def slow() -> str:
        if not inner:
            inner.append(app.test_client().get("/slow").status_code)
        return "ok"

    outer = app.test_client().get("/slow")
    assert outer.status_code == 200 and inner == [429]
    ((name, params),) = _sf_list(outer.headers["RateLimit-Policy"])
    assert name == "slow:1 in flight"
    assert params == {"q": 1, "qu": "concurrent-requests"}
    assert "RateLimit" not in outer.headers  # no rate to report: a slot has no window
    assert "X-RateLimit-Limit" not in outer.headers


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("rate", ["20/minute", "2/second"])
def test_t_never_exceeds_the_window_and_reset_never_moves_backwards(
    backend: Backend, clock: FakeClock, algorithm: str, rate: str
) -> None:
    """Requests at irregular fractional times over three windows, admitted and refused: on
    every admitted response ``t <= w``; on a 429 ``t`` is ``Retry-After``; and
    ``X-RateLimit-Reset`` never goes down. Today's code sends ``t=70`` on ``20/minute`` (the
    sliding window counter's quota is whole a window later), and a 429 whose Reset is earlier
    than the 200 before it (GCRA, token bucket, log: the retry time, not the reset)."""
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_ALGORITHM=algorithm)

    @app.get("/")
    @limiter.limit(rate)
    def index() -> str:
        return "ok"

    client = app.test_client()
    window = 60 if rate.endswith("minute") else 1
    steps = [0.37, 0.011, 0.29, 0.9, 0.05, 0.61] if window == 1 else [0.7, 0.4, 1.3, 0.2, 0.9, 5.3]
    last_reset = 0
    statuses = set()
    for i in range(90):
        response = client.get("/")
        statuses.add(response.status_code)
        ((_, params),) = _sf_list(response.headers["RateLimit"])
        ((_, policy),) = _sf_list(response.headers["RateLimit-Policy"])
        assert policy["w"] == window
        reset = int(response.headers["X-RateLimit-Reset"])
        if response.status_code == 200:
            assert 0 <= params["t"] <= window, (i, clock(), response.headers)
        else:
            assert params["t"] == int(response.headers["Retry-After"])
        assert reset >= last_reset, (i, clock(), last_reset, response.headers)
        last_reset = reset
        clock.advance(steps[i % len(steps)])
    assert statuses == {200, 429}


def test_the_fleet_capacity_is_not_a_client_policy_and_503s_keep_their_types(
    backend: Backend, clock: FakeClock
) -> None:
    """The fleet's slots are the server's load: never in RateLimit-Policy. A shed 503 and a
    fail-closed 503 keep the draft's problem type (issue 27 item 4)."""
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_FLEET_CAPACITY=1)
    inner: list[Any] = []

    @app.get("/")
    @limiter.limit("5/minute")
    def index() -> str:
        if not inner:
            inner.append(app.test_client().get("/"))
        return "ok"

    outer = app.test_client().get("/")
    assert outer.status_code == 200
    ((name, params),) = _sf_list(outer.headers["RateLimit-Policy"])
    assert (name, params) == ("index:5/minute", {"q": 5, "w": 60})
    (shed,) = inner
    assert shed.status_code == 503
    problem = json.loads(shed.get_data(as_text=True))
    assert problem["type"].endswith("#temporary-reduced-capacity")
    assert "RateLimit-Policy" not in shed.headers or "fleet" not in shed.headers["RateLimit-Policy"]
