"""Partial failures of a real redis-server against the hot call that no longer probes a pooled
connection at checkout (a closed one fails the send or loses the reply, and the call is made
again under its request token): a restart between requests while several threads hold pooled
connections, the server's idle ``timeout`` closing every pooled connection, and ``maxclients``
refusing the reconnect. Each request is answered (or gets the failure policy when the server
refuses it), counted once, never handed another call's reply, and no connection leaks.

And error replies (answered by the failure policy since they are no 500) that come and go under
policy ``local``: the fallback takes over and hands back within the documented bounds."""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.cluster import RedisCluster

from flask_distlimit.core.decision import Check
from flask_distlimit.errors import StorageResponseError, StorageUnavailable
from flask_distlimit.resilience.guard import Guard
from flask_distlimit.storage.redis import RedisStorage
from flask_distlimit.storage.urls import from_url
from tests.faults import FailingStorage
from tests.guard_helpers import FakeClock
from tests.servers import ClusterServers, RedisProcess, start_redis, tags_on_distinct_primaries

pytestmark = pytest.mark.redis

THREADS = 4
CHECK = Check("ratelimit:{partial}:r:1000000/3600:fixed_window", "fixed_window", 1_000_000, 3600)


@pytest.fixture
def server() -> Iterator[RedisProcess]:
    made = start_redis()
    try:
        yield made
    finally:
        made.stop()


def _storage(server: RedisProcess) -> RedisStorage:
    return RedisStorage(host="127.0.0.1", port=server.port, timeout=3.0, max_connections=THREADS)


def _admin(server: RedisProcess) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=server.port)


def _pool_every_connection(storage: RedisStorage) -> list[int]:
    """Connect all ``THREADS`` connections of the hot pool and leave them idle in it; their
    CLIENT IDs."""
    pool: Any = storage.pool
    held = [pool.get_connection() for _ in range(THREADS)]
    ids = []
    for connection in held:
        connection.send_command("CLIENT", "ID")
        ids.append(int(connection.read_response()))
    for connection in held:
        pool.release(connection)
    return ids


def _requests_from_threads(storage: RedisStorage, each: int) -> tuple[int, list[BaseException]]:
    """``THREADS`` threads make ``each`` calls at once: how many were admitted, what raised."""
    admitted = [0] * THREADS
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def work(i: int) -> None:
        start.wait()
        for _ in range(each):
            try:
                evaluation = storage.evaluate([CHECK])
            except BaseException as exc:  # reported by the test
                errors.append(exc)
            else:
                # never another call's reply: a fixed window of this size always admits
                admitted[i] += evaluation.allowed and evaluation.decisions[0].limit == CHECK.limit

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(admitted), errors


def _count(admin: redis.Redis) -> int:
    return int(admin.hget(CHECK.key, "n") or 0)


def _no_leak(storage: RedisStorage) -> None:
    pool: Any = storage.pool
    assert len(pool._made) <= THREADS
    assert len(pool._idle) == len(pool._made)  # every connection back in the pool


def test_a_restart_between_requests_under_threads_costs_no_answer(server: RedisProcess) -> None:
    """Every pooled connection dies with the server; 4 threads' requests after the restart
    (same port, empty, no script) are all answered and each counted once."""
    storage = _storage(server)
    try:
        storage.evaluate([CHECK])
        _pool_every_connection(storage)
        server.restart()
        admitted, errors = _requests_from_threads(storage, each=5)
        assert not errors
        assert admitted == THREADS * 5
        admin = _admin(server)
        assert _count(admin) == THREADS * 5  # the restarted Redis counted each once
        _no_leak(storage)
        admin.close()
    finally:
        storage.close()


@pytest.mark.slow
def test_the_server_idle_timeout_closing_every_pooled_connection_costs_no_answer(
    server: RedisProcess,
) -> None:
    """``CONFIG SET timeout 1``: the server closes every idle pooled connection; the next
    requests from 4 threads are answered and counted once, and the repeats' GETs of a kept
    reply show the lost-reply path ran (nothing ran twice)."""
    storage = _storage(server)
    admin = _admin(server)
    try:
        storage.evaluate([CHECK])
        ids = _pool_every_connection(storage)
        admin.config_set("timeout", 1)
        for _ in range(200):  # the server's cron closes them after a second or two idle
            live = {int(c["id"]) for c in admin.client_list()}
            if not live & set(ids):
                break
            time.sleep(0.05)
        else:
            pytest.fail("the server never closed the idle connections")
        admin.config_set("timeout", 0)
        admin.config_resetstat()
        before = _count(admin)
        admitted, errors = _requests_from_threads(storage, each=3)
        assert not errors
        assert admitted == THREADS * 3
        assert _count(admin) == before + THREADS * 3
        _no_leak(storage)
    finally:
        admin.close()
        storage.close()


