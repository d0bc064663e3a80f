"""DISTLIMIT_INSTANCES: validation, heartbeat timing on a fake clock, live counts on a real
Redis, gunicorn workers (forked from a preloaded app) counted as one instance each, a fleet size
that survives a Redis restart, and the heartbeat keys repaired like the limit keys."""

from __future__ import annotations

import contextlib
import http.client
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from flask_distlimit.core.decision import Check
from flask_distlimit.errors import ConfigurationError
from flask_distlimit.resilience.guard import Guard
from flask_distlimit.resilience.instances import Instances, validate_instances
from flask_distlimit.storage.base import Storage
from flask_distlimit.storage.urls import from_url
from tests.faults import opened
from tests.guard_helpers import FakeClock, ScriptedStorage
from tests.servers import RedisProcess, free_port, gunicorn_command, start_redis

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("value", "expected"), [("auto", "auto"), (1, 1), (12, 12), (100_000, 100_000)]
)
def test_valid_settings(value: object, expected: object) -> None:
    assert validate_instances(value) == expected


# "4" and 100_001 are refused, as DISTLIMIT_INSTANCES is at init_app: one rule for both.
@pytest.mark.parametrize("value", [0, -1, True, "many", 1.5, None, "", "4", 100_001])
def test_invalid_settings_say_what_to_use(value: object) -> None:
    with pytest.raises(ConfigurationError, match=r"positive integer.*auto"):
        validate_instances(value)


def test_a_fixed_count_is_the_divisor_and_never_beats() -> None:
    instances = Instances(6)
    assert instances.divisor == 6
    assert not instances.due()


def test_ttl_must_outlive_the_interval() -> None:
    with pytest.raises(ConfigurationError, match="ttl"):
        Instances("auto", interval=5, ttl=5)


def test_auto_beats_at_most_once_per_interval() -> None:
    clock = FakeClock()
    storage = ScriptedStorage()
    instances = Instances("auto", interval=5, clock=clock)
    assert instances.due() and instances.divisor == 1 and instances.seen is None
    instances.beat(storage)
    assert storage.calls == 1 and instances.seen == 1
    instances.beat(storage)
    clock.advance(4.9)
    assert not instances.due()
    instances.beat(storage)
    assert storage.calls == 1
    clock.advance(0.1)
    assert instances.due()
    instances.beat(storage)
    assert storage.calls == 2


