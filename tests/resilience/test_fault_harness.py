"""The deterministic core of the fault harness (``bench/faults.py``, issue 11) in the suite.

Already covered elsewhere: a storage that fails every other call, bursts, flapping and random
timeouts against the fleet bound (tests/defences/test_fleet_bound.py, on a fake clock); a Redis
restart after the fleet was learnt (tests/resilience/test_instances.py). Here:

- the fault proxy (``bench/fault_proxy.py``) forwards, delays and resets as told;
- a delayed socket: the limiter's storage through the proxy, its replies late; a reply later than
  ``DISTLIMIT_REDIS_TIMEOUT`` is an outage, and under policy ``local`` the fleet bound holds even
  though Redis counted the requests whose replies were lost (FailingStorage never reaches Redis);
- a Redis restart while the fleet is still learning its size;
- the harness's own judgement (``bench.faults.analyse``) on made-up samples;
- one harness scenario end to end (``--quick``: gunicorn, real redis-server, kill -9).

No assertion on a duration: delays are compared as "at least", everything else as counts.
"""

from __future__ import annotations

import itertools
import random
import socket
import time
from collections import defaultdict
from collections.abc import Iterator

import pytest
import redis

from bench import faults
from bench.fault_proxy import FaultProxy
from flask_distlimit.core.decision import Check
from flask_distlimit.resilience.guard import Guard
from flask_distlimit.storage.base import Storage
from flask_distlimit.storage.urls import from_url
from tests.faults import opened
from tests.guard_helpers import FakeClock
from tests.servers import RedisProcess, start_redis

pytestmark = pytest.mark.redis


def _storage(url: str, timeout: float) -> Storage:
    return opened(from_url(url, timeout=timeout))


@pytest.fixture
def proxy(redis_server: RedisProcess) -> Iterator[FaultProxy]:
    with FaultProxy(redis_server.port, seed=11) as started:
        yield started


def _ping(sock: socket.socket) -> bytes:
    sock.sendall(b"*1\r\n$4\r\nPING\r\n")
    return sock.recv(64)


# -- the proxy ----------------------------------------------------------------------------------


def test_the_proxy_forwards_both_ways(proxy: FaultProxy, redis_client: redis.Redis) -> None:
    client = redis.Redis(port=proxy.port, socket_timeout=5)
    try:
        client.set("through-the-proxy", "x" * 200_000, ex=60)  # several chunks each way
        assert client.get("through-the-proxy") == b"x" * 200_000
        assert redis_client.get("through-the-proxy") == b"x" * 200_000
    finally:
        client.close()
    assert proxy.stats["connections"] >= 1


def test_the_proxy_delays_replies_in_order(proxy: FaultProxy) -> None:
    proxy.set_delay(0.2, 0.3)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        started = time.monotonic()
        sock.sendall(b"*1\r\n$4\r\nPING\r\n" + b"*2\r\n$4\r\nECHO\r\n$3\r\ntwo\r\n")
        received = b""
        while received.count(b"\r\n") < 3:
            received += sock.recv(64)
        waited = time.monotonic() - started
    assert received == b"+PONG\r\n$3\r\ntwo\r\n"
    assert waited >= 0.2  # at least the smallest delay
    assert proxy.stats["delayed"] >= 1


def test_the_proxy_resets_open_connections(proxy: FaultProxy) -> None:
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        assert _ping(sock) == b"+PONG\r\n"
        assert proxy.reset_all() == 1
        with pytest.raises(ConnectionError):
            _ping(sock)
            _ping(sock)  # the RST may arrive after the first send
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        assert _ping(sock) == b"+PONG\r\n"  # new connections are forwarded again
    assert proxy.stats["resets"] == 1


def test_the_proxy_down_resets_every_connection_until_up(proxy: FaultProxy) -> None:
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as old:
        assert _ping(old) == b"+PONG\r\n"
        proxy.set_down(True)
        with pytest.raises(ConnectionError):
            _ping(old)
            _ping(old)
        with (  # the reset may come before connect() returns, or at the first send or recv
            pytest.raises(ConnectionError),
            socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as new,
        ):
            _ping(new)
            _ping(new)
    proxy.set_down(False)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        assert _ping(sock) == b"+PONG\r\n"
    assert proxy.stats["refused"] >= 1


# -- a delayed socket ---------------------------------------------------------------------------


