"""Load never switches the limiter off, served as users serve it (issue 23): real gunicorn, real
Redis, ``wrk`` on loopback, and the DEFAULT configuration (``DISTLIMIT_REDIS_TIMEOUT`` 0.1 s,
five failures open the breaker, policy ``open``: a request the policy answers is marked
``X-RateLimit-Degraded``, which the Lua script of ``wrk`` counts).

Each deployment starts a fresh gunicorn (an empty pool, the script not loaded: the burst is
its cold start) and must admit exactly the limit (a sliding log of an hour: nothing leaves it),
answer no 5xx, mark no answer degraded, and log no breaker opening. On the old code the gevent
worker at 320 connections admitted about three times its limit and opened the breaker.

Admissions are counted by the views that ran (``LOAD_TEST_ADMITTED``); ``wrk``'s 200s may only
be fewer: a saturated gevent worker can answer an admitted request after ``wrk``'s run (a flood
of cached 429s did, before they waited a turn of the event loop: docs/deployment.md).
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from tests.gunicorn_servers import ROOT, Gunicorn, launch, wait_ready
from tests.servers import RedisProcess

pytestmark = [pytest.mark.gunicorn, pytest.mark.redis, pytest.mark.slow]

LIMIT = 50
STATUSES = ROOT / "tests" / "apps" / "statuses.lua"


@dataclass(frozen=True)
class Deployment:
    """How gunicorn serves ``tests.apps.load_app``, and how ``wrk`` loads it."""

    args: tuple[str, ...]
    connections: int
    path: str = "/limited"
    env: tuple[tuple[str, str], ...] = ()


DEPLOYMENTS = {
    "gevent-320": Deployment(("-k", "gevent", "--worker-connections", "1000", "-w", "1"), 320),
    # the app imported by gunicorn's master, before the worker patches: the locks made then are
    # the OS's (without a secret, the digest key's first read held one: 0 of 320 answered)
    "gevent-preload-320": Deployment(
        ("--preload", "-k", "gevent", "--worker-connections", "1000", "-w", "1"), 320
    ),
    "gthread-128": Deployment(("-k", "gthread", "--threads", "128", "-w", "1"), 200),
    "threads-300": Deployment(("-k", "gthread", "--threads", "300", "-w", "1"), 300),
    # a view that spends 5 ms of CPU holding the GIL, two workers: both cores busy
    "cpu-bound": Deployment(
        ("-k", "gthread", "--threads", "32", "-w", "2"), 64, "/cpu", (("LOAD_TEST_CPU", "0.005"),)
    ),
}


def serve(deployment: Deployment, storage_url: str, prefix: str, logdir: Path) -> Gunicorn:
    env = {
        "DISTLIMIT_STORAGE_URL": storage_url,
        "LOAD_TEST_LIMIT": str(LIMIT),
        "LOAD_TEST_PREFIX": prefix,
        "LOAD_TEST_ADMITTED": str(logdir / f"{prefix}.admitted"),
        **dict(deployment.env),
    }
    return launch("tests.apps.load_app:app", env, logdir, deployment.args)


@dataclass(frozen=True)
class Load:
    """What ``wrk`` counted (tests/apps/statuses.lua)."""

    statuses: dict[int, int]
    degraded: int
    errors: tuple[int, ...]  # connect, read, write, timeout

    @property
    def fivexx(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)


def load(port: int, path: str, connections: int, seconds: int = 3) -> Load:
    out = subprocess.run(
        [
            "wrk", "-t2", f"-c{connections}", f"-d{seconds}s", "--timeout", "10s",
            "-s", str(STATUSES), f"http://127.0.0.1:{port}{path}",
        ],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    statuses = {int(s): int(n) for s, n in re.findall(r"^status (\d+) (\d+)$", out, re.M)}
    degraded = int(re.search(r"^degraded (\d+)$", out, re.M).group(1))  # type: ignore[union-attr]
    errors = re.search(r"^errors (\d+) (\d+) (\d+) (\d+)$", out, re.M)
    assert errors is not None, out
    return Load(statuses, degraded, tuple(int(n) for n in errors.groups()))


def admissions(path: Path, settle: float = 0.5, limit: float = 20.0) -> int:
    """The views run, once no more has run for ``settle`` seconds (the requests still in
    flight when the load stopped finish first)."""
    seen, since, until = -1, time.monotonic(), time.monotonic() + limit
    while time.monotonic() < until:
        now = path.stat().st_size if path.exists() else 0
        if now != seen:
            seen, since = now, time.monotonic()
        elif time.monotonic() - since >= settle:
            break
        time.sleep(0.05)
    return seen


@pytest.fixture(scope="module")
def logdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="distlimit-load-") as made:
        yield Path(made)


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_load_admits_the_limit_with_no_5xx_and_the_breaker_closed(
    name: str, redis_server: RedisProcess, redis_client: redis.Redis, logdir: Path
) -> None:
    deployment = DEPLOYMENTS[name]
    server = serve(deployment, redis_server.url, f"load-{name}", logdir)
    try:
        wait_ready(server)
        seen = load(server.port, deployment.path, deployment.connections)
        admitted = admissions(logdir / f"load-{name}.admitted")
        breaker = json.loads(
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/breaker", timeout=10).read()
        )
        log = server.log.read_text()  # before the stop: at a --preload worker's exit, logging
        # may print an ignored TypeError (gevent's get_ident already torn down)
    finally:
        server.stop()
    assert admitted == LIMIT, (admitted, seen, log[-2000:])
    assert 0 < seen.statuses.get(200, 0) <= LIMIT, (seen, log[-2000:])
    assert seen.fivexx == 0 and seen.degraded == 0, (seen, log[-2000:])
    assert seen.statuses.get(429, 0) > LIMIT  # the load went well past the limit
    assert seen.errors[1:] == (0, 0, 0), seen  # no read or write error, no timeout
    assert (breaker["state"], breaker["failures"]) == ("closed", 0)
    assert "circuit breaker" not in log and "Traceback" not in log, log[-2000:]
