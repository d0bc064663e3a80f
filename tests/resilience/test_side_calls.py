"""Side calls end with their own failure (issue 24, finding 2 and item 3): a concurrency slot's
give-back, a refund or an after-response charge that fails is counted and logged, and never
puts the process into the local fallback's engaged state nor changes another request's
decision; an after-response charge goes through its route's own failure policy.

The outages are injected in front of a real redis-server (:class:`tests.faults.FailingStorage`
fails the calls the test picks, the others reach the server); one clock drives the limiter.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from flask import Flask

from flask_distlimit import Limiter
from flask_distlimit.core.decision import Check, Evaluation
from flask_distlimit.errors import StorageUnavailable
from flask_distlimit.storage.redis import RedisStorage
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import clock, make_app, redis_storage
from tests.faults import FailingStorage, Switch

__all__ = ["clock", "redis_storage"]  # fixtures used below


def _export_app(
    storage: RedisStorage, clock: FakeClock, switch: Switch, *, slots: bool = True, **config: object
) -> tuple[Flask, Limiter]:
    app, limiter, _ = make_app(
        FailingStorage(storage, switch),
        clock,
        DISTLIMIT_FAILURE_POLICY="local",
        DISTLIMIT_INSTANCES=4,
        DISTLIMIT_BREAKER_RESET_TIMEOUT=30,
        **config,
    )

    def export() -> str:
        return "rows"

    limited = limiter.limit("40/minute")(export)
    app.get("/export")(limiter.concurrency(4)(limited) if slots else limited)
    return app, limiter


@pytest.mark.parametrize("slots", [True, False], ids=["slot", "fleet-capacity"])
def test_one_blip_never_keeps_the_process_on_local_limits(
    redis_storage: RedisStorage, clock: FakeClock, slots: bool
) -> None:
    """One request decided locally during a blip; Redis is healthy from then on. Every later
    request is Redis's to decide: 40 of 40 pass a 40/minute limit, not 40 / 4 instances. The
    slot given back is the route's concurrency slot, or the fleet's in-flight slot
    (DISTLIMIT_FLEET_CAPACITY, which every route takes)."""
    switch = Switch()
    config = {} if slots else {"DISTLIMIT_FLEET_CAPACITY": 100}
    app, limiter = _export_app(redis_storage, clock, switch, slots=slots, **config)
    client = app.test_client()
    switch.down = True
    assert client.get("/export").status_code == 200  # decided locally (a share of 10)
    switch.down = False
    clock.advance(300)
    assert client.get("/export").status_code == 200  # the first success: engaged 30 s more
    clock.advance(300)
    codes = [client.get("/export").status_code for _ in range(40)]
    assert codes.count(200) == 40, codes  # before: 10
    guard = limiter.state(app).guard
    assert not guard.fallback.engaged
    assert guard.health()["fallback_held_keys"] == 0


def test_a_failed_give_back_is_counted_and_logged_once_a_minute_and_changes_nothing_else(
    redis_storage: RedisStorage, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis admits each request; the slot's give-back meets an outage (the link drops while
    the view runs) 30 times. Each is counted, one WARNING line says so, the lease gives the
    slots back, and no other request is decided locally: the fallback is never engaged."""
    switch = Switch()
    app, limiter = _export_app(redis_storage, clock, switch, DISTLIMIT_CONCURRENCY_LEASE=5)

    @app.get("/drop")
    @limiter.concurrency(100, scope="drop")
    def drop() -> str:
        switch.down = True  # the give-back at teardown fails
        return "dropped"

    client = app.test_client()
    guard = limiter.state(app).guard
    with caplog.at_level("WARNING", logger="flask_distlimit"):
        for _ in range(30):
            assert client.get("/drop").status_code == 200
            switch.down = False
            assert guard.breaker.state == "closed"  # an answer in between resets its count
            assert client.get("/export").status_code == 200
    health = guard.health()
    assert health["side_call_failures"] == 30
    assert "give-back" in str(health["side_call_last"])
    lines = [r for r in caplog.records if "failed and is skipped" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert not guard.fallback.holding  # nothing was ever decided or counted in-process
    codes = [client.get("/export").status_code for _ in range(11)]
    assert codes == [200] * 10 + [429]  # Redis's 40/minute, exact: 30 + 10
    clock.advance(61)
    caplog.clear()
    with caplog.at_level("WARNING", logger="flask_distlimit"):
        client.get("/drop")
        switch.down = False
    lines = [r.getMessage() for r in caplog.records if "failed and is skipped" in r.getMessage()]
    assert len(lines) == 1 and " 30 call(s)" in lines[0], lines  # 29 unlogged, and this


def _login_app(
    storage: RedisStorage, clock: FakeClock, switch: Switch, **config: object
) -> tuple[Flask, Limiter]:
    app, limiter, _ = make_app(FailingStorage(storage, switch), clock, **config)

    @app.post("/login")
    @limiter.limit(
        "5/minute", deduct_when=lambda response: response.status_code == 401, on_failure="local"
    )
    def login() -> tuple[str, int]:
        return "wrong password", 401

    @app.get("/page")
    @limiter.limit("5/minute", on_failure="local")
    def page() -> str:
        return "a page, never a 304"

    return app, limiter


def test_an_after_response_charge_goes_through_the_routes_local_policy(
    redis_storage: RedisStorage, clock: FakeClock
) -> None:
    """Redis down, on_failure="local" (the app's policy is open): 5 of 20 failed logins pass a
    5/minute limit, as they would with Redis up; the 15 others are refused before the view."""
    switch = Switch()
    app, limiter = _login_app(redis_storage, clock, switch)
    client = app.test_client()
    switch.down = True
    codes = [client.post("/login").status_code for _ in range(20)]
    assert codes == [401] * 5 + [429] * 15
    assert limiter.state(app).guard.health()["side_call_failures"] == 0  # none dropped


def test_a_revalidation_under_conditional_cost_0_is_charged_locally_in_an_outage(
    redis_storage: RedisStorage, clock: FakeClock
) -> None:
    switch = Switch()
    app, _ = _login_app(redis_storage, clock, switch, DISTLIMIT_CONDITIONAL_COST=0)
    client = app.test_client()
    switch.down = True
    codes = [
        client.get("/page", headers={"If-None-Match": '"bogus"'}).status_code for _ in range(8)
    ]
    assert codes == [200] * 5 + [429] * 3


def test_a_dropped_give_back_under_policy_open_is_counted_and_logged_once(
    redis_storage: RedisStorage, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis goes down while the view runs: the reservation was made, its give-back is
    dropped (open), counted and logged once; the reservation stays charged."""
    switch = Switch()
    app, limiter, _ = make_app(FailingStorage(redis_storage, switch), clock)

    @app.post("/open-login")
    @limiter.limit("5/minute", deduct_when=lambda response: response.status_code == 401)
    def open_login() -> str:
        switch.down = True
        return "welcome"  # a right password: the reservation would be given back

    client = app.test_client()
    codes = []
    with caplog.at_level("WARNING", logger="flask_distlimit"):
        for _ in range(5):
            switch.down = False
            codes.append(client.post("/open-login").status_code)
    assert codes == [200] * 5
    assert limiter.state(app).guard.health()["side_call_failures"] == 5
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if "after-response charge" in m]) == 1, messages
    switch.down = False
    assert client.post("/open-login").status_code == 429  # the 5 reservations stayed charged


def test_a_refund_across_cluster_nodes_that_fails_is_counted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """In-process, beside the real-server tests above: a two-node fake cluster whose refund
    fails (the node died between the call and the give-back). The refused request stays
    refused, the failure is counted, and it logs one WARNING line (it logged at DEBUG)."""
    from prometheus_client import CollectorRegistry

    from flask_distlimit.resilience.guard import Guard
    from flask_distlimit.telemetry.metrics import Metrics
    from tests.guard_helpers import FakeClock as MonotonicClock
    from tests.resilience.test_node_breakers import NOW, Shards, kinds, limit

    class RefundFails(Shards):
        def refund(self, checks: Sequence[Check], *, now_us: int | None = None) -> Evaluation:
            raise StorageUnavailable("the node died before the give-back")

    storage = RefundFails()
    registry = CollectorRegistry()
    guard = Guard(
        storage, policy="closed", fail_max=5, clock=MonotonicClock(), metrics=Metrics(registry)
    )
    assert kinds(guard, [limit("bob", 1)], 1) == ["allowed"]  # bob's one unit: spent
    with caplog.at_level("WARNING", logger="flask_distlimit"):
        for _ in range(3):  # ann's node admits, bob's refuses: ann's unit should come back
            outcome = guard.evaluate([limit("ann"), limit("bob", 1)], now_us=NOW)
            assert outcome.evaluation is not None and not outcome.evaluation.allowed
    assert guard.health()["side_call_failures"] == 3
    assert registry.get_sample_value("distlimit_side_call_failures_total") == 3
    assert "refund" in str(guard.health()["side_call_last"])
    assert len([r for r in caplog.records if "refund" in r.getMessage()]) == 1
    assert storage.remaining(limit("ann")) == 0  # consumed until the window ends, as documented
