"""Issue 35 item 4: a settlement is a side call of the route's failure policy, on a real
redis-server behind a switch that fails every call while down (:class:`tests.faults.Switch`).
Under ``local`` the settlement is made in the local count that counted the reservation, during
an outage and while that count still holds the key after it; under ``open`` and ``closed`` it
is dropped, counted as a failed side call, and the reservation stays charged in Redis. And
reserve/settle on a ``redis+sentinel://`` app, every algorithm (issue 35 item 1)."""

from __future__ import annotations

import pytest
import redis
from flask import Flask, request
from flask.typing import ResponseReturnValue

from flask_distlimit import ALGORITHMS, Limiter
from flask_distlimit.storage.redis import RedisStorage
from flask_distlimit.testing import FakeClock
from tests.conftest import assert_every_key_has_ttl
from tests.distlimit_fixtures import QUIET, clock, make_app, redis_storage
from tests.faults import FailingStorage, Switch
from tests.servers import SentinelServers

__all__ = ["clock", "redis_storage"]  # fixtures used below

pytestmark = pytest.mark.redis


def settle_app(storage: RedisStorage, clock: FakeClock, switch: Switch, policy: str) -> Flask:
    """``POST /complete?reserve=R&used=U[&cut=1]`` against 100/day: ``cut`` takes the storage
    down inside the view, between the reservation and the settlement; ``deduct=0`` makes
    ``deduct_when`` answer false (the reservation is given back)."""
    app, limiter, _ = make_app(
        FailingStorage(storage, switch), clock, DISTLIMIT_FAILURE_POLICY=policy
    )

    @app.post("/complete")
    @limiter.limit(
        "100/day",
        algorithm="fixed_window",
        key_func=lambda: "tenant",
        cost=lambda: int(request.args["reserve"]),
        settle=lambda response: int(request.args["used"]),
        deduct_when=lambda response: request.args.get("deduct") != "0",
    )
    def complete() -> ResponseReturnValue:
        if request.args.get("cut"):
            switch.down = True
        return "ok"

    return app


def ask(app: Flask, query: str) -> tuple[int, str | None]:
    with app.test_client() as client:
        response = client.post(f"/complete?{query}")
        return response.status_code, response.headers.get("X-RateLimit-Remaining")


def counted(book: redis.Redis) -> int:
    """The tenant's count in Redis (0: no key)."""
    keys = list(book.scan_iter(match="*fixed_window*", count=1000))
    assert len(keys) <= 1, keys
    return int(book.hget(keys[0], "n") or 0) if keys else 0


@pytest.mark.parametrize("deduct", [True, False], ids=["settle", "deduct_when"])
def test_under_local_a_settlement_during_an_outage_is_made_in_the_local_count(
    redis_storage: RedisStorage, clock: FakeClock, deduct: bool
) -> None:
    """The reservation was charged in Redis; its settlement meets the outage and is made in the
    local count (which starts from what Redis last said was left): the give-back is there for
    the next request, the debt refuses it."""
    switch = Switch()
    app = settle_app(redis_storage, clock, switch, "local")
    if deduct:
        assert ask(app, "reserve=50&used=20&cut=1") == (200, "80")  # 30 given back locally
    else:
        assert ask(app, "reserve=50&used=50&deduct=0&cut=1") == (200, "100")
    left = 80 if deduct else 100
    assert ask(app, f"reserve={left}&used={left}")[0] == 200  # fits only after the give-back
    assert ask(app, "reserve=1&used=1")[0] == 429
    # A debt during the outage is charged locally too.
    other = Switch()
    app2 = settle_app(redis_storage, clock, other, "local")
    clock.advance(86_400)
    assert ask(app2, "reserve=10&used=90&cut=1") == (200, "10")  # 80 more: 10 left
    assert ask(app2, "reserve=11&used=0")[0] == 429
    assert ask(app2, "reserve=10&used=10")[0] == 200


