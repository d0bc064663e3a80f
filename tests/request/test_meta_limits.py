"""Meta limits (``DISTLIMIT_META_LIMITS``, Flask-Limiter's ``meta_limits``; issue 33): a client
whose requests are refused too often is refused outright until the meta limit frees. Pinned on
memory://, a real redis-server and a real 3-primary Redis Cluster; the breach is counted in the
request's own script call, so concurrent breaches are counted exactly."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
from flask import Flask

from flask_distlimit import Limiter
from flask_distlimit.core.decision import Check
from flask_distlimit.errors import ConfigurationError
from flask_distlimit.storage.base import Storage
from flask_distlimit.storage.cluster import ClusterStorage
from flask_distlimit.storage.memory import MemoryStorage
from flask_distlimit.storage.redis import RedisStorage
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import clock, make_app

__all__ = ["clock"]

Backend = Callable[[], Storage]
HOUR = 3600


@pytest.fixture(
    params=[
        pytest.param("memory", id="memory"),
        pytest.param("redis", marks=pytest.mark.redis, id="redis"),
        pytest.param("cluster", marks=pytest.mark.redis, id="cluster"),
    ]
)
def backend(request: pytest.FixtureRequest, clock: FakeClock) -> Iterator[Backend]:
    """Storages sharing one store: memory, the session's redis-server, or its Cluster."""
    made: list[Any] = []
    if request.param == "memory":
        shared = MemoryStorage(clock=clock)
        yield lambda: shared
        return
    if request.param == "redis":
        kwargs = request.getfixturevalue("redis_client").connection_pool.connection_kwargs

        def make() -> Storage:
            made.append(RedisStorage(host=kwargs["host"], port=kwargs["port"], timeout=2.0))
            return made[-1]  # type: ignore[no-any-return]
    else:
        request.getfixturevalue("cluster_client")  # flushed before, every key's TTL after
        nodes = request.getfixturevalue("redis_cluster").startup_nodes

        def make() -> Storage:
            made.append(ClusterStorage(nodes, timeout=2.0))
            return made[-1]  # type: ignore[no-any-return]

    yield make
    for storage in made:
        storage.close()


def meta_app(backend: Backend, clock: FakeClock, **config: Any) -> tuple[Flask, Limiter]:
    config.setdefault("DISTLIMIT_META_LIMITS", "2/hour")
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_ALGORITHM="fixed_window", **config)

    @app.get("/tight")
    @limiter.limit("1/minute")
    def tight() -> str:
        return "ok"

    @app.get("/roomy")
    @limiter.limit("100/minute")
    def roomy() -> str:
        return "ok"

    return app, limiter