def test_a_reply_later_than_the_timeout_is_an_outage_and_a_reset_is_retried(
    proxy: FaultProxy, redis_client: redis.Redis
) -> None:  # redis_client: the server is flushed first
    """A storage whose replies are 1 s late with a 50 ms budget: every call is an outage
    (the budget ends long before any reply can come), the guard degrades; without the delay, the
    next call answers. A connection the proxy reset between two calls costs no call its answer
    (the pooled connection is replaced before anything is sent on it)."""
    checks = [Check("ratelimit:{delayed}:r:fixed_window", "fixed_window", 1000, 60)]
    guard = Guard(_storage(proxy.url, 0.05), policy="closed", fail_max=100)
    assert not guard.evaluate(checks).degraded
    proxy.set_delay(1.0)
    outcomes = [guard.evaluate(checks) for _ in range(3)]
    assert [o.unavailable for o in outcomes] == [True, True, True]
    assert guard.breaker.failures == 3
    proxy.set_delay(0)
    patient = Guard(_storage(proxy.url, 5.0), policy="closed")
    assert not patient.evaluate(checks).degraded
    for _ in range(5):
        assert proxy.reset_all() >= 1
        assert not patient.evaluate(checks).degraded


LIMIT, PROCESSES, CLIENTS, STEP_US = 30, 3, 4, 5_000
SHARE = LIMIT // PROCESSES
EPOCH_US = 1_700_000_000 * 1_000_000