@pytest.mark.slow
def test_maxclients_refusing_the_reconnect_gets_the_policy_and_leaks_nothing(
    server: RedisProcess,
) -> None:
    """The pooled connection is closed and the server is full (``maxclients``): the reconnect
    is refused, so the request is an outage (the policy answers, the breaker hears a failure),
    not a stale reply, not a reply the limiter cannot read; once a place is free, the next
    request is answered and what Redis counted is exactly what was admitted."""
    storage = RedisStorage(host="127.0.0.1", port=server.port, timeout=1.0, max_connections=1)
    admin = _admin(server)
    guard = Guard(storage, policy="closed", fail_max=1, reset_timeout=30.0, clock=FakeClock())
    filler = _admin(server)
    try:
        assert not guard.evaluate([CHECK]).degraded
        admin.ping()
        pool: Any = storage.pool
        admin.config_set("maxclients", 2)  # admin + the pooled connection
        admin.client_kill_filter(_type="normal", skipme=True)  # closes the pooled connection
        filler.ping()  # the place it left is taken
        outcome = guard.evaluate([CHECK])
        assert outcome.unavailable  # closed: a 503, the storage failed
        assert guard.breaker.state == "open"
        assert guard.health()["unreadable_replies"] == 0
        assert len(pool._made) == 1 and pool._idle and not pool._live  # back, disconnected
        filler.close()
        for _ in range(200):  # the server sees the filler go
            if len(admin.client_list()) == 1:
                break
            time.sleep(0.01)
        guard.breaker.reset()
        evaluation = storage.evaluate([CHECK])
        assert evaluation.allowed and evaluation.decisions[0].remaining == CHECK.limit - 2
        assert _count(admin) == 2  # the refused request never ran
        _no_leak(storage)
    finally:
        filler.close()
        admin.close()
        storage.close()


class ErrorReplies(FailingStorage):
    """:class:`FailingStorage` whose picked calls meet an error reply (the store answered)
    instead of an outage."""

    def _gate(self) -> None:
        try:
            super()._gate()
        except StorageUnavailable as exc:
            raise StorageResponseError(f"injected error reply ({exc})") from exc


LIMIT, PROCESSES, STEP_US = 30, 3, 5_000
EPOCH_US = 1_700_000_000 * 1_000_000


def test_error_replies_that_come_and_go_keep_the_local_bounds(server: RedisProcess) -> None:
    """Policy ``local``, three processes on one real Redis, and every other call of each meets
    an error reply for the first two seconds: the local fallback takes over for those calls and
    counts the others too while engaged, then hands back. In every one-second window the fleet
    admits at most 1.1 x the limit and each process at most its share + 1 (docs/failure-modes.md,
    "The bound"); the breakers never open (the store answered), and Redis alone decides again
    once the settling period is over."""
    clock = FakeClock(start=0.0)
    erring = [True]
    guards = [
        Guard(ErrorReplies(from_url(server.url, timeout=1.0), lambda n: erring[0] and n % 2 == 0),
              policy="local", instances=PROCESSES, fail_max=2, reset_timeout=0.5, clock=clock)
        for _ in range(PROCESSES)
    ]  # fmt: skip
    check = [Check("ratelimit:{flaky}:r:fixed_window", "fixed_window", LIMIT, 1)]
    per_window: dict[int, int] = defaultdict(int)
    per_process: dict[tuple[int, int], int] = defaultdict(int)
    try:
        for step in range(6 * 200):  # 6 s, 200 requests a second, round robin
            clock.now = step * STEP_US / 1_000_000
            erring[0] = clock.now < 2.0
            process = step % PROCESSES
            outcome = guards[process].evaluate(check, now_us=EPOCH_US + step * STEP_US)
            assert outcome.evaluation is not None
            admitted = outcome.evaluation.allowed
            per_window[int(clock.now)] += admitted
            per_process[(int(clock.now), process)] += admitted
        print(f"\n[error replies come and go] admitted per window: {dict(per_window)}")
        assert all(g.breaker.state == "closed" and g.breaker.failures == 0 for g in guards)
        assert max(per_window.values()) <= 1.1 * LIMIT
        assert max(per_process.values()) <= LIMIT // PROCESSES + 1
        assert per_window[5] == LIMIT  # handed back: Redis alone admits the whole limit
        assert not any(g.fallback_active for g in guards)
        assert guards[0].health()["unreadable_replies"] > 0
    finally:
        for guard in guards:
            guard.storage.close()


