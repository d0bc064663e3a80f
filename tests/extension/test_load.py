"""Load never switches the limiter off (issue 23): this process's own queueing is not an outage.

A wait for a pooled connection, and a thread (or greenlet) held up before its send or its read,
are this process's load: never a failure toward the breaker, never the failure policy (which
under ``open`` admits everything). A call that queues past its budget is refused with a 503
and ``Retry-After: 1`` and charged to no limit. These tests run on a real redis-server; the
ones that serve through gunicorn are in :mod:`tests.extension.test_load_gunicorn`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import pytest
import redis
from flask import Flask

from flask_distlimit import Limiter
from flask_distlimit.core.decision import Check
from flask_distlimit.errors import StorageBusy, StorageUnavailable
from flask_distlimit.resilience.guard import Guard
from flask_distlimit.storage.redis import RedisStorage
from tests.servers import RedisProcess

pytestmark = pytest.mark.redis

CHECK = Check("load:{alice}:route:fixed_window", "fixed_window", 3, 365 * 86400)


def _storage(server: RedisProcess, **options: Any) -> RedisStorage:
    return RedisStorage(host="127.0.0.1", port=server.port, **options)


def test_a_busy_pool_never_opens_the_breaker_nor_admits_unlimited(
    redis_server: RedisProcess, redis_client: redis.Redis
) -> None:
    storage = _storage(redis_server, timeout=0.1, max_connections=1, queue_timeout=0.02)
    guard = Guard(storage, policy="open")
    evaluation = guard.evaluate([CHECK]).evaluation
    assert evaluation is not None and evaluation.allowed
    assert storage.pool is not None
    held = storage.pool.get_connection()  # every connection busy: the others queue
    try:
        outcomes = [guard.evaluate([CHECK]) for _ in range(3 * guard.fail_max)]
    finally:
        storage.pool.release(held)
    # refused (a 503 to retry soon), never admitted by the policy, never an outage
    assert all(o.busy and o.unavailable and o.evaluation is None for o in outcomes)
    assert (guard.breaker.state, guard.breaker.failures) == ("closed", 0)
    # and charged to no limit: the two units left are still there
    allowed = [guard.evaluate([CHECK]).evaluation for _ in range(3)]
    assert [e is not None and e.allowed for e in allowed] == [True, True, False]
    storage.close()


def test_a_busy_request_is_answered_503_retry_after_1_under_every_policy(
    redis_server: RedisProcess, redis_client: redis.Redis
) -> None:
    for policy in ("open", "local", "closed"):
        storage = _storage(redis_server, timeout=0.1, max_connections=1, queue_timeout=0.02)
        app = Flask(f"busy-{policy}")
        app.config.update(DISTLIMIT_FAILURE_POLICY=policy, DISTLIMIT_KEY_PREFIX=f"busy-{policy}")
        limiter = Limiter()
        limiter.init_app(app, storage=storage)

        @app.get("/")
        @limiter.limit("5/hour")
        def index() -> str:
            return "ok"

        client = app.test_client()
        assert client.get("/").status_code == 200
        assert storage.pool is not None
        held = storage.pool.get_connection()
        try:
            busy = [client.get("/") for _ in range(8)]
        finally:
            storage.pool.release(held)
        assert {(r.status_code, r.headers.get("Retry-After")) for r in busy} == {(503, "1")}
        assert "overloaded" in busy[0].get_json()["detail"]
        assert limiter.state(app).guard.breaker.failures == 0
        statuses = [client.get("/").status_code for _ in range(5)]
        assert statuses == [200, 200, 200, 200, 429]  # the 503s were charged nothing
        storage.close()


def test_storage_busy_is_not_an_outage() -> None:
    assert not issubclass(StorageBusy, StorageUnavailable)


def burst(app: Flask, path: str, threads: int) -> Counter[tuple[int, bool]]:
    """``threads`` threads each send one request to ``path`` at once: the count of each
    (status, marked ``X-RateLimit-Degraded``)."""
    start = threading.Barrier(threads)
    answers: Counter[tuple[int, bool]] = Counter()
    lock = threading.Lock()

    def one() -> None:
        client = app.test_client()
        start.wait()
        response = client.get(path)
        with lock:
            answers[response.status_code, "X-RateLimit-Degraded" in response.headers] += 1

    workers = [threading.Thread(target=one) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return answers


def _spin(stop: threading.Event) -> None:
    """Hold the GIL as Python code does, until ``stop``."""
    n = 0
    while not stop.is_set():
        n += 1


@pytest.mark.slow
def test_a_cold_start_under_cpu_load_is_exact_with_the_default_configuration(
    redis_server: RedisProcess, redis_client: redis.Redis
) -> None:
    """100 threads send the first requests of a fresh app at once (an empty pool, the script
    not loaded) while threads of the same process keep the GIL busy: on the old code the
    waits for the GIL, the pool and the first connections were spent inside the 100 ms
    timeout, the breaker opened on a healthy Redis and policy ``open`` admitted many times
    the limit."""
    stop = threading.Event()
    spinners = [threading.Thread(target=_spin, args=(stop,)) for _ in range(3)]
    for spinner in spinners:
        spinner.start()
    try:
        for round_ in range(2):
            app = Flask(f"cold-{round_}")
            app.config.update(
                DISTLIMIT_STORAGE_URL=redis_server.url, DISTLIMIT_KEY_PREFIX=f"cold-{round_}"
            )
            limiter = Limiter(app)

            @app.get("/")
            @limiter.limit("5/hour")
            def index() -> str:
                return "ok"

            redis_client.script_flush()  # a fresh server too: NOSCRIPT on the first calls
            threads = 100
            answers = burst(app, "/", threads)
            guard = limiter.state(app).guard
            assert answers == Counter({(200, False): 5, (429, False): threads - 5})
            assert (guard.breaker.state, guard.breaker.failures) == ("closed", 0)
            limiter.state(app).storage.close()
    finally:
        stop.set()
        for spinner in spinners:
            spinner.join()


def test_a_late_thread_s_reply_is_read_through_the_storage(
    redis_server: RedisProcess, redis_client: redis.Redis
) -> None:
    """The thread is held up just after its send (the GIL, the event loop) past the timeout:
    Redis answered in time, so the call is answered (old code: a timeout, an outage)."""

    class Late(redis.Connection):
        def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            super().send_packed_command(command, check_health)
            time.sleep(0.15)

    storage = _storage(redis_server, timeout=0.05, connection_class=Late)
    assert storage.evaluate([CHECK]).allowed
    storage.close()