@pytest.mark.slow
def test_local_keeps_the_fleet_bound_when_replies_are_late(
    redis_server: RedisProcess, redis_client: redis.Redis
) -> None:
    """3 guards (processes) through the proxy; half the replies come back 300 ms late against a
    50 ms budget: those calls are outages to the guard, but Redis ran their scripts and counted
    them (a lost reply, not a failed send). Fake clock, as tests/defences/test_fleet_bound.py: 4
    clients at 50 requests a second over 3 processes against 30/second: in every window the fleet
    admits at most 1.1 x 30 per client and each process at most 10 + 1."""
    with FaultProxy(redis_server.port, seed=11) as proxy:
        rng = random.Random(11)
        clock = FakeClock(start=0.0)
        guards = [
            Guard(_storage(proxy.url, 0.05), policy="local", instances=PROCESSES, fail_max=5,
                  reset_timeout=0.5, clock=clock)
            for _ in range(PROCESSES)
        ]  # fmt: skip
        checks = [
            [Check(f"ratelimit:{{client-{c}}}:r:fixed_window", "fixed_window", LIMIT, 1)]
            for c in range(CLIENTS)
        ]
        admitted: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0] * PROCESSES)
        degraded = answered = 0
        for i in range(300):  # 1.5 s of the fake clock
            now_us = EPOCH_US + i * STEP_US
            clock.now = i * STEP_US / 1_000_000
            client, process = i % CLIENTS, (i // CLIENTS) % PROCESSES
            proxy.set_delay(0.3 if rng.random() < 0.5 else 0.0)
            outcome = guards[process].evaluate(checks[client], now_us=now_us)
            assert outcome.evaluation is not None and not outcome.unavailable
            degraded += outcome.degraded
            answered += not outcome.degraded
            if outcome.evaluation.allowed:
                admitted[(now_us // 1_000_000, client)][process] += 1
    assert degraded > 20 and answered > 10  # both sides exercised (here ~230 and ~70)
    fleet = max(sum(per) for per in admitted.values())
    worst = max(max(per) for per in admitted.values())
    print(f"\n[late replies] fleet max {fleet}, process max {worst}, {degraded} degraded")
    assert fleet <= 1.1 * LIMIT
    assert worst <= SHARE + 1


# -- a restart while the fleet is learning its size ----------------------------------------------


def test_a_restart_while_the_fleet_learns_its_size_never_lowers_a_divisor() -> None:
    """DISTLIMIT_INSTANCES = "auto", 3 processes starting: their first beats learn 1, 2, 3.
    Redis restarts (empty) in the middle of the second round, after the first process has beaten
    and before the two others. Nobody's divisor goes down (before the fleet size survived
    restarts, the second and third learned 1 and 2 again), all reach 3 by the round after, and
    an outage then admits exactly the share in each process."""
    server = start_redis()
    try:
        clock = FakeClock()
        guards = [
            Guard(_storage(server.url, 1.0), policy="local", instances="auto", clock=clock)
            for _ in range(PROCESSES)
        ]
        probe = [Check("ratelimit:{probe}:r:fixed_window", "fixed_window", 10**9, 60)]
        history: list[list[int]] = []

        def a_round(restart_after: int | None = None) -> None:  # each process beats once
            for n, guard in enumerate(guards):
                assert not guard.evaluate(probe).degraded
                history.append([g.instances.divisor for g in guards])
                if n == restart_after:
                    server.restart()  # empty: the heartbeats and the reported sizes are gone
            clock.advance(5)

        a_round()
        assert history[-1] == [1, 2, 3]  # learning: each saw the fleet as it had beaten so far
        a_round(restart_after=0)
        a_round()
        for before, after in itertools.pairwise(history):
            assert all(b <= a for b, a in zip(before, after, strict=True)), history
        assert history[-1] == [3, 3, 3], history
        server.stop()  # the outage
        key = [Check("ratelimit:{client}:r:fixed_window", "fixed_window", LIMIT, 60)]
        admitted = [
            sum(bool(g.evaluate(key).evaluation.allowed) for _ in range(LIMIT))  # type: ignore[union-attr]
            for g in guards
        ]
        assert admitted == [SHARE] * PROCESSES
    finally:
        server.stop()


# The two overshoots of policy local the harness found (a stale remaining at the start of an
# outage; breakers closing out of phase after it) are tests/resilience/test_local_bounds.py.


# -- the harness's judgement --------------------------------------------------------------------


def _sample(
    client: str, at: float, status: int = 200, pid: str = "1", **kw: object
) -> faults.Sample:
    fields: dict[str, object] = {
        "client": client, "sent": at, "latency": 0.001, "status": status, "pid": pid,
        "start": at, "end": at + 0.001, "limiter_ms": 0.5, "degraded": False,
    }  # fmt: skip
    fields.update(kw)
    return faults.Sample(**fields)  # type: ignore[arg-type]


def _run(policy: str, samples: list[faults.Sample], **kw: object) -> faults.Run:
    after = [_sample("a", 106.0), _sample("b", 106.0)]  # exact again after the fault
    options: dict[str, object] = {
        "scenario": "made-up", "policy": policy, "samples": [*samples, *after],
        "fault_start": 100.5, "fault_end": 103.5, "run_end": 108.0, "affected": {"a"},
        "healthy": False,
    }  # fmt: skip
    options.update(kw)
    return faults.Run(**options)  # type: ignore[arg-type]


def test_the_harness_judges_admissions_per_window_and_process() -> None:
    exact = [_sample("a", 101 + i / 100, pid=str(i % 3)) for i in range(30)]
    assert faults.analyse(_run("closed", exact)).broken == []
    one_more = [*exact, _sample("a", 101.9)]
    assert [p for p, _ in faults.analyse(_run("closed", one_more)).broken] == ["fleet"]
    # An admission whose limiter time straddles a boundary: Redis's remaining tells its window.
    counted = [_sample("a", 101 + i / 100, pid=str(i % 3), remaining=29 - i) for i in range(30)]
    first_of_next = _sample("a", 101.9995, end=102.0005, remaining=29)
    assert faults.analyse(_run("closed", [*counted, first_of_next])).broken == []
    late = [*counted[:29], _sample("a", 101.9995, end=102.0005, remaining=0)]
    assert faults.analyse(_run("closed", late)).broken == []  # the 30th of window 101
    assert len(faults.windows_of(late)[(101, "a")]) == 30
    # local: 33 fleet-wide is within 1.1 x 30, but one process at 12 is over its share + 1.
    local = [_sample("a", 101 + i / 100, pid=str(i % 3)) for i in range(30)]
    local += [_sample("a", 101.5 + i / 100, pid="0") for i in range(3)]
    assert [p for p, _ in faults.analyse(_run("local", local)).broken] == ["process"]


def test_the_harness_judges_5xx_per_policy() -> None:
    refused = [_sample("a", 101.0, status=503, degraded=True)]
    assert faults.analyse(_run("closed", refused)).broken == []
    assert [p for p, _ in faults.analyse(_run("open", refused)).broken] == ["5xx"]
    # closed, but Redis was healthy (CLIENT KILL storm) or healthy for this client (Cluster).
    assert [p for p, _ in faults.analyse(_run("closed", refused, healthy=True)).broken] == ["5xx"]
    other = [_sample("b", 101.0, status=503, degraded=True)]
    assert [p for p, _ in faults.analyse(_run("closed", other)).broken] == ["5xx"]
    errors = [_sample("a", 101.0, status=500)]
    assert [p for p, _ in faults.analyse(_run("closed", errors)).broken] == ["5xx"]


# -- one scenario end to end --------------------------------------------------------------------


@pytest.mark.gunicorn
@pytest.mark.slow
def test_one_harness_scenario_runs_end_to_end() -> None:
    """``python bench/faults.py --quick --only kill --policy closed``: gunicorn (3 gthread
    workers), a private redis-server killed and restarted, 4 clients. Its promises on counts
    hold: no 5xx but the policy's 503, never more than the limit per client and window. Latency
    and recovery time are the machine's, not asserted. (Policy ``local`` is not the one run here:
    on current code its start-window overshoot, test_a_stale_remaining_overshoots_the_start_
    window below, shows in some runs.)"""
    run = faults.run_one(faults.SCENARIOS["kill"], "closed", quick=True, seed=11)
    assert not run.error, run.error
    row = faults.analyse(run)
    print("\n| " + " | ".join(row.cells()) + " |")
    assert row.requests > 50
    pids = {s.pid for s in run.samples if s.status == 200}
    assert len(pids) == faults.WORKERS  # admissions counted per process
    assert [b for b in row.broken if b[0] in ("run", "5xx", "fleet", "process")] == []
    assert row.s503 > 0 and not row.other5xx  # the fault was felt, as the policy says
