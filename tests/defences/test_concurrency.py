"""Concurrent-requests limits (issue 13, item 2), in one process: the script and its twin agree,
slots are all-or-nothing with the request's rate limits, and given back when the response ends
(also a streamed one, and after an exception), or by their lease. The fleet-wide proof on
gunicorn is ``tests/defences/test_concurrency_gunicorn.py``.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Callable, Iterator

import pytest
import redis
from flask import Flask, Response

from flask_distlimit import ConfigurationError, Limiter
from flask_distlimit.core.decision import Check
from flask_distlimit.core.problem import CONCURRENCY_LIMIT_EXCEEDED
from flask_distlimit.resilience.fallback import LocalFallback
from flask_distlimit.storage.base import Storage
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import backend, clock, make_app
from tests.engines import ENGINE_PARAMS, Engine, make_engine
from tests.faults import wait_until
from tests.servers import start_redis

__all__ = ["backend", "clock"]  # fixtures used below

Backend = Callable[[], Storage]
T0 = 1_700_000_040_000_000


@pytest.fixture(params=ENGINE_PARAMS)
def engine(request: pytest.FixtureRequest) -> Engine:
    return make_engine(request.param, request)


def _slot(token: int, *, limit: int = 3, lease: int = 5, key: str = "c:{a}:x") -> Check:
    return Check(key, "concurrency", limit, lease, 1, token=token)


def _script() -> list[tuple[str, int, int]]:
    """(action, token, time step us): acquires, releases, peeks, leases running out."""
    out: list[tuple[str, int, int]] = []
    x = 11
    for _ in range(150):
        x = (x * 1_103_515_245 + 12_345) % 2**31
        action = ("take", "take", "take", "give", "peek")[x % 5]
        out.append((action, 1 + (x >> 4) % 7, (0, 0, 700_000, 2_100_000)[(x >> 8) % 4]))
    return out


def test_the_script_and_its_twin_decide_slots_alike(request: pytest.FixtureRequest) -> None:
    engines = [make_engine(p.values[0], request) for p in ENGINE_PARAMS]  # type: ignore[index]
    now = T0
    refused = 0
    for action, token, step in _script():
        now += step
        check = _slot(token)
        if action == "give":
            check = dataclasses.replace(check, release=True)
        elif action == "peek":
            check = dataclasses.replace(check, cost=0)
        answers = {e.evaluate([check], now_us=now).decisions for e in engines}
        assert len(answers) == 1, (action, token, now, answers)
        refused += not next(iter(answers))[0].allowed
    assert refused > 10


def test_at_most_n_in_flight_and_a_release_frees_one(engine: Engine) -> None:
    taken = [engine.evaluate([_slot(t)], now_us=T0).allowed for t in (1, 2, 3, 4)]
    assert taken == [True, True, True, False]
    denied = engine.evaluate([_slot(4)], now_us=T0).decisions[0]
    assert denied.retry_after == 1.0  # a hint: a slot frees when a request ends
    engine.evaluate([dataclasses.replace(_slot(2), release=True)], now_us=T0 + 10)
    assert engine.evaluate([_slot(4)], now_us=T0 + 20).allowed
    # Releasing twice, or a token never taken, changes nothing.
    engine.evaluate([dataclasses.replace(_slot(2), release=True)], now_us=T0 + 30)
    engine.evaluate([dataclasses.replace(_slot(99), release=True)], now_us=T0 + 30)
    assert not engine.evaluate([_slot(5)], now_us=T0 + 40).allowed


def test_a_slot_comes_back_when_its_lease_ends(engine: Engine) -> None:
    assert engine.evaluate([_slot(1, limit=1, lease=2)], now_us=T0).allowed
    assert not engine.evaluate([_slot(2, limit=1, lease=2)], now_us=T0 + 1_999_999).allowed
    assert engine.evaluate([_slot(2, limit=1, lease=2)], now_us=T0 + 2_000_000).allowed


def test_slots_are_all_or_nothing_with_the_rate_limits(engine: Engine) -> None:
    rate = Check("r:{a}:x", "fixed_window", 1, 60)
    assert engine.evaluate([rate, _slot(1, limit=2)], now_us=T0).allowed
    refused = engine.evaluate([rate, _slot(2, limit=2)], now_us=T0)
    assert refused.denied_indexes() == [0]
    assert refused.decisions[1].remaining == 1  # the rate refused: no slot was taken
    full = Check("r:{a}:y", "fixed_window", 10, 60)
    assert engine.evaluate([full, _slot(3, limit=1, key="c:{a}:z")], now_us=T0).allowed
    no_slot = engine.evaluate([full, _slot(4, limit=1, key="c:{a}:z")], now_us=T0)
    assert no_slot.denied_indexes() == [1]
    assert no_slot.decisions[0].remaining == 9  # no slot: the rate limit was not charged


# -- the app ---------------------------------------------------------------------------------


@pytest.fixture
def app_and_gate(backend: Backend, clock: FakeClock) -> Iterator[tuple[object, object]]:
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_CONCURRENCY_LEASE=30)

    @app.get("/report")
    @limiter.concurrency(2)
    @limiter.limit("100/minute")
    def report() -> Response:
        def body() -> Iterator[str]:
            yield "part 1\n"
            yield "part 2\n"

        return Response(body())

    @app.get("/boom")
    @limiter.concurrency(1, scope="boom")
    def boom() -> str:
        raise RuntimeError("the view failed")

    yield app, limiter


def test_a_streamed_response_holds_its_slot_until_it_is_closed(
    app_and_gate: tuple[object, object],
) -> None:
    app, _ = app_and_gate
    client = app.test_client()  # type: ignore[attr-defined]
    first = client.get("/report", buffered=False)
    second = client.get("/report", buffered=False)
    refused = client.get("/report")
    assert (first.status_code, second.status_code, refused.status_code) == (200, 200, 429)
    problem = refused.get_json()
    assert problem["type"] == CONCURRENCY_LIMIT_EXCEEDED
    assert "in flight" in problem["title"] and problem["violated-policies"] == [
        "report:2 in flight"
    ]
    assert refused.headers["Retry-After"] == "1"
    assert refused.headers["Content-Type"] == "application/problem+json"
    assert "RateLimit" not in refused.headers  # headers describe rates, never slots
    assert first.headers["RateLimit-Policy"] == (
        '"report:100/minute";q=100;w=60, "report:2 in flight";q=2;qu="concurrent-requests"'
    )
    assert b"".join(first.response) == b"part 1\npart 2\n"
    first.close()  # the server closes the response after its last chunk: the slot comes back
    again = client.get("/report", buffered=False)
    assert again.status_code == 200
    again.close()
    second.close()


def test_a_failing_view_gives_its_slot_back(app_and_gate: tuple[object, object]) -> None:
    app, _ = app_and_gate
    client = app.test_client()  # type: ignore[attr-defined]
    for _ in range(3):
        response = client.get("/boom")
        assert response.status_code == 500  # never a 429: each gave its slot back
        response.close()  # as the WSGI server does


def test_an_exception_that_escapes_flask_gives_its_slot_back_at_teardown(
    app_and_gate: tuple[object, object],
) -> None:
    app, _ = app_and_gate
    app.testing = True  # type: ignore[attr-defined]  # the exception propagates: no response
    client = app.test_client()  # type: ignore[attr-defined]
    for _ in range(3):
        with pytest.raises(RuntimeError, match="the view failed"):
            client.get("/boom")


def test_a_lost_slot_comes_back_after_the_lease(
    app_and_gate: tuple[object, object], clock: FakeClock
) -> None:
    app, _ = app_and_gate
    client = app.test_client()  # type: ignore[attr-defined]
    held = [client.get("/report", buffered=False) for _ in range(2)]  # never closed: "died"
    assert [r.status_code for r in held] == [200, 200]
    assert client.get("/report").status_code == 429
    clock.advance(29)
    assert client.get("/report").status_code == 429
    clock.advance(1)
    late = client.get("/report", buffered=False)
    assert late.status_code == 200
    late.close()


def test_under_policy_local_each_process_holds_its_share() -> None:
    fallback = LocalFallback()
    slots = [_slot(t, limit=6) for t in (1, 2, 3)]
    taken = [fallback.evaluate([s], instances=3, now_us=T0).allowed for s in slots]
    assert taken == [True, True, False]  # 6 across 3 instances: 2 here
    fallback.evaluate([dataclasses.replace(slots[0], release=True)], instances=3, now_us=T0)
    assert fallback.evaluate([slots[2]], instances=3, now_us=T0).allowed


@pytest.mark.parametrize("value", [0, -1, 10_001, 2.5, True, "3"], ids=repr)
def test_a_bad_concurrency_is_refused_when_declared(value: object) -> None:
    with pytest.raises(ConfigurationError, match="concurrency"):
        Limiter().concurrency(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [0, 86_401, "60", 1.5], ids=repr)
def test_a_bad_lease_is_refused_at_start_up(clock: FakeClock, value: object) -> None:
    from flask_distlimit.storage.memory import MemoryStorage

    with pytest.raises(ConfigurationError, match="DISTLIMIT_CONCURRENCY_LEASE"):
        make_app(MemoryStorage(clock=clock), clock, DISTLIMIT_CONCURRENCY_LEASE=value)


def test_concurrency_is_not_an_algorithm_for_rate_limits() -> None:
    with pytest.raises(ConfigurationError, match="Unknown rate-limit algorithm"):
        Limiter().limit("5/minute", algorithm="concurrency")


def test_under_policy_local_slots_are_held_and_given_back_in_the_process(
    clock: FakeClock,
) -> None:
    """Redis down, policy local, 2 instances: 4 slots are 2 here, and come back at the end."""
    from flask_distlimit.storage.memory import MemoryStorage
    from tests.faults import FailingStorage

    down = FailingStorage(MemoryStorage(clock=clock), fails=lambda n: True)
    app, limiter, _ = make_app(down, clock, DISTLIMIT_FAILURE_POLICY="local", DISTLIMIT_INSTANCES=2)

    @app.get("/export")
    @limiter.concurrency(4)
    def export() -> Response:
        return Response(iter(["rows"]))

    client = app.test_client()
    held = [client.get("/export", buffered=False) for _ in range(3)]
    assert [r.status_code for r in held] == [200, 200, 429]
    held[0].close()
    again = client.get("/export", buffered=False)
    assert again.status_code == 200
    for response in (again, *held):
        response.close()


@pytest.mark.parametrize("policy", ["open", "closed"])
def test_slots_a_stall_took_late_are_given_back_before_the_next_slot_is_taken(
    policy: str,
) -> None:
    """A request whose slot-taking call times out while Redis is stalled gets the failure
    policy's answer, and its give-back finds the breaker open; its call runs when Redis resumes:
    the slot stayed taken with nothing in flight for the whole lease (an attack review). The
    give-backs the storage did not take are sent again before this process takes a slot."""
    server = start_redis()
    app = Flask(__name__)
    app.config.update(
        DISTLIMIT_STORAGE_URL=server.url,
        DISTLIMIT_FAILURE_POLICY=policy,
        DISTLIMIT_BREAKER_FAIL_MAX=1,
        DISTLIMIT_BREAKER_RESET_TIMEOUT=0.2,
        SECRET_KEY="s" * 32,
    )
    limiter = Limiter(app)

    @app.get("/report")
    @limiter.concurrency(1)
    def report() -> str:
        return "ok"

    client = app.test_client()

    def get() -> int:
        with client.get("/report") as response:  # given back when its body ends
            return response.status_code

    try:
        assert get() == 200
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            assert get() == (200 if policy == "open" else 503)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        admin = redis.Redis.from_url(server.url)
        wait_until(lambda: any(admin.zcard(k) for k in admin.scan_iter("*concurrency*")), 2.0)
        assert limiter.state(app).guard.owed  # taken late, given back never: until now
        time.sleep(0.3)  # the breaker lets a trial through
        assert [get() for _ in range(3)] == [200] * 3
        assert not limiter.state(app).guard.owed
        assert sum(admin.zcard(k) for k in admin.scan_iter("*concurrency*")) == 0
    finally:
        server.stop()
        limiter.state(app).storage.close()


class _Interrupted(BaseException):
    """Not an :class:`Exception`, as a ``gevent.Timeout`` that fires during a give-back."""


def test_a_give_back_interrupted_by_a_base_exception_is_sent_again(
    backend: Callable[[], Storage], clock: FakeClock
) -> None:
    """A give-back cut short by a ``BaseException`` was lost: its slot stayed taken for the
    whole lease, and the give-backs owed before it went with it. It is owed, and sent again."""
    app, limiter, _ = make_app(backend(), clock)

    @app.get("/export")
    @limiter.concurrency(1)
    def export() -> Response:
        return Response(iter(["rows"]))

    client = app.test_client()
    guard = limiter.state(app).guard
    response = client.get("/export", buffered=False)

    def interrupted(*args: object, **kwargs: object) -> object:
        raise _Interrupted

    guard.storage.evaluate_parts = interrupted  # type: ignore[method-assign]
    with pytest.raises(_Interrupted):
        response.close()
    del guard.storage.evaluate_parts
    assert guard.owed
    with client.get("/export") as again:  # sent again before the next slot is taken
        assert again.status_code == 200
    assert not guard.owed