@pytest.mark.slow
@pytest.mark.cluster
def test_error_replies_for_one_cluster_slot_group_get_the_local_share_for_its_keys_only(
    redis_cluster: ClusterServers, cluster_client: RedisCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real Redis Cluster whose real script answers an error reply for one slot group only
    (its primary runs another version of the script, say): under ``local``, that group's limit
    is decided by the local share, the other group's by Redis, all or nothing (what Redis took
    for a request the local share refuses is given back), the breakers stay closed, and no
    connection is left out of its pool. When the errors stop, Redis decides again."""
    from flask_distlimit.storage import cluster as cluster_storage
    from flask_distlimit.storage import tokens

    alice, bob = tags_on_distinct_primaries(redis_cluster, 2)
    plain = Check(f"t:{{{alice}}}:r:fixed_window", "fixed_window", 100, 3600)
    garbled = Check(f"t:{{{bob}}}:r:fixed_window", "fixed_window", 5, 3600)
    script_args = cluster_storage.script_args
    erring = [True]

    def garbled_group_errs(*args: Any, **kwargs: Any) -> tuple[list[str], list[str]]:
        keys, argv = script_args(*args, **kwargs)
        if erring[0] and any(f"{{{bob}}}" in k for k in keys):
            return keys, [f"{argv[0]},7"]
        return keys, argv

    monkeypatch.setattr(cluster_storage, "script_args", garbled_group_errs)
    monkeypatch.setattr(tokens, "script_args", garbled_group_errs)  # the slot groups' calls
    storage = from_url(redis_cluster.url, timeout=1.0)
    clock = FakeClock(start=0.0)
    guard = Guard(storage, policy="local", fail_max=2, reset_timeout=0.5, clock=clock)
    try:
        admitted = []
        for _ in range(8):
            outcome = guard.evaluate([plain, garbled])
            assert outcome.degraded and outcome.evaluation is not None
            admitted.append(outcome.evaluation.allowed)
        assert admitted == [True] * 5 + [False] * 3  # the local share of 5 (one instance)
        # Redis counted the plain limit once per admitted request, nothing for the refused
        assert int(cluster_client.hget(plain.key, "n") or 0) == 5
        assert not cluster_client.exists(garbled.key)
        assert set(guard.breakers.states().values()) == {"closed"}
        assert guard.health()["unreadable_replies"] == 8
        pools: Any = [pipeline.pool for pipeline in storage._pipelines.values()]
        assert all(len(p._idle) == len(p._made) for p in pools)
        erring[0] = False
        clock.advance(10.0)  # past the settling period: handed back
        outcome = guard.evaluate([plain])
        assert not outcome.degraded and outcome.evaluation is not None
        assert outcome.evaluation.decisions[0].remaining == 100 - 6
    finally:
        storage.close()


EXTREMES = [(10**12, 366 * 86400), (10**12, 1), (1, 366 * 86400), (10**6, 1), (1000, 366 * 86400)]


def test_no_rate_the_library_accepts_makes_the_script_refuse(server: RedisProcess) -> None:
    """Under policy ``open`` an error reply admits the request: a rate an app may declare, or a
    dynamic limit may answer per client, must never make the script refuse its arguments or
    answer a reply of the wrong shape. The extremes a ``Rate`` and each algorithm's bounds
    accept (10^12 units, 366 days, one second; the log up to 1,000, GCRA up to 1,000,000 a
    second), at a cost of 1 and of the whole limit, alone (the script's fast path) and two at
    once (its general path), three calls each: every one answered, with numbers in range."""
    from flask_distlimit.core.algorithms import ALGORITHMS
    from flask_distlimit.engine.gcra import MAX_GCRA_RATE
    from flask_distlimit.engine.sliding_window_log import MAX_LOG_LIMIT

    storage = RedisStorage(host="127.0.0.1", port=server.port, timeout=3.0)
    calls = 0
    try:
        for algorithm in ALGORITHMS:
            for limit, period in EXTREMES:
                if algorithm == "sliding_window_log" and limit > MAX_LOG_LIMIT:
                    continue
                if algorithm == "gcra" and limit > MAX_GCRA_RATE * period:
                    continue
                for count, cost in itertools.product((1, 2), (1, limit)):
                    checks = [
                        Check(f"t:{{x}}:{limit}/{period}:{i}:{algorithm}", algorithm, limit,
                              period, cost)
                        for i in range(count)
                    ]  # fmt: skip
                    for _ in range(3):
                        evaluation = storage.evaluate(checks)  # raises on a refusal
                        calls += 1
                        for d in evaluation.decisions:
                            assert 0 <= d.remaining <= limit and d.reset_after >= 0
        assert calls > 100
    finally:
        storage.close()
