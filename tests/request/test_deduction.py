"""``deduct_when``: reserved before the view, given back after the response when it says so
(issues 12 and 35), on memory, fakeredis and a real redis-server; exact under concurrency on a
real redis-server."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import pytest
import redis
from flask import Flask, Response, g, request
from flask.typing import ResponseReturnValue

from flask_distlimit import ALGORITHMS, Limiter
from flask_distlimit.engine import fixed_window
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
    before = len(counting.checks)
    assert logins(app, ["wrong"] * 3) == [429] * 3
    made = counting.checks[before:]  # no settlement after a 429 (the deny cache may answer)
    assert made and all(c.cost == 1 and not c.release for call in made for c in call)
    clock.advance(120)
    assert logins(app, ["right"]) == [200]  # the refusals took nothing


def test_the_reservation_is_given_back_in_a_second_call(backend: Backend, clock: FakeClock) -> None:
    """Reserved in the request's one call; given back in a second call only when the callable
    says not to charge; a charged request makes no second call."""
    app, _, counting = login_app(backend(), clock)
    client = app.test_client()
    client.get("/plain")
    assert counting.evaluations == 1
    client.post("/login", data={"password": "wrong"})  # reserved; the callable says keep it
    assert counting.evaluations == 2
    client.post("/login", data={"password": "right"})  # reserved, then given back
    assert counting.evaluations == 4
    reserve, back = counting.checks[2], counting.checks[3]
    assert [(c.cost, c.release) for c in reserve] == [(1, False)]
    assert [(c.cost, c.release) for c in back] == [(1, True)]
    assert reserve[0].key == back[0].key


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
    assert 1 <= int(response.headers["Retry-After"]) <= 120  # the counter: two windows at most
    assert response.headers["X-RateLimit-Remaining"] == "0"


@pytest.fixture
def real_storage(redis_client: redis.Redis) -> Iterator[RedisStorage]:
    kwargs = redis_client.connection_pool.connection_kwargs
    storage = RedisStorage(host=kwargs["host"], port=kwargs["port"])
    yield storage
    storage.close()


@pytest.mark.redis
def test_concurrent_wrong_passwords_never_take_more_than_the_limit_to_the_view(
    real_storage: RedisStorage, clock: FakeClock
) -> None:
    """Issue 35: 30 simultaneous wrong passwords against "5/minute" on a real redis-server.
    Each request that reaches the view is held there until every one of the 30 has either
    entered the view or been refused, the worst case for a test-then-charge: all 30 in flight
    at once. Reserved before the view, at most 5 reach it (a peek let all 30 through)."""
    n = 30
    arrived = threading.Semaphore(0)  # one release per request in the view or refused
    hold = threading.Event()
    entered: list[int] = []
    lock = threading.Lock()
    app, limiter, _ = make_app(real_storage, clock)

    @app.post("/login")
    @limiter.limit("5/minute", deduct_when=lambda response: response.status_code == 401)
    def login() -> ResponseReturnValue:
        with lock:
            entered.append(1)
        arrived.release()
        hold.wait(timeout=60)
        return "wrong password", 401

    results: list[int] = []
    start = threading.Barrier(n)

    def attempt() -> None:
        start.wait(timeout=60)
        status = app.test_client().post("/login", data={"password": "wrong"}).status_code
        if status == 429:
            arrived.release()
        with lock:
            results.append(status)

    threads = [threading.Thread(target=attempt) for _ in range(n)]
    for t in threads:
        t.start()
    for _ in range(n):  # every request is in the view or refused: none was charged after yet
        assert arrived.acquire(timeout=60)
    hold.set()
    for t in threads:
        t.join()
    assert len(entered) <= 5
    assert sorted(results) == [401] * len(entered) + [429] * (n - len(entered))
    assert logins(app, ["wrong"]) == [429]


def test_the_headers_of_a_charged_response_count_its_charge(
    backend: Backend, clock: FakeClock
) -> None:
    """The headers tell what is left after the request: a failed login's charge is made after
    the view, so its response must show it (and a reservation given back must not)."""
    app, _, _ = login_app(backend(), clock)
    client = app.test_client()
    ok = client.post("/login", data={"password": "right"})
    assert ok.headers["X-RateLimit-Remaining"] == "5"  # not charged
    failed = [client.post("/login", data={"password": "wrong"}) for _ in range(5)]
    assert [r.headers["X-RateLimit-Remaining"] for r in failed] == ["4", "3", "2", "1", "0"]
    assert all(r.status_code == 401 for r in failed)
    assert ";r=0;" in failed[-1].headers["RateLimit"] + ";"


def test_a_callable_cost_with_deduct_when_is_the_batch_the_view_set(
    backend: Backend, clock: FakeClock
) -> None:
    """Flask-Limiter's order, as LibreTranslate uses it: with ``deduct_when``, a callable cost is
    called after the response, so it reads the batch size the view set. After 3 batches of 3
    against 10/minute, one more batch is admitted (9 < 10), and it spends the quota; a failed
    batch is charged nothing."""
    app, limiter, _ = make_app(backend(), clock)

    @app.post("/translate")
    @limiter.limit(
        "10/minute", cost=lambda: g.batch, deduct_when=lambda response: response.status_code == 200
    )
    def translate() -> ResponseReturnValue:
        g.batch = len(request.form.getlist("q"))
        return ("bad language", 400) if request.form.get("lang") == "xx" else "ok"

    client = app.test_client()

    def batch(size: int, lang: str = "en") -> int:
        return client.post("/translate", data={"q": ["a"] * size, "lang": lang}).status_code

    assert [batch(3) for _ in range(3)] == [200] * 3
    assert batch(3, lang="xx") == 400  # refused by the view: its reservation is given back
    assert batch(3) == 200  # 9 of 10 spent: admitted, as Flask-Limiter admits it
    assert batch(1) == 429  # the batch spent the quota (charged up to the limit)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_settle_charges_or_gives_back_the_difference_to_the_real_cost(
    backend: Backend, clock: FakeClock, algorithm: str
) -> None:
    """Issue 35's tokens per tenant: ``cost`` is reserved before the view (refused when it does
    not fit), ``settle(response)`` is the real cost, and the difference is given back or
    charged after the response, on every algorithm; a real cost beyond what is left puts the
    quota in debt: refused until it is repaid (two periods at most)."""
    app, limiter, counting = make_app(backend(), clock)

    @app.post("/complete")
    @limiter.limit(
        "100/day",
        algorithm=algorithm,
        key_func=lambda: request.headers["X-Tenant"],
        cost=lambda: request.get_json()["max_tokens"],
        settle=lambda response: g.tokens_used,
    )
    def complete() -> ResponseReturnValue:
        g.tokens_used = request.get_json()["use"]
        return {"tokens": g.tokens_used}

    client = app.test_client()

    def ask(max_tokens: int, use: int, tenant: str = "acme") -> tuple[int, str | None]:
        response = client.post(
            "/complete", json={"max_tokens": max_tokens, "use": use}, headers={"X-Tenant": tenant}
        )
        return response.status_code, response.headers.get("X-RateLimit-Remaining")

    assert ask(50, 20) == (200, "80")  # 50 reserved, 30 given back
    assert [c.release for c in counting.checks[-1]] == [True]
    assert ask(90, 1)[0] == 429  # the reservation does not fit: the view never ran
    assert ask(30, 60) == (200, "20")  # 30 reserved, 30 more charged
    assert ask(10, 50) == (200, "0")  # 10 reserved, 40 more: 30 in debt
    assert ask(1, 0)[0] == 429
    assert ask(1, 0, tenant="other") == (200, "100")  # another tenant's quota
    clock.advance(2 * 86_400)
    assert ask(1, 0)[0] == 200  # repaid


@pytest.mark.parametrize("algorithm", ["token_bucket", "gcra"])
def test_a_debt_is_repaid_by_the_refill(backend: Backend, clock: FakeClock, algorithm: str) -> None:
    """The refilling algorithms carry a debt: 30 units over a 100/day quota are repaid by the
    refill before a request passes again (a quota that stopped at the limit would admit one
    after a fifth of a day, with 20 units earned back)."""
    app, limiter, _ = make_app(backend(), clock)

    @app.post("/complete")
    @limiter.limit(
        "100/day",
        algorithm=algorithm,
        cost=lambda: int(request.args["reserve"]),
        settle=lambda response: int(request.args["used"]),
    )
    def complete() -> str:
        return "ok"

    client = app.test_client()
    assert client.post("/complete?reserve=100&used=130").status_code == 200  # 30 in debt
    clock.advance(86_400 * 0.2)  # 20 units earned back: 10 still owed
    assert client.post("/complete?reserve=1&used=1").status_code == 429
    clock.advance(86_400 * 0.3)  # 50 earned back: 20 left after the debt
    assert client.post("/complete?reserve=1&used=1").status_code == 200


def _settled_when_closed(app: Flask, limiter: Limiter, algorithm: str) -> None:
    @app.post("/batch")
    @limiter.limit(
        "10/minute",
        algorithm=algorithm,
        cost=lambda: int(request.args["cost"]),
        settle=lambda response: int(response.headers["X-Used"]),
    )
    def batch() -> Response:
        used = {"X-Used": request.args["used"]}  # settled when its body ends
        return Response(iter([b"x"]), mimetype="text/plain", headers=used)


@pytest.mark.parametrize("algorithm", ["fixed_window", "sliding_window_counter"])
def test_a_reservation_is_never_given_back_to_the_window_after_its_own(
    backend: Backend, clock: FakeClock, algorithm: str
) -> None:
    """A request reserving a whole quota just before its window ends, ending (unused) in the
    next one: given back there, it would hand the next window's spenders a second quota."""
    app, limiter, _ = make_app(backend(), clock)
    clock.advance(60 - clock.now_us // 1_000_000 % 60 + 58)  # 2 s before a window ends
    _settled_when_closed(app, limiter, algorithm)
    client = app.test_client()
    straddling = client.post("/batch?cost=10&used=0", buffered=False)  # all 10, in flight
    clock.advance(40)  # 38 s into the next window (the counter weighs 10 x 22/60 of the last)
    assert client.post("/batch?cost=6&used=6").status_code == 200
    straddling.get_data()
    straddling.close()  # used nothing: its 10 are not taken off the new window's 6
    assert client.post("/batch?cost=6&used=6").status_code == 429
    clock.advance(120)
    same = client.post("/batch?cost=10&used=0", buffered=False)
    same.get_data()
    same.close()  # in its own window: given back
    assert client.post("/batch?cost=10&used=10").status_code == 200


@pytest.mark.parametrize("algorithm", ["token_bucket", "gcra", "sliding_window_log"])
def test_a_reservation_ended_a_period_later_gives_back_nothing_time_gave_back(
    backend: Backend, clock: FakeClock, algorithm: str
) -> None:
    """A stream reserving a whole quota and using none, ended after a period: the bucket had
    refilled (the log's entry had expired) and others had spent it again; given back then, its
    units were a second quota (an attack review: 10 admitted of 5 per period)."""
    app, limiter, _ = make_app(backend(), clock)
    _settled_when_closed(app, limiter, algorithm)
    client = app.test_client()
    stream = client.post("/batch?cost=10&used=0", buffered=False)  # all 10, in flight
    clock.advance(61)
    assert client.post("/batch?cost=10&used=10").status_code == 200  # time gave them back
    stream.get_data()
    stream.close()  # used nothing, but its 10 came back with time already
    assert client.post("/batch?cost=1&used=1").status_code == 429


@pytest.mark.parametrize("algorithm", ["token_bucket", "gcra"])
def test_a_bucket_gives_back_a_reservation_less_what_refilled_since(
    backend: Backend, clock: FakeClock, algorithm: str
) -> None:
    """10 reserved, none used, given back 30 s later at 10 a minute: 5 of them came back with
    time (and went to another request), so 5 are given back, as if the 10 were never taken."""
    app, limiter, _ = make_app(backend(), clock)
    _settled_when_closed(app, limiter, algorithm)
    client = app.test_client()
    stream = client.post("/batch?cost=10&used=0", buffered=False)
    clock.advance(30)
    assert client.post("/batch?cost=5&used=5").status_code == 200
    stream.get_data()
    stream.close()
    assert client.post("/batch?cost=6&used=6").status_code == 429
    assert client.post("/batch?cost=5&used=5").status_code == 200


@pytest.mark.parametrize("algorithm", ["token_bucket", "gcra"])
def test_a_bucket_far_from_full_gets_a_late_reservation_back_whole(
    backend: Backend, clock: FakeClock, algorithm: str
) -> None:
    """5 spent, then 5 reserved and none used, given back 30 s later at 10 a minute with nobody
    else spending: the 5 it refilled meanwhile filled what the bucket lacked, so the 5 go back
    whole (cutting them by what it refilled cost the client half its limit: a review)."""
    app, limiter, _ = make_app(backend(), clock)
    _settled_when_closed(app, limiter, algorithm)
    client = app.test_client()
    assert client.post("/batch?cost=5&used=5").status_code == 200
    stream = client.post("/batch?cost=5&used=0", buffered=False)
    clock.advance(30)
    stream.get_data()
    stream.close()
    assert client.post("/batch?cost=10&used=10").status_code == 200  # full, as if never taken
    assert client.post("/batch?cost=1&used=1").status_code == 429


def test_debts_in_flight_hold_at_most_one_limit_past_a_full_window(
    backend: Backend, clock: FakeClock
) -> None:
    """Five requests reserving 1 and using 100 of a 10/minute counter: each owes one limit at
    most, and the key holds 2 limits at most (50 units would keep the client out for 80 % of the
    next window instead of half of it). The fixed window's twin holds the same bound."""
    app, limiter, _ = make_app(backend(), clock)
    clock.advance(60 - clock.now_us // 1_000_000 % 60)  # the start of a window

    @app.post("/complete")
    @limiter.limit("10/minute", settle=lambda response: 100)
    def complete() -> Response:
        return Response(iter([b"x"]), mimetype="text/plain")  # settled when its body ends

    client = app.test_client()
    in_flight = [client.post("/complete", buffered=False) for _ in range(5)]
    for response in in_flight:
        response.get_data()
        response.close()
    clock.advance(60 + 27)  # 45 % into the next window: 20 x 0.55 = 11 units still weigh
    assert client.post("/complete").status_code == 429
    clock.advance(6)  # 55 % in: 20 x 0.45 = 9
    assert client.post("/complete").status_code == 200
    state, _ = fixed_window.refund(None, 10, 60_000_000, -100, 0)
    assert state is not None and state.used == 20


def test_a_reservation_is_settled_when_a_later_limit_of_the_request_refuses_it(
    backend: Backend, clock: FakeClock
) -> None:
    """The route's budget reserves 40 and settles 0; a ``with`` block's limit inside the view
    then refuses. The block's call wrote nothing, but the budget's had: it is settled by the
    response (given back here), where it used to stay charged (an attack review: two refused
    requests held 80 of the 100, and a failures-only login count reached 3 with no failure)."""
    app, limiter, _ = make_app(backend(), clock)

    @app.post("/complete")
    @limiter.limit("100/hour", cost=40, settle=lambda response: 0)
    def complete() -> str:
        with limiter.limit("1/minute"):
            return "done"

    @app.post("/login")
    @limiter.limit("2/hour", deduct_when=lambda response: response.status_code == 401)
    def login() -> str:
        with limiter.limit("1/minute"):
            return "welcome"

    client = app.test_client()

    def post(path: str) -> int:
        with client.post(path) as response:  # settled when its body ends
            return response.status_code

    for path in ("/complete", "/login"):
        assert [post(path) for _ in range(3)] == [200, 429, 429]
    clock.advance(121)  # the blocks' counts are gone; the hour's are what was settled
    assert [post("/complete") for _ in range(2)] == [200, 429]
    assert [post("/login") for _ in range(2)] == [200, 429]


def test_a_settle_that_fails_leaves_the_reservation_charged(
    backend: Backend, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    app, limiter, _ = make_app(backend(), clock)

    @app.post("/complete")
    @limiter.limit("10/day", cost=3, settle=lambda response: g.tokens_used)
    def complete() -> ResponseReturnValue:
        return "the view forgot to set g.tokens_used"

    client = app.test_client()
    with caplog.at_level(logging.ERROR, logger="flask_distlimit"):
        assert [client.post("/complete").status_code for _ in range(4)] == [200] * 3 + [429]
    # once a minute per limit, not a traceback per request: a client may make it fail each time
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "settle callable" in errors[0], errors
    clock.advance(86_400)  # a new day's quota, and a minute since the line: the next is told
    with caplog.at_level(logging.ERROR, logger="flask_distlimit"):
        assert client.post("/complete").status_code == 200
    assert sum(r.levelno == logging.ERROR for r in caplog.records) == 2


@pytest.mark.parametrize("policy", ["open", "closed", "local"])
def test_a_reservation_whose_call_failed_is_never_given_back(clock: FakeClock, policy: str) -> None:
    """A call the storage never answered (down under ``closed``, or busy under any policy: a
    503) reserved nothing it knows of; its reservation was settled by the 503 all the same, and
    a failures-only login limit gave back a failure per 503 (an attack review: 6 guesses of 3).
    Under ``open`` and ``local`` the request is admitted as the policy says, and its
    reservation follows that decision."""
    from flask_distlimit.storage.memory import MemoryStorage
    from tests.faults import FailingStorage

    failing = {4, 5, 6}  # the fifth to seventh calls: after three failures and one refusal
    storage = FailingStorage(MemoryStorage(clock=clock), lambda n: n in failing)
    app, limiter, _ = make_app(
        storage, clock, DISTLIMIT_FAILURE_POLICY=policy, DISTLIMIT_BREAKER_FAIL_MAX=10
    )

    @app.post("/login")
    @limiter.limit("3/hour", deduct_when=lambda response: response.status_code == 401)
    def login() -> ResponseReturnValue:
        return "bad password", 401

    client = app.test_client()
    seen = [client.post("/login").status_code for _ in range(11)]
    assert seen[:4] == [401, 401, 401, 429]
    if policy == "closed":
        assert seen[4:7] == [503] * 3
    assert seen[7:] == [429] * 4  # no failure given back: the budget stays spent