def test_only_one_thread_beats_when_due() -> None:
    storage = ScriptedStorage(delay=0.05)
    instances = Instances("auto")
    threads = [threading.Thread(target=instances.beat, args=(storage,)) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert storage.calls == 1


@pytest.mark.redis
def test_live_members_are_counted_and_expire_on_real_redis(redis_server: RedisProcess) -> None:
    storage = from_url(redis_server.url)
    client = redis_server.client()
    prefix = f"instances-{os.getpid()}"
    try:
        a = Instances("auto", key_prefix=prefix, interval=0.1, ttl=0.3)
        b = Instances("auto", key_prefix=prefix, interval=0.1, ttl=0.3)
        a.beat(storage)
        b.beat(storage)
        assert (a.seen, b.seen) == (1, 2)
        assert 0 < client.pttl(f"{prefix}:instances") <= 300
        time.sleep(0.35)  # b stops beating; its member expires
        a.beat(storage)
        assert a.seen == 1
        assert a.divisor == 1
    finally:
        client.delete(f"{prefix}:instances")
        client.close()
        storage.close()


def _get(port: int, path: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        return conn.getresponse().read().decode()
    finally:
        conn.close()


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.gunicorn
def test_each_gunicorn_worker_is_an_instance(redis_server: RedisProcess, tmp_path: Path) -> None:
    prefix = f"gunicorn-instances-{os.getpid()}"
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "DISTLIMIT_STORAGE_URL": redis_server.url,
        "INSTANCES_TEST_PREFIX": prefix,
    }
    cmd = gunicorn_command(
        "--preload",
        "--bind", f"127.0.0.1:{port}", "--workers", "3",
        "--worker-class", "gthread", "--threads", "2", "--graceful-timeout", "5",
        "--log-level", "warning", "tests.apps.instances_app:app",
    )  # fmt: skip
    log = tmp_path / "gunicorn.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    client = redis_server.client()
    try:
        pids: set[str] = set()
        deadline = time.monotonic() + 30
        while len(pids) < 3:  # until every worker has served (and beaten on) a request
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            with contextlib.suppress(OSError):
                pids.add(_get(port, "/"))
            time.sleep(0.01)
        members = {m.decode() for m in client.zrange(f"{prefix}:instances", 0, -1)}
        assert len(members) == 3
        assert {m.split(":")[1] for m in members} == pids  # hostname:pid:token, per worker
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        client.delete(f"{prefix}:instances")
        client.close()


# -- a fleet size that survives (issue 11) -------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "3", None, 100_001])
def test_invalid_minimums_say_what_to_use(value: object) -> None:
    with pytest.raises(
        ConfigurationError, match=r"DISTLIMIT_INSTANCES_MIN.*>= 1 and <= 100000 \(the smallest"
    ):
        Instances("auto", minimum=value)  # type: ignore[arg-type]


def test_a_process_that_never_reached_the_storage_divides_by_the_minimum() -> None:
    assert Instances("auto").divisor == 1
    assert Instances("auto", minimum=3).divisor == 3
    assert Instances(2, minimum=3).divisor == 3  # a floor under a fixed count too
    guard = Guard(ScriptedStorage("down"), policy="local", instances="auto", instances_min=3)
    key = [Check("ratelimit:{c}:r:fixed_window", "fixed_window", 30, 60)]
    admitted = [guard.evaluate(key).evaluation.allowed for _ in range(12)]  # type: ignore[union-attr]
    assert admitted == [True] * 10 + [False] * 2


@pytest.fixture
def own_server() -> Iterator[RedisProcess]:
    """A redis-server of this test's own: it is restarted and stopped."""
    server = start_redis()
    yield server
    server.stop()


@pytest.mark.redis
def test_an_outage_after_a_redis_restart_divides_by_the_fleet_it_knew(
    own_server: RedisProcess,
) -> None:
    """Issue 11: after a restart the first process to beat learned 1, the next 2, and an outage
    then divided by 1, 2 and 3: 30 + 15 + 10 = 55 admitted against 30."""
    clock = FakeClock()
    guards = []
    for _ in range(3):
        storage = from_url(own_server.url, timeout=1)
        opened(storage)
        guards.append(Guard(storage, policy="local", instances="auto", clock=clock))
    probe = [Check("ratelimit:{probe}:r:fixed_window", "fixed_window", 10**9, 60)]

    def every_process_serves_a_request() -> None:  # each beats: one is due every 5 s
        for guard in guards:
            assert not guard.evaluate(probe).degraded
        clock.advance(5)

    every_process_serves_a_request()
    every_process_serves_a_request()
    assert [g.instances.divisor for g in guards] == [3, 3, 3]
    own_server.restart()  # empty: every heartbeat is gone
    every_process_serves_a_request()
    assert [g.instances.seen for g in guards] == [1, 2, 3]  # live, as each beat found them
    assert [g.instances.divisor for g in guards] == [3, 3, 3]  # was [1, 2, 3]
    own_server.stop()  # the outage
    key = [Check("ratelimit:{client}:r:fixed_window", "fixed_window", 30, 60)]
    admitted = [
        sum(bool(g.evaluate(key).evaluation.allowed) for _ in range(30))  # type: ignore[union-attr]
        for g in guards
    ]
    assert admitted == [10, 10, 10]  # was [30, 15, 10]


def _storage(server: RedisProcess) -> Storage:
    storage = from_url(server.url, timeout=1)
    opened(storage)
    return storage


@pytest.mark.redis
def test_a_process_that_knows_nothing_learns_the_fleet_after_the_heartbeats_expired(
    redis_server: RedisProcess, redis_client: redis.Redis
) -> None:
    """An outage longer than the TTL, or a restart, empties the live set; the first process to
    beat reports the fleet it knew, and a process that knew nothing learns it from Redis."""
    clock = FakeClock()
    storage = _storage(redis_server)
    fleet = [Instances("auto", clock=clock) for _ in range(3)]
    for _ in range(2):
        for instances in fleet:
            instances.beat(storage)
        clock.advance(5)
    redis_client.delete("ratelimit:instances", "ratelimit:instances:peak:{ratelimit:instances}")
    fleet[0].beat(storage)
    assert (fleet[0].seen, fleet[0].divisor) == (1, 3)
    newcomer = Instances("auto", clock=clock)  # e.g. a worker gunicorn just started
    newcomer.beat(storage)
    assert (newcomer.seen, newcomer.divisor) == (2, 3)  # was (2, 2)


@pytest.mark.redis
def test_the_divisor_follows_a_fleet_that_shrank(
    redis_server: RedisProcess, redis_client: redis.Redis
) -> None:
    """A process reports only the live counts it saw itself, never the sizes Redis told it, so
    a size nobody sees any more stops being reported and expires: no loop keeps it alive."""
    clock = FakeClock()
    storage = _storage(redis_server)
    fleet = [Instances("auto", clock=clock) for _ in range(3)]
    for _ in range(2):
        for instances in fleet:
            instances.beat(storage)
        clock.advance(5)
    survivor, *gone = fleet
    assert survivor.divisor == 3
    # The two others stopped: their heartbeats expire (their expiry is moved into the past).
    redis_client.zadd("ratelimit:instances", {i.member: 1 for i in gone}, xx=True)
    divisors = []
    for _ in range(3):
        survivor.beat(storage)
        divisors.append(survivor.divisor)
        clock.advance(5)
    assert survivor.seen == 1 and divisors == [3, 3, 3]  # it saw 3 within its last 3 beats
    peak = "ratelimit:instances:peak:{ratelimit:instances}"
    assert {m.decode() for m in redis_client.zrange(peak, 0, -1)} == {"1", "2", "3"}
    redis_client.zadd(peak, {"3": 1, "2": 1}, xx=True)  # one TTL after they were last reported
    for _ in range(3):
        survivor.beat(storage)
        clock.advance(5)
    assert survivor.divisor == 1


# -- the heartbeat key is repaired like the limit keys (issue 11) -------------------------------


@pytest.mark.redis
@pytest.mark.parametrize(
    "key", ["ratelimit:instances", "ratelimit:instances:peak:{ratelimit:instances}"]
)
def test_a_heartbeat_key_of_another_type_is_replaced_and_logged_once(
    redis_server: RedisProcess,
    redis_client: redis.Redis,
    caplog: pytest.LogCaptureFixture,
    key: str,
) -> None:
    redis_client.set(key, "something else's value", ex=600)
    clock = FakeClock()
    guard = Guard(_storage(redis_server), policy="local", instances="auto", clock=clock)
    probe = [Check("ratelimit:{probe}:r:fixed_window", "fixed_window", 100, 60)]
    with caplog.at_level(logging.INFO, logger="flask_distlimit"):
        for _ in range(3):  # three heartbeats
            assert not guard.evaluate(probe).degraded
            clock.advance(5)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and key in warnings[0] and "wrong type" in warnings[0]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no traceback
    assert guard.health()["instances_seen"] == 1
    assert redis_client.type("ratelimit:instances") == b"zset"
    assert redis_client.type("ratelimit:instances:peak:{ratelimit:instances}") == b"zset"


@pytest.mark.redis
@pytest.mark.parametrize("score", [float("inf"), 1e30])
def test_heartbeat_members_that_live_past_a_day_are_garbage(
    redis_server: RedisProcess, redis_client: redis.Redis, score: float
) -> None:
    """500 ghost instances (and a peak of 100000) scored to live for ever: each heartbeat
    refreshed the keys' TTL, so the fallback's divisor stayed at 100000 for as long as the fleet
    ran. Members that live past a day (every process beats every few seconds) are removed and
    the keys reported repaired."""
    redis_client.zadd("ratelimit:instances", {f"ghost{i}": score for i in range(500)})
    redis_client.zadd("ratelimit:instances:peak:{ratelimit:instances}", {"100000": score})
    guard = Guard(_storage(redis_server), policy="local", instances="auto", clock=FakeClock())
    guard.evaluate([Check("ratelimit:{probe}:r:fixed_window", "fixed_window", 100, 60)])
    assert guard.health()["instances_seen"] == 1 and guard.instances.divisor == 1
    assert redis_client.zcard("ratelimit:instances") == 1


@pytest.mark.parametrize("reply", ["{1, 2}", "{'a', 'b', 0, 0}"])
def test_a_heartbeat_reply_of_the_wrong_shape_is_counted_and_never_raised(
    redis_server: RedisProcess, monkeypatch: pytest.MonkeyPatch, reply: str
) -> None:
    """A heartbeat script answering a reply the limiter cannot read (here: another script on a
    real Redis) is an error reply as the other side calls' are: counted, the divisor and the
    breaker kept. It raised ValueError out of the request's guard (a 500)."""
    from flask_distlimit.storage import side_calls

    monkeypatch.setattr(side_calls, "HEARTBEAT_SOURCE", f"return {reply}")
    storage = from_url(redis_server.url)
    guard = Guard(storage, instances="auto", key_prefix=f"shape-{os.getpid()}", clock=FakeClock())
    try:
        outcome = guard.evaluate([Check(f"shape:{{{reply}}}:x:gcra", "gcra", 3, 60, 1)])
        assert outcome.evaluation is not None and outcome.evaluation.allowed
        assert guard.health()["unreadable_replies"] == 1
        assert guard.instances.divisor == 1
        assert guard.breaker.state == "closed" and guard.breaker.failures == 0
    finally:
        storage.close()
