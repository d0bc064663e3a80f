"""``deduct_when``: checked before the view, charged after the response only when it says so
(issue 12), on memory, fakeredis and a real redis-server; the concurrency bound measured on a
real redis-server."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import pytest
import redis
from flask import Flask, request
from flask.typing import ResponseReturnValue

from flask_distlimit import Limiter
from flask_distlimit.storage.base import Storage
from flask_distlimit.storage.redis import RedisStorage
from flask_distlimit.testing import CountingStorage, FakeClock
from tests.distlimit_fixtures import backend, clock, make_app

__all__ = ["backend", "clock"]  # fixtures used below

Backend = Callable[[], Storage]


def login_app(
    storage: Storage, clock: FakeClock, *, barrier: threading.Barrier | None = None
) -> tuple[Flask, Limiter, CountingStorage]:
    app, limiter, counting = make_app(storage, clock)

    @app.post("/login")
    @limiter.limit("5/minute", deduct_when=lambda response: response.status_code == 401)
    def login() -> ResponseReturnValue:
        if barrier is not None:
            barrier.wait(timeout=60)  # every request of the batch is inside the view
        if request.form.get("password") == "right":
            return "welcome"
        return "wrong password", 401

    @app.get("/plain")
    @limiter.limit("100/minute")
    def plain() -> str:
        return "plain"

    return app, limiter, counting


def logins(app: Flask, passwords: list[str]) -> list[int]:
    client = app.test_client()
    return [client.post("/login", data={"password": p}).status_code for p in passwords]


def test_only_failed_logins_are_counted(backend: Backend, clock: FakeClock) -> None:
    app, _, _ = login_app(backend(), clock)
    assert logins(app, ["right"] * 10) == [200] * 10  # successes are never charged
    assert logins(app, ["wrong"] * 5) == [401] * 5
    # The quota is spent: refused before the view, even with the right password.
    assert logins(app, ["right", "wrong"]) == [429, 429]
    clock.advance(120)  # the sliding window counter forgets the previous minute too
    assert logins(app, ["right"]) == [200]


def test_a_refused_request_is_not_charged(backend: Backend, clock: FakeClock) -> None:
    app, _, counting = login_app(backend(), clock)
    logins(app, ["wrong"] * 5)
    before = counting.evaluations
    assert logins(app, ["wrong"] * 3) == [429] * 3
    assert counting.evaluations == before + 3  # the peek only; no charge after a 429


def test_only_routes_with_deduct_when_pay_a_second_call(backend: Backend, clock: FakeClock) -> None:
    app, _, counting = login_app(backend(), clock)
    client = app.test_client()
    client.get("/plain")
    assert counting.evaluations == 1
    client.post("/login", data={"password": "right"})  # peek; the callable says no charge
    assert counting.evaluations == 2
    client.post("/login", data={"password": "wrong"})  # peek, then the charge
    assert counting.evaluations == 4
    peek, charge = counting.checks[2], counting.checks[3]
    assert [c.cost for c in peek] == [0]
    assert [c.cost for c in charge] == [1]
    assert peek[0].key == charge[0].key


def test_a_deduct_when_that_raises_charges_and_logs(
    backend: Backend, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    app, limiter, _ = make_app(backend(), clock)

    def broken(response: object) -> bool:
        raise RuntimeError("bug")

    @app.get("/x")
    @limiter.limit("2/minute", deduct_when=broken)
    def x() -> str:
        return "x"

    client = app.test_client()
    with caplog.at_level(logging.ERROR, logger="flask_distlimit"):
        assert [client.get("/x").status_code for _ in range(3)] == [200, 200, 429]
    assert any("deduct_when" in r.getMessage() for r in caplog.records)


def test_headers_and_retry_after_of_a_spent_quota(backend: Backend, clock: FakeClock) -> None:
    app, _, _ = login_app(backend(), clock)
    logins(app, ["wrong"] * 5)
    response = app.test_client().post("/login", data={"password": "wrong"})
    assert response.status_code == 429
    # A peek tells when the quota is whole again (at most two windows for the sliding
    # window counter), not when one unit frees: a conservative Retry-After.
    assert 1 <= int(response.headers["Retry-After"]) <= 120
    assert response.headers["X-RateLimit-Remaining"] == "0"


@pytest.fixture
def real_storage(redis_client: redis.Redis) -> Iterator[RedisStorage]:
    kwargs = redis_client.connection_pool.connection_kwargs
    storage = RedisStorage(host=kwargs["host"], port=kwargs["port"])
    yield storage
    storage.close()


@pytest.mark.redis
def test_concurrent_failed_logins_reach_limit_plus_in_flight(
    real_storage: RedisStorage, clock: FakeClock
) -> None:
    """The documented bound: N requests in flight can all pass the peek before any of them is
    charged. A barrier inside the view holds N = 8 failed logins until all of them have passed
    it, the worst case against "5/minute": all 8 reach the view (limit + in-flight - 1 = 12 is
    the bound), the counter stops at the limit, and the next failed login is refused."""
    n = 8
    barrier = threading.Barrier(n)
    app, limiter, _ = login_app(real_storage, clock, barrier=barrier)
    results: list[int] = []
    lock = threading.Lock()

    def attempt() -> None:
        status = app.test_client().post("/login", data={"password": "wrong"}).status_code
        with lock:
            results.append(status)

    threads = [threading.Thread(target=attempt) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [401] * n  # measured: all 8 reached the view
    assert n <= 5 + n - 1  # within the documented bound limit + in-flight - 1
    # The charges stopped at the limit: the counter holds 5, not 8.
    with app.test_request_context():
        state = limiter.state(app)
        ((_name, check),) = [
            (name, c) for name, c in state.checks_for("ip:127.0.0.1") if name.startswith("login")
        ]
    decision = real_storage.evaluate([check], now_us=clock()).decisions[0]
    assert (decision.limit, decision.remaining) == (5, 0)
    barrier_free = login_app(real_storage, clock)[0]  # same keys, no barrier
    assert logins(barrier_free, ["wrong"]) == [429]


def test_the_headers_of_a_charged_response_count_its_charge(
    backend: Backend, clock: FakeClock
) -> None:
    """The headers tell what is left after the request: a failed login's charge is made after
    the view, so its response must show it (the peek before the view saw one more unit)."""
    app, _, _ = login_app(backend(), clock)
    client = app.test_client()
    ok = client.post("/login", data={"password": "right"})
    assert ok.headers["X-RateLimit-Remaining"] == "5"  # not charged
    failed = [client.post("/login", data={"password": "wrong"}) for _ in range(5)]
    assert [r.headers["X-RateLimit-Remaining"] for r in failed] == ["4", "3", "2", "1", "0"]
    assert all(r.status_code == 401 for r in failed)
    assert ";r=0;" in failed[-1].headers["RateLimit"] + ";"