@pytest.mark.parametrize("deduct", [True, False], ids=["settle", "deduct_when"])
def test_under_local_a_settlement_after_an_outage_is_made_where_the_key_is_still_counted(
    redis_storage: RedisStorage, clock: FakeClock, redis_client: redis.Redis, deduct: bool
) -> None:
    """Redis is back and the breaker closed, but the local count still holds the key (its
    admissions of the outage still matter): a give-back or a debt on it is made in Redis and
    in the local count, never refused by that count's peek (a settlement never denies). It was
    dropped whenever the local count had less left than the settlement's units: the give-back
    lost, or the debt never charged."""
    switch = Switch(down=True)
    app = settle_app(redis_storage, clock, switch, "local")
    assert ask(app, "reserve=40&used=40") == (200, "60")  # during the outage: local only
    assert ask(app, "reserve=40&used=40") == (200, "20")
    switch.down = False
    clock.advance(31)  # past the breaker's reset timeout: its trial call succeeds
    if deduct:
        assert ask(app, "reserve=15&used=0")[0] == 200  # 15 reserved then given back
    else:
        assert ask(app, "reserve=15&used=15&deduct=0")[0] == 200
    assert Limiter.state(app).guard.node_breaker.state == "closed"
    assert counted(redis_client) == 0  # Redis gave the 15 back
    assert ask(app, "reserve=20&used=20")[0] == 200  # the local count has 20 left again
    assert counted(redis_client) == 20
    assert ask(app, "reserve=1&used=1")[0] == 429
    clock.advance(86_400)
    assert ask(app, "reserve=10&used=30")[0] == 200  # a debt of 20 past the reservation
    assert counted(redis_client) == 30


@pytest.mark.parametrize("policy", ["open", "closed"])
def test_under_open_or_closed_a_settlement_during_an_outage_is_dropped_and_counted(
    redis_storage: RedisStorage, clock: FakeClock, redis_client: redis.Redis, policy: str
) -> None:
    """The response is made; the settlement is dropped, counted in ``side_call_failures``, and
    the reservation stays charged in Redis: neither the give-back nor the debt is made."""
    switch = Switch()
    app = settle_app(redis_storage, clock, switch, policy)
    state = Limiter.state(app)
    assert ask(app, "reserve=50&used=20&cut=1")[0] == 200
    assert ask(app, "reserve=1&used=1")[0] == (200 if policy == "open" else 503)
    assert state.guard.health()["side_call_failures"] == 1
    switch.down = False
    clock.advance(31)  # past the breaker's reset timeout
    assert counted(redis_client) == 50  # the reservation, not the real cost
    assert ask(app, "reserve=10&used=10&deduct=0&cut=1")[0] == 200
    assert state.guard.health()["side_call_failures"] == 2
    assert counted(redis_client) == 60
    switch.down = False
    clock.advance(31)
    assert ask(app, "reserve=10&used=40&cut=1")[0] == 200
    assert state.guard.health()["side_call_failures"] == 3
    assert counted(redis_client) == 70  # the debt of 30 was dropped too


@pytest.mark.sentinel
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_settle_on_sentinel_charges_or_gives_back_the_difference(
    redis_sentinel: SentinelServers, clock: FakeClock, algorithm: str
) -> None:
    """Issue 35 item 1 on a ``redis+sentinel://`` app, every algorithm: a reservation settled
    lower gives the rest back, one settled higher charges the difference, past the limit (a
    debt that refuses the next request)."""
    master = redis_sentinel.current_master().client()
    master.flushall()
    app = Flask(f"sentinel-settle-{algorithm}")
    app.config.update(QUIET, DISTLIMIT_STORAGE_URL=redis_sentinel.url, DISTLIMIT_REDIS_TIMEOUT=2.0)
    limiter = Limiter(app, clock=clock)

    @app.post("/complete")
    @limiter.limit(
        "100/day",
        algorithm=algorithm,
        key_func=lambda: "tenant",
        cost=lambda: int(request.args["reserve"]),
        settle=lambda response: int(request.args["used"]),
    )
    def complete() -> str:
        return "ok"

    try:
        assert ask(app, "reserve=50&used=20") == (200, "80")  # 30 given back
        assert ask(app, "reserve=90&used=0")[0] == 429  # does not fit
        assert ask(app, "reserve=30&used=60") == (200, "20")  # 30 more charged
        assert ask(app, "reserve=10&used=50") == (200, "0")  # 40 more: 30 in debt
        assert ask(app, "reserve=1&used=0")[0] == 429
        assert Limiter.state(app).guard.health()["side_call_failures"] == 0
        assert any(master.scan_iter(match=f"*{algorithm}*"))  # counted on the master
        assert_every_key_has_ttl(master)
    finally:
        Limiter.state(app).storage.close()
        master.flushall()
        master.close()
