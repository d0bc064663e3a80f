"""``Breach`` and ``limiter.current_limits`` carry each limit's window as well as its count (issue
26): Flask-Limiter's ``on_breach`` and ``current_limits`` hand out the whole limit
(``RequestLimit.limit`` is a ``RateLimitItem``), and here a hook could not tell ``5/minute`` from
``5/day``. The attributes that were there keep their meaning.

Each case runs on memory, fakeredis and a real redis-server (the ``backend`` fixture).
"""

from __future__ import annotations

from collections.abc import Callable

from flask import Flask

from flask_distlimit import Breach, Limiter, Rate, RequestLimit
from flask_distlimit.storage.base import Storage
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import backend, clock, make_app

__all__ = ["backend", "clock"]  # fixtures used below

Backend = Callable[[], Storage]
MONTH = 30 * 86_400


def _app(backend: Backend, clock: FakeClock, breaches: list[Breach]) -> tuple[Flask, Limiter]:
    limiter = Limiter(clock=clock, on_breach=breaches.append)
    app, limiter, _ = make_app(backend(), clock, limiter=limiter, DISTLIMIT_CONCURRENCY_LEASE=30)
    return app, limiter


def test_a_breach_names_the_refusing_limits_count_and_window(
    backend: Backend, clock: FakeClock
) -> None:
    breaches: list[Breach] = []
    app, limiter = _app(backend, clock, breaches)

    @app.get("/reports")
    @limiter.limit("3/month", algorithm="fixed_window")
    @limiter.limit("2/minute", algorithm="fixed_window")
    def reports() -> str:
        return "ok"

    client = app.test_client()
    assert [client.get("/reports").status_code for _ in range(3)] == [200, 200, 429]
    (breach,) = breaches
    assert breach.limit == Rate(2, 60)
    assert breach.limits == (Rate(2, 60),)
    assert breach.violated_policies == ("reports:2/minute",)  # what was there still is
    clock.advance(61)
    assert [client.get("/reports").status_code for _ in range(2)] == [200, 429]
    assert breaches[-1].limit == Rate(3, MONTH) and str(breaches[-1].limit) == "3/month"


def test_a_concurrency_breach_names_its_slots_and_their_lease(
    backend: Backend, clock: FakeClock
) -> None:
    breaches: list[Breach] = []
    app, limiter = _app(backend, clock, breaches)
    inside: list[int] = []

    @app.get("/export")
    @limiter.concurrency(1)
    def export() -> str:
        if not inside:  # the first request asks again while it holds its slot
            inside.append(app.test_client().get("/export").status_code)
        return "ok"

    assert app.test_client().get("/export").status_code == 200
    assert inside == [429]
    assert breaches[0].limit == Rate(1, 30) and breaches[0].limits == (Rate(1, 30),)


def test_current_limits_carry_the_window_beside_the_count(
    backend: Backend, clock: FakeClock
) -> None:
    seen: list[list[RequestLimit]] = []
    app, limiter, _ = make_app(backend(), clock)

    @app.get("/quota")
    @limiter.limit("5/minute;100/year")
    def quota() -> str:
        seen.append(limiter.current_limits)
        return "ok"

    assert app.test_client().get("/quota").status_code == 200
    (limits,) = seen
    assert [(lim.limit, lim.period) for lim in limits] == [(5, 60), (100, 12 * MONTH)]
    assert [lim.rate for lim in limits] == [Rate(5, 60), Rate(100, 12 * MONTH)]
    assert [lim.remaining for lim in limits] == [4, 99]  # the old attributes keep their meaning
    assert all(isinstance(lim.limit, int) for lim in limits)


def test_a_request_limit_built_the_old_way_still_builds() -> None:
    old = RequestLimit("x:5/minute", 5, 4, 60.0, 1e9, False)
    assert old.period == 0 and old.rate is None
