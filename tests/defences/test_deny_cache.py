"""The local deny cache: a flood costs the storage nothing, and it never refuses what the
storage would admit."""

from __future__ import annotations

import json
import math
import random
import socket
import threading
import time
from collections.abc import Callable

import pytest
import redis
from flask import Response, request

from flask_distlimit import ALGORITHMS, ConfigurationError, Limiter
from flask_distlimit.core.decision import Check, Decision
from flask_distlimit.defences.deny_cache import DenyCache
from flask_distlimit.storage.base import Storage
from flask_distlimit.storage.redis import RedisStorage
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import backend, clock, make_app

__all__ = ["backend", "clock"]

Backend = Callable[[], Storage]


class _Clock:
    def __init__(self) -> None:
        self.now = 1_000_000

    def __call__(self) -> int:
        return self.now


def _record(cache: DenyCache, key: str = "k", cost: int = 1, retry: float = 2.0, **kw: int) -> None:
    cache.record(
        Check(key, "fixed_window", 5, 60, cost),
        Decision(False, 5, 0, 0.0, retry),
        started_us=kw.get("started", 1_000_000),
        finished_us=kw.get("finished", 1_000_000),
    )


def test_answers_only_same_key_at_least_the_cost_before_the_deadline() -> None:
    clock = _Clock()
    cache = DenyCache(clock=clock)
    assert cache.lookup("k", 1) is None
    _record(cache, cost=2, retry=2.0)
    assert cache.lookup("other", 5) is None
    assert cache.lookup("k", 1) is None  # a cheaper request may pass
    denial = cache.lookup("k", 2)
    assert denial is not None and denial.retry_after(clock.now) == 2.0
    assert cache.lookup("k", 9) is not None
    clock.now += 1_999_000 - 1
    assert cache.lookup("k", 2) is not None
    clock.now += 1
    assert cache.lookup("k", 2) is None  # 1 ms margin before the storage's retry time
    assert len(cache) == 0  # expired entries are dropped


def test_deadline_counts_from_before_the_call_and_retry_after_from_after() -> None:
    clock = _Clock()
    cache = DenyCache(clock=clock)
    _record(cache, retry=1.0010009, started=1_000_000, finished=1_000_500)
    assert cache.lookup("k", 1, now_us=2_000_000 - 1) is not None
    assert cache.lookup("k", 1, now_us=2_000_000) is None  # floor: never past the real time
    _record(cache, retry=1.0, started=1_000_000, finished=1_000_500)
    denial = cache.lookup("k", 1, now_us=1_000_000)
    assert denial is not None
    assert denial.retry_after(1_000_000) == pytest.approx(1.0005)  # upper bound


def test_impossible_requests_and_long_denials_are_bounded_by_max_ttl() -> None:
    clock = _Clock()
    cache = DenyCache(clock=clock, max_ttl=10)
    _record(cache, key="never", retry=math.inf)
    _record(cache, key="long", retry=3600)
    clock.now += 9_999_999
    assert cache.lookup("never", 1) is not None and cache.lookup("long", 1) is not None
    assert cache.lookup("never", 1, now_us=clock.now + 1) is None
    assert cache.lookup("long", 1, now_us=clock.now + 1) is None


def test_nothing_recorded_for_free_or_zero_waits() -> None:
    cache = DenyCache(clock=_Clock())
    _record(cache, cost=0)
    _record(cache, retry=0)
    assert len(cache) == 0


def test_bounded_lru_clear_and_forget() -> None:
    clock = _Clock()
    cache = DenyCache(clock=clock, max_entries=3)
    for key in "abc":
        _record(cache, key=key)
    assert cache.lookup("a", 1) is not None  # "a" is now the most recent
    _record(cache, key="d")
    assert len(cache) == 3
    assert cache.lookup("b", 1) is None  # least recently used went first
    assert cache.lookup("a", 1) is not None
    cache.forget("a")
    assert cache.lookup("a", 1) is None
    cache.clear()
    assert len(cache) == 0
    for wrong in ({"deny_cache_size": 0}, {"deny_cache_size": "10"}, {"deny_cache": "no"}):
        with pytest.raises(ConfigurationError, match=r"deny_cache=.* at least 1"):
            Limiter(**wrong)  # type: ignore[arg-type]


def test_thread_safe_under_concurrent_use() -> None:
    clock = _Clock()
    cache = DenyCache(clock=clock, max_entries=50)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(2000):
                key = f"k{rng.randrange(200)}"
                if rng.random() < 0.5:
                    _record(cache, key=key, cost=rng.randrange(1, 4))
                else:
                    cache.lookup(key, rng.randrange(1, 4))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(cache) <= 50


def test_a_flood_costs_the_storage_no_round_trip(backend: Backend, clock: FakeClock) -> None:
    app, limiter, counting = make_app(
        backend(), clock, DISTLIMIT_ALGORITHM="fixed_window", DISTLIMIT_GLOBAL_LIMITS="1000/minute"
    )

    @app.get("/")
    @limiter.limit("2/minute")
    def index() -> str:
        return "ok"

    client = app.test_client()
    assert [client.get("/").status_code for _ in range(3)] == [200, 200, 429]
    calls = counting.evaluations
    assert calls == 3
    for second in range(50):
        response = client.get("/")
        assert response.status_code == 429
        assert response.headers["Retry-After"] == str(60 - second)  # rounded up, counting down
        assert response.headers["RateLimit"] == f'"index:2/minute";r=0;t={60 - second}'
        assert json.loads(response.get_data())["violated-policies"] == ["index:2/minute"]
        clock.advance(1)
    assert counting.evaluations == calls  # 50 refusals, 0 round trips
    clock.advance(10)
    assert client.get("/").status_code == 200
    assert counting.evaluations == calls + 1