def test_two_breaches_refuse_every_route_until_the_meta_window_frees(
    backend: Backend, clock: FakeClock
) -> None:
    app, _ = meta_app(backend, clock)
    client = app.test_client()
    assert client.get("/tight").status_code == 200
    assert client.get("/tight").status_code == 429  # breach 1
    assert client.get("/roomy").status_code == 200  # one breach is not enough
    assert client.get("/tight").status_code == 429  # breach 2: the meta limit is exhausted
    refused = client.get("/roomy")  # a route the client never breached
    assert refused.status_code == 429
    body = refused.get_json()
    assert body["violated-policies"] == ["meta:2/hour"]
    assert refused.headers["Content-Type"] == "application/problem+json"
    # Retry-After: until the meta limit frees (its fixed hour ends), not the route's minute
    assert int(refused.headers["Retry-After"]) == HOUR - (clock.now_us // 1_000_000) % HOUR
    assert refused.headers["X-RateLimit-Limit"] == "2"  # the headers name the meta limit
    assert refused.headers["X-RateLimit-Remaining"] == "0"
    clock.advance(HOUR - (clock.now_us // 1_000_000) % HOUR)
    assert client.get("/roomy").status_code == 200
    assert client.get("/tight").status_code == 200  # its minute is over as well


def test_a_request_the_meta_limit_refuses_is_no_breach_and_charges_nothing(
    backend: Backend, clock: FakeClock
) -> None:
    app, _ = meta_app(backend, clock, DISTLIMIT_META_LIMITS="1/hour")
    client = app.test_client()
    client.get("/tight")
    assert client.get("/tight").status_code == 429  # the one breach the meta limit allows
    for _ in range(5):
        assert client.get("/roomy").status_code == 429  # refused by the meta limit alone
    clock.advance(HOUR - (clock.now_us // 1_000_000) % HOUR)
    # Those 5 refusals neither used /roomy's quota nor counted as breaches: whole again.
    allowed = client.get("/roomy")
    assert allowed.status_code == 200
    assert allowed.headers["X-RateLimit-Remaining"] == "99"


def test_only_refusals_count_and_one_request_is_one_breach(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter = meta_app(backend, clock)

    @app.get("/both")
    @limiter.limit("1/minute;1/hour")
    def both() -> str:
        return "ok"

    client = app.test_client()
    for _ in range(50):  # admitted requests are never breaches
        assert client.get("/roomy").status_code == 200
    assert client.get("/both").status_code == 200
    refused = client.get("/both")  # two limits refuse it: one breach, not two
    assert refused.status_code == 429
    assert "meta:2/hour" not in refused.get_json()["violated-policies"]
    assert client.get("/roomy").status_code == 200


def test_meta_limits_count_per_identity(backend: Backend, clock: FakeClock) -> None:
    app, _ = meta_app(backend, clock, DISTLIMIT_META_LIMITS="1/hour")
    client = app.test_client()
    ada = {"REMOTE_ADDR": "203.0.113.1"}
    bob = {"REMOTE_ADDR": "203.0.113.2"}
    client.get("/tight", environ_base=ada)
    client.get("/tight", environ_base=ada)
    assert client.get("/roomy", environ_base=ada).status_code == 429
    assert client.get("/roomy", environ_base=bob).status_code == 200


def test_the_app_on_breach_hook_hears_a_meta_refusal(backend: Backend, clock: FakeClock) -> None:
    app, limiter = meta_app(backend, clock, DISTLIMIT_META_LIMITS="1/hour")
    heard: list[tuple[str, ...]] = []

    @limiter.on_breach
    def hook(breach: Any) -> None:
        heard.append(breach.violated_policies)

    client = app.test_client()
    client.get("/tight")
    client.get("/tight")
    client.get("/roomy")
    assert heard == [("tight:1/minute",), ("meta:1/hour",)]


def test_no_meta_limit_means_no_meta_check_in_any_call(clock: FakeClock) -> None:
    app, limiter, counting = make_app(MemoryStorage(clock=clock), clock)

    @app.get("/tight")
    @limiter.limit("1/minute")
    def tight() -> str:
        return "ok"

    client = app.test_client()
    client.get("/tight")
    client.get("/tight")
    assert counting.checks and not any(c.meta for call in counting.checks for c in call)


@pytest.mark.parametrize("value", ["2/fortnight", 5, "-1/hour"])
def test_a_bad_meta_limit_is_refused_at_init_app(value: object, clock: FakeClock) -> None:
    with pytest.raises(ConfigurationError, match="DISTLIMIT_META_LIMITS"):
        make_app(MemoryStorage(clock=clock), clock, DISTLIMIT_META_LIMITS=value)


def test_a_meta_limit_of_0_refuses_every_limited_request_as_flask_limiter_does(
    clock: FakeClock,
) -> None:
    app, limiter, counting = make_app(
        MemoryStorage(clock=clock), clock, DISTLIMIT_META_LIMITS="0/hour"
    )

    @app.get("/limited")
    @limiter.limit("5/minute")
    def limited() -> str:
        return "ok"

    assert [app.test_client().get("/limited").status_code for _ in range(2)] == [429, 429]
    assert counting.evaluations == 0  # decided without the storage


# -- exactness under concurrency, at the storage ------------------------------------------------


def _storage(kind: str, request: pytest.FixtureRequest, clock: FakeClock) -> Storage:
    if kind == "memory":
        return MemoryStorage(clock=clock)
    if kind == "redis":
        kwargs = request.getfixturevalue("redis_client").connection_pool.connection_kwargs
        return RedisStorage(host=kwargs["host"], port=kwargs["port"], timeout=5.0)
    request.getfixturevalue("cluster_client")
    return ClusterStorage(request.getfixturevalue("redis_cluster").startup_nodes, timeout=5.0)


@pytest.mark.parametrize(
    "kind",
    [
        "memory",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("cluster", marks=pytest.mark.redis),
    ],
)
def test_concurrent_breaches_are_counted_exactly_and_nothing_passes_after(
    kind: str, request: pytest.FixtureRequest, clock: FakeClock
) -> None:
    storage = _storage(kind, request, clock)
    meta_limit, threads = 5, 16
    meta = Check("t:{c1}:m:5/3600:fixed_window", "fixed_window", meta_limit, HOUR, meta=True)
    full = Check("t:{c1}:r:1/60:fixed_window", "fixed_window", 1, 60)
    roomy = Check("t:{c1}:r:1000/60:fixed_window", "fixed_window", 1000, 60)
    now = clock.now_us
    assert storage.evaluate([full, meta], now_us=now).allowed  # takes the one unit
    start = threading.Barrier(threads)
    answers: list[tuple[bool, bool]] = []  # (admitted, refused by the meta limit)
    lock = threading.Lock()

    def client() -> None:
        start.wait()
        for check in (full, roomy, full):
            e = storage.evaluate([check, meta], now_us=now)
            with lock:
                answers.append((e.allowed, not e.decisions[1].allowed))

    workers = [threading.Thread(target=client) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    try:
        breaches = sum(1 for ok, by_meta in answers if not ok and not by_meta)
        assert breaches == meta_limit  # never more breaches counted than happened, nor fewer
        peek = storage.evaluate([roomy, meta], now_us=now)
        assert not peek.allowed and peek.decisions[1].remaining == 0
        # every request after the last counted breach was refused: the meta limit never admits
        # once exhausted (the admitted ones were roomy requests before it was)
        assert sum(ok for ok, _ in answers) <= threads
        assert all(not ok for ok, by_meta in answers if by_meta)
        roomy_left = storage.evaluate([replace(roomy, cost=0)], now_us=now).decisions[0].remaining
        assert roomy_left == 1000 - sum(ok for ok, _ in answers)  # the refused charged nothing
    finally:
        if kind != "memory":
            storage.delete([meta.key, full.key, roomy.key])
            storage.close()


@pytest.mark.parametrize(
    "kind",
    ["memory", pytest.param("cluster", marks=pytest.mark.redis)],  # the stores that refund
)
def test_a_refund_gives_a_meta_check_nothing_back_and_counts_the_breach(
    kind: str, request: pytest.FixtureRequest, clock: FakeClock
) -> None:
    """A Cluster gives back what an admitting slot group consumed when another group refused:
    the meta check in it consumed nothing, so it gets nothing back; it counts that refusal, one
    breach, in the same call; sent at cost 0 (a 503, not a refusal), it counts nothing."""
    storage = _storage(kind, request, clock)
    meta = Check("t:{c2}:m:3/3600:fixed_window", "fixed_window", 3, HOUR, meta=True)
    full = Check("t:{c2}:r:1/60:fixed_window", "fixed_window", 1, 60)
    now = clock.now_us
    try:
        storage.evaluate([full, meta], now_us=now)
        storage.evaluate([full, meta], now_us=now)  # one breach
        refunded = storage.refund([full, replace(meta, cost=0)], now_us=now)
        assert refunded.allowed and refunded.decisions[1].remaining == 2
        assert storage.evaluate([full, meta], now_us=now).allowed  # the unit came back
        refunded = storage.refund([full, meta], now_us=now)  # refused elsewhere: breach 2
        assert refunded.allowed and refunded.decisions[1].remaining == 2  # as it stood
        assert storage.evaluate([full, meta], now_us=now).allowed  # the unit, once more
        assert not storage.evaluate([full, meta], now_us=now).allowed  # breach 3
        refused = storage.evaluate([full, meta], now_us=now)
        assert not refused.decisions[1].allowed and refused.decisions[1].remaining == 0
        assert storage.refund([full, meta], now_us=now).allowed  # exhausted: never denies
    finally:
        if kind != "memory":
            storage.delete([meta.key, full.key])
            storage.close()


# -- refusals decided in another slot group (Redis Cluster) -------------------------------------


def _elsewhere_app(backend: Backend, clock: FakeClock) -> tuple[Flask, Limiter]:
    """An app whose /login limit is counted per account (a ``key_func``: on a Cluster, a slot
    group apart from the client's address, where the meta check sits)."""
    app, limiter = meta_app(backend, clock, DISTLIMIT_GLOBAL_LIMITS="100/minute")

    @app.get("/login")
    @limiter.limit("1/minute", key_func=lambda: "alice")
    def login() -> str:
        return "ok"

    @app.get("/both")  # refused at once in the address's group and in the account's
    @limiter.limit("1/minute")
    @limiter.limit("1/hour", key_func=lambda: "alice")
    def both() -> str:
        return "ok"

    @app.get("/twice")  # refused at once in two account groups, none of them the address's
    @limiter.limit("1/minute", key_func=lambda: "alice")
    @limiter.limit("1/hour", key_func=lambda: "bob")
    def twice() -> str:
        return "ok"

    return app, limiter


@pytest.mark.parametrize("route", ["/login", "/both", "/twice"])
def test_a_refusal_in_another_slot_group_is_one_breach(
    backend: Backend, clock: FakeClock, route: str
) -> None:
    app, _ = _elsewhere_app(backend, clock)
    client = app.test_client()
    assert client.get(route).status_code == 200
    assert client.get(route).status_code == 429  # breach 1, however many groups refused it
    assert client.get("/roomy").status_code == 200  # one breach is not enough
    assert client.get(route).status_code == 429  # breach 2: the meta limit is exhausted
    refused = client.get("/roomy")
    assert refused.status_code == 429
    assert refused.get_json()["violated-policies"] == ["meta:2/hour"]


def test_a_refusal_in_another_group_is_no_breach_when_the_meta_limit_refused(
    backend: Backend, clock: FakeClock
) -> None:
    app, _ = _elsewhere_app(backend, clock)
    client = app.test_client()
    client.get("/login")
    client.get("/login")
    client.get("/login")  # two breaches: exhausted
    for _ in range(3):
        refused = client.get("/login")  # refused by the meta limit, and by the account's
        assert refused.get_json()["violated-policies"] == ["meta:2/hour"]
    clock.advance(HOUR - (clock.now_us // 1_000_000) % HOUR)
    # those refusals were not breaches: the new hour holds none, so two more are needed
    assert client.get("/login").status_code == 200
    assert client.get("/login").status_code == 429
    assert client.get("/roomy").status_code == 200
