"""Black box: 2 gunicorn instances x 3 gthread workers x 4 threads on one real Redis.

Concurrent requests from many client threads, spread over both instances: for every exact
algorithm exactly N pass (the limits are per day, so nothing refills during the test), every
other request is a 429, and there is no 5xx. Rotating a forged ``X-Forwarded-For`` buys nothing.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from tests.conftest import assert_every_key_has_ttl
from tests.gunicorn_servers import Gunicorn, launch, request, until, wait_ready
from tests.servers import RedisProcess

pytestmark = [pytest.mark.gunicorn, pytest.mark.redis]

LIMIT = 20  # N of every limited route
REQUESTS = 3 * LIMIT  # per route: N pass, 2N are refused
CLIENT_THREADS = 16
#: The exact algorithms, as routed by ``tests/apps/gunicorn_app.py``.
ALGORITHMS = ("fixed_window", "sliding_window_log", "token_bucket", "gcra")


def start_gunicorn(storage_url: str, prefix: str, logdir: Path) -> Gunicorn:
    return launch(
        "tests.apps.gunicorn_app:app",
        {
            "DISTLIMIT_STORAGE_URL": storage_url,
            "GUNICORN_TEST_LIMIT": str(LIMIT),
            "GUNICORN_TEST_PREFIX": prefix,
        },
        logdir,
    )


@pytest.fixture(scope="module")
def servers(redis_server: RedisProcess) -> Iterator[tuple[redis.Redis, list[Gunicorn]]]:
    client = redis_server.client()
    prefix = f"gunicorn-{os.getpid()}"
    client.flushall()
    with tempfile.TemporaryDirectory(prefix="distlimit-gunicorn-") as logdir:
        started: list[Gunicorn] = []
        try:
            for _ in range(2):
                started.append(start_gunicorn(redis_server.url, prefix, Path(logdir)))
            for server in started:
                wait_ready(server)
            yield client, started
        finally:
            for server in started:
                server.stop()
            client.close()


def fire(
    servers: list[Gunicorn], path: str, headers: list[dict[str, str]], pids: set[str] | None = None
) -> Counter[int]:
    """``len(headers)`` concurrent requests to ``path``, alternating between the instances.

    Answers the count of each status; ``pids`` collects the worker PIDs that answered 200.
    """
    jobs = [(servers[i % len(servers)].port, h) for i, h in enumerate(headers)]
    with ThreadPoolExecutor(max_workers=CLIENT_THREADS) as pool:
        results = list(pool.map(lambda job: request(job[0], path, job[1]), jobs))
    if pids is not None:
        pids.update(body.split()[-1] for status, body in results if status == 200)
    return Counter(status for status, _ in results)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_exactly_n_pass_across_instances_workers_and_threads(
    servers: tuple[redis.Redis, list[Gunicorn]], algorithm: str
) -> None:
    client, instances = servers
    pids: set[str] = set()
    statuses = fire(instances, f"/{algorithm}", [{}] * REQUESTS, pids)
    assert statuses == Counter({200: LIMIT, 429: REQUESTS - LIMIT})
    assert len(pids) >= 2  # the quota was shared by several processes
    # More requests later still find the quota spent: nothing refilled, nothing leaked.
    assert fire(instances, f"/{algorithm}", [{}] * 6) == Counter({429: 6})
    assert_every_key_has_ttl(client)  # but the digest key of an app without SECRET_KEY


def test_forged_x_forwarded_for_rotation_buys_no_quota(
    servers: tuple[redis.Redis, list[Gunicorn]],
) -> None:
    _, instances = servers
    forged = [
        {"X-Forwarded-For": f"203.0.{i // 250}.{i % 250 + 1}, 2001:db8:{i:x}::1"}
        for i in range(REQUESTS)
    ]
    statuses = fire(instances, "/by-ip", forged)
    assert statuses == Counter({200: LIMIT, 429: REQUESTS - LIMIT})


@pytest.mark.slow
def test_class_based_views_and_a_late_hook_keep_their_limits_across_workers(
    servers: tuple[redis.Redis, list[Gunicorn]],
) -> None:
    """MethodView decorators= limit its own class only; a key_func reads what a hook registered
    after Limiter(app) set: exactly N per tenant, on every worker."""
    _, instances = servers
    assert fire(instances, "/login", [{}] * REQUESTS) == Counter(
        {200: LIMIT, 429: REQUESTS - LIMIT}
    )
    assert fire(instances, "/catalogue", [{}] * REQUESTS) == Counter({200: REQUESTS})
    tenants = [{"X-Tenant": "acme" if i % 2 else "globex"} for i in range(2 * REQUESTS)]
    pids: set[str] = set()
    assert fire(instances, "/tenant", tenants, pids) == Counter(
        {200: 2 * LIMIT, 429: 2 * (REQUESTS - LIMIT)}
    )
    assert len(pids) >= 2
    for name in ("acme", "globex"):
        assert fire(instances, "/tenant", [{"X-Tenant": name}] * 3) == Counter({429: 3})


def test_a_random_secret_in_each_worker_is_named_when_the_workers_start(
    redis_server: RedisProcess, tmp_path: Path
) -> None:
    """``SECRET_KEY = os.urandom(...)`` at import gives each gunicorn worker its own secret, so
    each keyed every client apart and admitted each limit once per worker, without a word."""
    env = {
        "DISTLIMIT_STORAGE_URL": redis_server.url,
        "GUNICORN_TEST_PREFIX": f"secrets-{os.getpid()}",
        "GUNICORN_TEST_SECRET": "per-process",
    }
    server = launch("tests.apps.gunicorn_app:app", env, tmp_path)
    try:
        wait_ready(server)
        until(lambda: "secrets key identities" in server.log.read_text(), "the ERROR line")
        assert "never a random one per process" in server.log.read_text()
    finally:
        server.stop()
