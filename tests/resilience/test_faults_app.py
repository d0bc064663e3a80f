"""Redis killed (kill -9) under a Flask app with the Limiter, under concurrent load, per policy:
statuses and headers while it is down, per-route overrides, and exact limits once it is back.

(The Guard-level faults, SIGSTOP, SCRIPT FLUSH and the failovers: tests/resilience/test_faults*.py.)
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from flask import Flask
from werkzeug.test import TestResponse

from flask_distlimit import Limiter
from tests.faults import Load, percentile, wait_until
from tests.servers import RedisProcess, start_redis

pytestmark = pytest.mark.redis

TIMEOUT = 0.1
RESET = 1.0
P99_BOUND = TIMEOUT + 0.05
TEMPORARY = "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"


_apps: list[Flask] = []


@pytest.fixture
def server() -> Iterator[RedisProcess]:
    process = start_redis()
    yield process
    while _apps:
        Limiter.state(_apps.pop()).storage.close()
    process.stop()


def make_app(server: RedisProcess, policy: str, **config: Any) -> tuple[Flask, Limiter]:
    app = Flask(f"faults-{policy}")
    app.config.update(
        DISTLIMIT_STORAGE_URL=server.url,
        DISTLIMIT_REDIS_TIMEOUT=TIMEOUT,
        DISTLIMIT_FAILURE_POLICY=policy,
        DISTLIMIT_BREAKER_RESET_TIMEOUT=RESET,
        DISTLIMIT_TIERS={"anonymous": ""},
        DISTLIMIT_HEADERS="legacy",
        **config,
    )
    limiter = Limiter(app)
    _apps.append(app)

    @app.get("/busy")
    @limiter.limit("1000000/hour", key_func=lambda: "load")
    def busy() -> str:
        return "ok"

    @app.get("/exact/<name>")
    @limiter.limit("10/hour", algorithm="gcra", key_func=lambda: "exact")
    def exact(name: str) -> str:
        return name

    @app.get("/login")
    @limiter.limit("1000000/hour", key_func=lambda: "login", on_failure="closed")
    def login() -> str:
        return "login"

    return app, limiter


def get(app: Flask, path: str) -> TestResponse:
    with app.test_client() as client:
        return client.get(path)


def statuses(app: Flask, path: str, n: int) -> list[int]:
    return [get(app, path).status_code for _ in range(n)]


def kill_during_load(server: RedisProcess, app: Flask) -> tuple[Load, float, float, float]:
    """Load /busy; kill -9 the server; restart it after 1 s; answer the load, the kill and
    restart times, and the seconds until requests are no longer degraded."""

    def request(_: int) -> str:
        response = get(app, "/busy")
        degraded = response.headers.get("X-RateLimit-Degraded") == "true"
        return f"{response.status_code}{' degraded' if degraded else ''}"

    with Load(request, threads=4) as load:
        time.sleep(0.3)
        killed_at = time.monotonic()
        server.stop()
        time.sleep(1.0)
        restart_at = time.monotonic()
        server.start()
        recovered = wait_until(
            lambda: "X-RateLimit-Degraded" not in get(app, "/busy").headers, RESET + 5
        )
    return load, killed_at, restart_at, recovered


@pytest.mark.slow
def test_policy_open_serves_everything_marked_degraded(server: RedisProcess) -> None:
    app, _ = make_app(server, "open")
    load, killed_at, restart_at, recovered = kill_during_load(server, app)
    assert not load.errors
    assert not [s for s in load.samples if s.kind.startswith("5")]  # zero 5xx
    during = load.between(killed_at + 0.05, restart_at)
    assert during and {s.kind for s in during} == {"200 degraded"}
    latencies = [s.latency for s in load.between(killed_at, restart_at)]
    print(
        f"\n[app, kill -9, open] {len(latencies)} requests: p50 "
        f"{percentile(latencies, 50) * 1000:.2f} ms, p99 {percentile(latencies, 99) * 1000:.2f} ms"
        f", recovered {recovered * 1000:.0f} ms after the restart"
    )
    assert percentile(latencies, 99) <= P99_BOUND
    assert recovered <= RESET + 1
    assert statuses(app, "/exact/a", 12) == [200] * 10 + [429] * 2


@pytest.mark.slow
def test_policy_closed_answers_503_problem_with_retry_after(server: RedisProcess) -> None:
    app, _ = make_app(server, "closed")
    assert get(app, "/busy").status_code == 200
    server.stop()
    responses = [get(app, "/busy") for _ in range(8)]  # the breaker opens on the 5th
    for response in responses:
        assert response.status_code == 503
        assert response.mimetype == "application/problem+json"
        body = response.get_json()
        assert body["type"] == TEMPORARY and body["status"] == 503
        assert int(response.headers["Retry-After"]) >= 1
        assert response.headers["X-RateLimit-Degraded"] == "true"
    server.start()
    wait_until(lambda: get(app, "/busy").status_code == 200, RESET + 1)
    assert "X-RateLimit-Degraded" not in get(app, "/busy").headers
    assert statuses(app, "/exact/a", 12) == [200] * 10 + [429] * 2


def test_policy_open_with_a_closed_route(server: RedisProcess) -> None:
    app, _ = make_app(server, "open")
    server.stop()
    assert get(app, "/busy").status_code == 200
    login = get(app, "/login")
    assert login.status_code == 503
    assert login.get_json()["type"] == TEMPORARY


def test_policy_local_enforces_the_divided_limit_with_reduced_headers(
    server: RedisProcess,
) -> None:
    app, limiter = make_app(server, "local", DISTLIMIT_INSTANCES=4)
    before = get(app, "/exact/a")
    assert before.headers["X-RateLimit-Limit"] == "10"
    assert before.headers["X-RateLimit-Remaining"] == "9"
    server.stop()
    during = [get(app, "/exact/b") for _ in range(4)]
    assert [r.status_code for r in during] == [200, 200, 429, 429]  # floor(10 / 4) = 2
    assert all(r.headers["X-RateLimit-Degraded"] == "true" for r in during)
    assert [r.headers["X-RateLimit-Limit"] for r in during] == ["2"] * 4
    assert [r.headers["X-RateLimit-Remaining"] for r in during] == ["1", "0", "0", "0"]
    assert limiter.health(app)["breaker"] in ("closed", "open")
    server.start()  # empty: the quota starts over; the local counts are not written back
    wait_until(lambda: "X-RateLimit-Degraded" not in get(app, "/busy").headers, RESET + 1)
    # /exact was decided here during the outage: its local count holds until its hour is over
    # (Redis never learnt of those 2), so this process still has none of its share left.
    health = limiter.health(app)
    assert health["fallback_active"] is True and health["fallback_held_keys"] >= 1
    after = get(app, "/exact/c")
    assert after.status_code == 429
    assert after.headers["X-RateLimit-Degraded"] == "true"
    assert after.headers["X-RateLimit-Limit"] == "2"
    # /busy is counted here too (wait_until's requests were decided locally), but far below
    # its share: Redis answers it, not degraded.
    assert statuses(app, "/busy", 3) == [200] * 3
    assert "X-RateLimit-Degraded" not in get(app, "/busy").headers


@pytest.mark.slow
def test_stalled_redis_policy_closed_answers_503_within_the_timeout(server: RedisProcess) -> None:
    app, _ = make_app(server, "closed")

    def request(_: int) -> str:
        response = get(app, "/busy")
        if response.status_code == 503:
            assert response.get_json()["type"] == TEMPORARY
            assert response.headers["Retry-After"]
        return str(response.status_code)

    with Load(request, threads=4) as load:
        time.sleep(0.3)
        stalled_at = time.monotonic()
        server.signal(signal.SIGSTOP)
        try:
            time.sleep(1.5)
        finally:
            server.signal(signal.SIGCONT)
        back_at = time.monotonic()
        recovered = wait_until(lambda: get(app, "/busy").status_code == 200, RESET + 5)
    assert not load.errors
    during = load.between(stalled_at + TIMEOUT + 0.05, back_at - TIMEOUT)
    assert during and {s.kind for s in during} == {"503"}
    latencies = [s.latency for s in load.between(stalled_at, back_at)]
    print(
        f"\n[app, SIGSTOP, closed] {len(latencies)} requests: p50 "
        f"{percentile(latencies, 50) * 1000:.2f} ms, p99 {percentile(latencies, 99) * 1000:.2f} ms"
        f", max {max(latencies) * 1000:.1f} ms, recovered {recovered * 1000:.0f} ms after SIGCONT"
    )
    assert percentile(latencies, 99) <= P99_BOUND
    assert max(latencies) < 2 * TIMEOUT + 0.05
    assert recovered <= RESET + 1
    assert statuses(app, "/exact/a", 12) == [200] * 10 + [429] * 2
