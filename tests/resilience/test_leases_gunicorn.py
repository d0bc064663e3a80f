"""Black box: a leased ``300/minute`` shared by 2 gunicorn instances x 3 gthread workers x 4
threads on one real Redis, flooded. The fleet admits at most 300 in the window, and at least
300 minus the stated bound (processes x the largest lease ``lease=True`` takes, 300 // 20).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from flask_distlimit.declare.lease_options import auto_cap
from tests.gunicorn_servers import ROOT, Gunicorn, launch, wait_ready
from tests.servers import RedisProcess

pytestmark = [pytest.mark.gunicorn, pytest.mark.redis]

LIMIT = 300
PROCESSES = 2 * 3  # instances x workers
FLOOD = 3 * LIMIT
CLIENT_THREADS = 24


def _env(redis_server: RedisProcess) -> dict[str, str]:
    return {
        "DISTLIMIT_STORAGE_URL": redis_server.url,
        "LEASING_LIMIT": f"{LIMIT}/minute",
        "LEASING_PREFIX": f"lease-{os.getpid()}",
        "LEASING_LEASE": "true",
    }


@pytest.fixture
def instances(redis_server: RedisProcess) -> Iterator[list[Gunicorn]]:
    env = _env(redis_server)
    with tempfile.TemporaryDirectory(prefix="distlimit-lease-") as logdir:
        started = [launch("tests.apps.leasing_app:app", env, Path(logdir)) for _ in range(2)]
        try:
            for server in started:
                wait_ready(server)
            yield started
        finally:
            for server in started:
                server.stop()


def _get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def _workers(server: Gunicorn) -> set[int]:
    """The PIDs of the instance's workers (the children of its master)."""
    pid = server.proc.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return {int(child) for child in children}


def _start_in_one_window(client: redis.Redis) -> int:
    """Wait, if less than 10 s of this minute are left (on the Redis server's clock, the
    limiter's), for the next one; answer the window."""
    seconds, _ = client.time()
    if 60 - seconds % 60 < 10:
        time.sleep(60 - seconds % 60 + 0.2)
    return int(client.time()[0]) // 60


@pytest.mark.slow
def test_inspect_lists_the_leases_each_worker_holds(
    instances: list[Gunicorn], redis_server: RedisProcess
) -> None:
    client = redis_server.client()
    client.flushall()
    window = _start_in_one_window(client)
    jobs = [instances[i % 2].port for i in range(LIMIT * 2 // 3)]  # below the limit
    with ThreadPoolExecutor(max_workers=CLIENT_THREADS) as pool:
        statuses = Counter(status for status, _ in pool.map(lambda p: _get(p, "/leased"), jobs))
    assert statuses == {200: len(jobs)}
    # inspect, in a process of its own, as an operator runs it
    inspect = subprocess.run(
        [sys.executable, "-m", "flask", "--app", "tests.apps.leasing_app", "distlimit",
         "inspect", "func:everyone"],
        env={**os.environ, **_env(redis_server), "PYTHONPATH": str(ROOT)},
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert inspect.returncode == 0, inspect.stderr
    assert client.time()[0] // 60 == window, "the requests outlasted their window"
    held = re.findall(r"held by ([^:\s]+):(\d+):(\w+): (\d+) units?,", inspect.stdout)
    listed = {int(pid) for _, pid, _, _ in held}
    assert len(listed) == len(held), inspect.stdout  # one line per process
    assert all(0 < int(units) <= auto_cap(LIMIT) for *_, units in held), inspect.stdout
    # each instance's traffic went to its workers, which took leases and published them when
    # they did: workers of both instances are listed, and nothing else
    for server in instances:
        assert listed & _workers(server), (server.proc.pid, inspect.stdout)
    assert listed <= _workers(instances[0]) | _workers(instances[1]), inspect.stdout
    print(inspect.stdout)
    client.close()


@pytest.mark.slow
def test_a_flooded_leased_limit_admits_at_most_the_limit_and_at_least_limit_minus_the_bound(
    instances: list[Gunicorn], redis_server: RedisProcess
) -> None:
    client = redis_server.client()
    client.flushall()
    started_window = _start_in_one_window(client)  # one fixed window holds the whole flood
    jobs = [instances[i % 2].port for i in range(FLOOD)]
    with ThreadPoolExecutor(max_workers=CLIENT_THREADS) as pool:
        statuses = Counter(status for status, _ in pool.map(lambda p: _get(p, "/leased"), jobs))
    assert client.time()[0] // 60 == started_window, "the flood outlasted its window"
    assert set(statuses) <= {200, 429}, statuses
    bound = PROCESSES * auto_cap(LIMIT)
    assert LIMIT - bound <= statuses[200] <= LIMIT, (statuses, bound)
    # Leases were taken: the shared count holds every admission and every unit still leased.
    (key,) = [k for k in client.scan_iter(match="lease-*leased*", count=1000)]
    used = int(client.hget(key, "n") or 0)
    assert used == LIMIT
    held: dict[int, int] = {}  # by worker PID: what it still holds
    for port in (instances[0].port, instances[1].port) * 8:  # reaches most workers
        _, body = _get(port, "/leases")
        report = json.loads(body)
        held[report["pid"]] = sum(v["held"] for v in report["leases"].values())
    assert statuses[200] + sum(held.values()) <= LIMIT
    print(f"admitted {statuses[200]} of {FLOOD}; held after: {held}; bound {bound}")
    client.close()
