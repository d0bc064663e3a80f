"""Black box: concurrency limits and fleet shedding on 2 gunicorn instances x 3 gthread workers
x 4 threads, one real Redis. Exactly N requests of one client are in flight at once, counted on
the server side (the handlers hold on a Redis barrier); a slot whose worker was SIGKILLed
mid-request comes back once its lease ends; the fleet's capacity sheds sheddable, then default
traffic, and keeps its last slot for critical requests.
"""

from __future__ import annotations

import http.client
import os
import signal
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from tests.gunicorn_servers import Gunicorn, launch, status_of, until, wait_ready
from tests.servers import RedisProcess

pytestmark = [pytest.mark.gunicorn, pytest.mark.redis]

ROOT = Path(__file__).resolve().parents[2]
#: N of /slow: below the 4 threads of a worker, so a worker never has all its threads held and
#: every request is decided while the others wait (a request queued behind 4 held threads would
#: wait for the barrier).
N = 3
REQUESTS = 14


def _start(redis_url: str, prefix: str, logdir: Path, lease: int, fleet: int) -> Gunicorn:
    env = {
        "DISTLIMIT_STORAGE_URL": redis_url,
        "DISTLIMIT_CONCURRENCY_LEASE": str(lease),
        "CONCURRENCY_TEST_N": str(N),
        "CONCURRENCY_TEST_PREFIX": prefix,
        "CONCURRENCY_TEST_FLEET": str(fleet),
    }
    return launch("tests.apps.concurrency_app:app", env, logdir)


@pytest.fixture
def deploy(redis_server: RedisProcess) -> Iterator[Callable[..., list[Gunicorn]]]:
    """``deploy(instances, lease, fleet=0)``: gunicorn masters on the session's Redis (``fleet``:
    ``DISTLIMIT_FLEET_CAPACITY``), stopped after."""
    started: list[Gunicorn] = []
    with tempfile.TemporaryDirectory(prefix="distlimit-cc-") as logdir:

        def make(instances: int, lease: int, fleet: int = 0) -> list[Gunicorn]:
            prefix = f"cc-{os.getpid()}-{len(started)}"
            made = [
                _start(redis_server.url, prefix, Path(logdir), lease, fleet)
                for _ in range(instances)
            ]
            started.extend(made)
            for server in made:
                wait_ready(server)
            return made

        try:
            yield make
        finally:
            for server in started:
                server.stop()


def _prefix(client: redis.Redis) -> str:
    keys = [k.decode() for k in client.scan_iter(match="cc-*:pids", count=1000)]
    assert len(keys) == 1, keys
    return keys[0].rsplit(":", 1)[0]


@pytest.mark.slow
def test_exactly_n_in_flight_across_instances_workers_and_threads(
    deploy: Callable[..., list[Gunicorn]], redis_server: RedisProcess
) -> None:
    client = redis_server.client()
    client.flushall()
    instances = deploy(2, 60)
    with ThreadPoolExecutor(max_workers=REQUESTS) as pool:
        futures: list[Future[int]] = [
            pool.submit(status_of, instances[i % 2].port, "/slow") for i in range(REQUESTS)
        ]
        # Every request is decided: N are held on the barrier, the others were refused.
        until(lambda: sum(f.done() for f in futures) == REQUESTS - N, "the refusals")
        until(lambda: client.llen(_prefix(client) + ":seen") == N, "the held handlers")
        prefix = _prefix(client)
        assert int(client.get(f"{prefix}:inflight") or 0) == N
        early = Counter(f.result() for f in futures if f.done())
        assert early == Counter({429: REQUESTS - N})
        # While the N are held, nobody else gets in, from either instance.
        assert [status_of(instances[i % 2].port, "/slow") for i in range(4)] == [429] * 4
        client.rpush(f"{prefix}:go", *["go"] * REQUESTS)  # the barrier opens
        statuses = Counter(f.result() for f in futures)
    assert statuses == Counter({200: N, 429: REQUESTS - N})
    seen = [int(v) for v in client.lrange(f"{prefix}:seen", 0, -1)]
    assert max(seen) == N and len(seen) == N  # never more than N at once, server-side
    # Decided by several processes of both instances (the holders may share one).
    assert len(set(client.lrange(f"{prefix}:answered", 0, -1))) >= 2
    # Every slot is given back when the server has written its response, which may be just
    # after the client read it: the next N get in at once.
    slot_keys = [k for k in client.scan_iter(match=f"{prefix}:*concurrency", count=1000)]
    until(lambda: all(client.zcard(k) == 0 for k in slot_keys), "every slot given back", 10)
    client.close()