@pytest.mark.parametrize("cooperative", [False, True], ids=["threads", "gevent"])
def test_a_cached_refusal_yields_to_the_event_loop_under_gevent(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch, cooperative: bool
) -> None:
    """Under gevent (``socket.socket`` patched), a refusal of the deny cache waits one turn of
    the event loop (``time.sleep(0)``, gevent's when patched): 320 connections of 429s answered
    without a wait held the admitted requests of one worker past a 3 s run (1 run in 6; none of
    12 with the yield, docs/deployment.md). Under threads, nothing."""
    from flask_distlimit.storage.memory import MemoryStorage

    app, limiter, _ = make_app(MemoryStorage(clock=clock), clock)

    @app.get("/")
    @limiter.limit("1/minute")
    def index() -> str:
        return "ok"

    client = app.test_client()
    assert [client.get("/").status_code for _ in range(2)] == [200, 429]  # the second: stored
    slept: list[float] = []
    if cooperative:
        monkeypatch.setattr(socket.socket, "__module__", "gevent._socket3")
    monkeypatch.setattr(time, "sleep", slept.append)
    assert [client.get("/").status_code for _ in range(3)] == [429] * 3  # from the cache
    assert slept == ([0] * 3 if cooperative else [])


def test_a_flood_sends_no_command_to_redis(redis_client: redis.Redis, clock: FakeClock) -> None:
    storage = RedisStorage(redis_client)
    app, limiter, _ = make_app(storage, clock, DISTLIMIT_ALGORITHM="gcra")

    @app.get("/")
    @limiter.limit("1/minute")
    def index() -> str:
        return "ok"

    client = app.test_client()
    assert [client.get("/").status_code for _ in range(2)] == [200, 429]
    before = redis_client.info("commandstats")
    assert all(client.get("/").status_code == 429 for _ in range(200))
    after = redis_client.info("commandstats")
    # Only the INFO call of this test itself was added.
    changed = {k for k in after if after[k]["calls"] != before.get(k, {}).get("calls")}
    assert changed <= {"cmdstat_info"}, changed


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_never_refuses_what_the_storage_would_admit(
    backend: Backend, clock: FakeClock, algorithm: str
) -> None:
    """A cached app and an uncached one see the same random traffic: same answers, always."""
    store = backend()
    clients = []
    counters = []
    for cached in (True, False):
        limiter = Limiter(clock=clock, deny_cache=cached)
        app, _, counting = make_app(
            store,
            clock,
            limiter=limiter,
            name=f"cached{cached}",
            DISTLIMIT_KEY_PREFIX=f"c{int(cached)}",
            DISTLIMIT_ALGORITHM=algorithm,
        )

        @app.get("/")
        @limiter.limit("5/10 seconds", cost=lambda: int(request.args["cost"]))
        def index() -> str:
            return "ok"

        clients.append(app.test_client())
        counters.append(counting)
    rng = random.Random(f"deny-cache-{algorithm}")
    outcomes: list[int] = []
    for _ in range(400):
        clock.advance(rng.choice((0, 0, 0, 0.05, 0.3, 1, 2.5)))
        cost = rng.choice((1, 1, 1, 2, 3, 6))
        statuses = [c.get(f"/?cost={cost}").status_code for c in clients]
        assert statuses[0] == statuses[1], (algorithm, cost, len(outcomes))
        outcomes.append(statuses[0])
    assert outcomes.count(200) > 20 and outcomes.count(429) > 20
    assert counters[0].evaluations < counters[1].evaluations  # the cache did answer some


def test_cached_refusals_are_counted_in_the_metrics(clock: FakeClock) -> None:
    from prometheus_client import CollectorRegistry

    from flask_distlimit.storage.memory import MemoryStorage
    from flask_distlimit.telemetry.metrics import metrics_for

    app, limiter, counting = make_app(MemoryStorage(clock=clock), clock)
    registry = CollectorRegistry()
    Limiter.state(app).guard.use_metrics(metrics_for(registry))
    app.add_url_rule("/", "index", limiter.limit("1/minute")(lambda: "ok"))
    client = app.test_client()
    assert [client.get("/").status_code for _ in range(5)] == [200] + [429] * 4
    assert counting.evaluations == 2
    labels = {"limit": "r_index_1/60:sliding_window_counter"}
    denied = registry.get_sample_value("distlimit_decisions_total", {**labels, "outcome": "denied"})
    assert denied == 4


def test_a_refusal_by_units_reserved_in_flight_is_not_kept(
    backend: Callable[[], Storage], clock: FakeClock
) -> None:
    """Reserved units come back when their requests end: the storage would admit again then,
    so the cache must not keep refusing (as it keeps no concurrency slot's refusal)."""
    app, limiter, counting = make_app(backend(), clock)

    @app.get("/batch")
    @limiter.limit("10/minute", cost=5, settle=lambda response: 1)
    def batch() -> Response:
        return Response(iter([b"x"]), mimetype="text/plain")  # streamed: settled when it ends

    client = app.test_client()
    in_flight = [client.get("/batch", buffered=False) for _ in range(2)]
    assert client.get("/batch").status_code == 429  # 10 units reserved by the two in flight
    for response in in_flight:
        response.get_data()
        response.close()  # each settled to 1
    calls = counting.evaluations
    assert client.get("/batch").status_code == 200  # 2 used: the storage admits it
    assert counting.evaluations > calls  # it was asked, not the cache
