"""Race freedom on a real Redis: 4 processes x 8 threads hammer the same key(s) at once and the
exact algorithms admit exactly ``limit``, with the server's own clock (no injected time).

The period is a leap year long, so no refill (token bucket, GCRA) or new window happens while the
test runs.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from flask_distlimit.core.algorithms import Algorithm
from flask_distlimit.core.decision import Check
from flask_distlimit.storage.redis import RedisStorage
from tests.distlimit_fixtures import EXACT_ALGORITHMS
from tests.servers import RedisProcess

PROCESSES = 4
THREADS = 8
PERIOD = 366 * 86_400

_barrier: Any = None


def _init(barrier: Any) -> None:
    global _barrier
    _barrier = barrier


def _hammer(port: int, checks: list[Check], per_thread: int) -> int:
    """In one worker process: 8 threads, each ``per_thread`` requests; answers how many passed."""
    storage = RedisStorage(redis.Redis(host="127.0.0.1", port=port, max_connections=THREADS))
    admitted = [0] * THREADS
    start = threading.Barrier(THREADS)

    def run(n: int) -> None:
        start.wait()
        for _ in range(per_thread):
            if storage.evaluate(checks).allowed:
                admitted[n] += 1

    threads = [threading.Thread(target=run, args=(n,)) for n in range(THREADS)]
    _barrier.wait()  # every process ready before any thread starts
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    storage.client.close()
    return sum(admitted)


@pytest.fixture(scope="module")
def pool() -> Iterator[Any]:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(PROCESSES, initializer=_init, initargs=(ctx.Barrier(PROCESSES),)) as workers:
        yield workers
        workers.close()
        workers.join()


def _race(pool: Any, port: int, checks: list[Check], per_thread: int) -> int:
    jobs = [(port, checks, per_thread)] * PROCESSES
    return sum(pool.starmap(_hammer, jobs, chunksize=1))


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.parametrize("algorithm", sorted(EXACT_ALGORITHMS))
def test_exactly_the_limit_is_admitted(
    pool: Any, redis_server: RedisProcess, redis_client: redis.Redis, algorithm: Algorithm
) -> None:
    check = Check(f"race:{{one}}:1:{algorithm}", algorithm, 100, PERIOD)
    admitted = _race(pool, redis_server.port, [check], per_thread=10)  # 320 requests
    assert admitted == 100
    assert RedisStorage(redis_client).evaluate([check]).decisions[0].remaining == 0


@pytest.mark.slow
@pytest.mark.redis
def test_three_limits_all_or_nothing_under_contention(
    pool: Any, redis_server: RedisProcess, redis_client: redis.Redis
) -> None:
    checks = [
        Check("race:{many}:1:fixed_window", "fixed_window", 50, PERIOD),
        Check("race:{many}:2:gcra", "gcra", 100, PERIOD),
        Check("race:{many}:3:sliding_window_log", "sliding_window_log", 80, PERIOD),
    ]
    admitted = _race(pool, redis_server.port, checks, per_thread=6)  # 192 requests
    assert admitted == 50
    # the limits that did not deny were charged for the 50 admitted requests only
    peek = [Check(c.key, c.algorithm, c.limit, c.period, cost=0) for c in checks]
    remaining = [d.remaining for d in RedisStorage(redis_client).evaluate(peek).decisions]
    assert remaining == [0, 50, 30]