@pytest.mark.slow
def test_a_killed_workers_slot_comes_back_after_its_lease(
    deploy: Callable[..., list[Gunicorn]], redis_server: RedisProcess
) -> None:
    client = redis_server.client()
    client.flushall()
    lease = 4
    (server,) = deploy(1, lease)
    with ThreadPoolExecutor(max_workers=1) as pool:
        held = pool.submit(status_of, server.port, "/one")
        until(lambda: bool(client.keys("cc-*:pids")), "the held request")
        prefix = _prefix(client)
        pid = int(client.lindex(f"{prefix}:pids", 0) or 0)
        (slot_key,) = client.scan_iter(match=f"{prefix}:*concurrency", count=1000)
        (token, lease_end_us), *_ = client.zrange(slot_key, 0, 0, withscores=True)
        os.kill(pid, signal.SIGKILL)  # mid-request: no teardown, no response close
        with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
            held.result()
    # The dead worker never gave its slot back: the next request is refused while its lease
    # runs (checked only with a second of margin: the machine may be slow).
    seconds, micros = client.time()
    if seconds * 1_000_000 + micros < lease_end_us - 1_000_000:
        assert status_of(server.port, "/one") == 429
    assert client.zscore(slot_key, token) is not None
    # Once the lease has ended, the slot is free again: the next request gets in.
    until(lambda: _server_us(client) > lease_end_us, "the lease's end")
    client.rpush(f"{prefix}:go", "go")  # the request admitted next must not hold forever
    assert status_of(server.port, "/one") == 200
    assert client.zscore(slot_key, token) is None
    client.close()


def _server_us(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1_000_000 + int(micros)


@pytest.mark.slow
def test_the_fleet_sheds_priorities_in_order_across_instances(
    deploy: Callable[..., list[Gunicorn]], redis_server: RedisProcess
) -> None:
    """DISTLIMIT_FLEET_CAPACITY=3: sheddable may hold 1 slot (60%), default 2 (80%), critical 3.
    Requests are held on the barrier one at a time, alternating instances (at most 3 held: no
    worker ever has all its 4 threads held, so every request is decided at once)."""
    client = redis_server.client()
    client.flushall()
    instances = deploy(2, 60, 3)
    sent = 0
    held: list[Future[int]] = []

    with ThreadPoolExecutor(max_workers=8) as pool:

        def send(priority: str) -> int | None:
            """The status of a refused request, or None once it is held on the barrier."""
            nonlocal sent
            port = instances[sent % 2].port
            sent += 1
            future = pool.submit(status_of, port, f"/work?p={priority}")
            before = len(held)
            until(
                lambda: future.done() or _held_count(client) > before,
                "the request to be held or refused",
            )
            if future.done():
                return future.result()
            held.append(future)
            return None

        assert send("sheddable") is None
        assert [send("sheddable"), send("default")] == [503, None]
        assert [send("sheddable"), send("default"), send("critical")] == [503, 503, None]
        assert [send("sheddable"), send("default"), send("critical")] == [503, 503, 503]
        prefix = _prefix(client)
        fleet_key = f"{prefix}:{{fleet}}:fleet:concurrency"
        assert client.zcard(fleet_key) == 3  # the three held requests, in one fleet-wide key
        client.rpush(f"{prefix}:go", *["go"] * len(held))
        assert [f.result() for f in held] == [200, 200, 200]
    # Every slot comes back when the server has written its response (which may be just after
    # the client read it): the fleet is empty again.
    until(lambda: client.zcard(fleet_key) == 0, "the fleet's slots given back", 10)
    client.close()


def _held_count(client: redis.Redis) -> int:
    """Requests that reached the barrier so far (0 before the first)."""
    keys = list(client.scan_iter(match="cc-*:seen", count=1000))
    return int(client.llen(keys[0])) if keys else 0


@pytest.mark.slow
def test_a_stream_longer_than_its_lease_keeps_its_slot(
    deploy: Callable[..., list[Gunicorn]], redis_server: RedisProcess
) -> None:
    """Issue 24, finding 7: gthread never times a request out, and a stream's slot was never
    renewed, so past the lease a second stream got in under concurrency(1). Lease 2 s; the
    stream sends 24 chunks 0.25 s apart (about 6 s): the second request comes once the first
    has sent 12 chunks (past its first lease, counted in chunks, not seconds)."""
    client = redis_server.client()
    client.flushall()
    (server,) = deploy(1, 2)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("GET", "/long-stream")
        response = conn.getresponse()
        assert response.status == 200
        received = b""
        while received.count(b"\n") < 12:
            received += response.read1(64)
        assert status_of(server.port, "/long-stream") == 429  # the stream still holds its slot
        received += response.read()
        assert received.count(b"\n") == 24
    finally:
        conn.close()
    until(lambda: status_of(server.port, "/long-stream") == 200, "the slot to come back", 30)
    client.close()
