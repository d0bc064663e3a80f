"""Redis under memory pressure: a refused write (OOM under ``maxmemory-policy noeviction``) is
its own case, :class:`StorageFull`, not an outage. The breaker of the node stays closed, and the
request is decided at this process's local share whatever the failure policy (``closed``: 503),
so a client that fills Redis with keys of its own choosing cannot switch the limiter off for the
others. Real redis-server processes with ``maxmemory`` set, started here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import cast

import pytest
import redis
from flask import Flask, request
from redis import exceptions as rx

from flask_distlimit import Limiter, StorageFull, StorageUnavailable
from flask_distlimit.core.decision import Check
from flask_distlimit.resilience.guard import Guard
from flask_distlimit.storage.cluster import ClusterStorage
from flask_distlimit.storage.redis import RedisStorage
from flask_distlimit.storage.translate import storage_error
from flask_distlimit.telemetry.metrics import Metrics
from flask_distlimit.testing import FakeClock
from tests.guard_helpers import Told
from tests.servers import ClusterServers, RedisProcess, start_redis

pytestmark = pytest.mark.redis

SECRET = "memory-test-secret-" + "x" * 20
NOW_US = 1_700_000_040_000_000


def fill(client: redis.Redis, prefix: str = "filler") -> int:
    """Fill the server with keys until it refuses a write; the number of keys written."""
    written = 0
    chunk = "v" * 1024
    while True:
        try:
            with client.pipeline(transaction=False) as pipe:
                for i in range(100):
                    pipe.set(f"{prefix}:{written + i}", chunk, ex=3600)
                pipe.execute()
        except rx.OutOfMemoryError:
            return written
        written += 100


@pytest.fixture
def full_redis() -> Iterator[RedisProcess]:
    """A redis-server of 4 MB under noeviction, filled up to its maxmemory."""
    server = start_redis("--maxmemory", "4mb", "--maxmemory-policy", "noeviction")
    client = server.client()
    try:
        fill(client)
        yield server
    finally:
        client.close()
        server.stop()


def test_a_refused_write_is_storage_full() -> None:
    """redis-py's OutOfMemoryError, a script error quoting the refusal, and MISCONF."""
    for exc in (
        rx.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
        rx.ResponseError(
            "OOM command not allowed when used memory > 'maxmemory'. script: ab, on @user_script:9."
        ),
        rx.ResponseError("MISCONF Redis is configured to save RDB snapshots, but it cannot"),
    ):
        translated = storage_error(exc)
        assert type(translated) is StorageFull, exc
        assert isinstance(translated, StorageUnavailable)
        assert "maxmemory" in str(translated)


def test_real_oom_raises_storage_full(full_redis: RedisProcess) -> None:
    storage = RedisStorage(host="127.0.0.1", port=full_redis.port, timeout=2.0)
    try:
        for algorithm in ("fixed_window", "sliding_window_counter", "token_bucket", "gcra"):
            check = Check(f"ratelimit:{{c}}:x:{algorithm}", algorithm, 3, 60, 1)  # type: ignore[arg-type]
            with pytest.raises(StorageFull, match="OOM command not allowed"):
                storage.evaluate([check])
    finally:
        storage.close()


def _app(server: RedisProcess, policy: str, clock: FakeClock) -> tuple[Flask, Limiter]:
    app = Flask("memory")
    app.config.update(
        SECRET_KEY=SECRET,
        DISTLIMIT_STORAGE_URL=server.url,
        DISTLIMIT_FAILURE_POLICY=policy,
        DISTLIMIT_TIERS={"anonymous": ""},
        DISTLIMIT_REDIS_TIMEOUT=2.0,
    )
    limiter = Limiter(app, clock=clock)

    @app.get("/login")
    @limiter.limit("3/minute")
    def login() -> str:
        return "ok"

    @app.get("/search")
    @limiter.limit("1000/minute", key_func=lambda: request.args["q"])
    def search() -> str:
        return "ok"

    return app, limiter


@pytest.mark.parametrize("policy", ["open", "local"])
def test_a_client_filling_redis_cannot_lift_another_clients_limit(policy: str) -> None:
    """The issue's reproduction: client-chosen key_func values fill Redis; another client's
    3/minute route was then admitted 5 of 5 times under policy open. Now: at most 3, and the
    breaker stays closed however many writes are refused."""
    server = start_redis("--maxmemory", "4mb", "--maxmemory-policy", "noeviction")
    clock = FakeClock(start=1_700_000_040.0)
    try:
        app, limiter = _app(server, policy, clock)
        client = app.test_client()
        guard = limiter.state(app).guard
        filler = server.client()
        written = fill(filler)
        filler.delete(*[f"filler:{i}" for i in range(written - 40, written + 100)])
        filler.close()  # the last ~40 KB are filled by the client-chosen keys
        sent = 0
        while not guard.fallback.holding:  # each value a key of its own, until Redis is full
            assert client.get(f"/search?q={sent}").status_code == 200
            sent += 1
            assert sent < 50_000, "Redis never filled up"
        for i in range(20):  # refused writes, many more than DISTLIMIT_BREAKER_FAIL_MAX
            assert client.get(f"/search?q=more-{i}").status_code == 200
        assert guard.breaker.state == "closed"
        codes = [client.get("/login").status_code for _ in range(5)]
        assert codes == [200, 200, 200, 429, 429]
        assert guard.breaker.state == "closed"
        assert guard.health()["breaker"] == "closed"
    finally:
        server.stop()


@pytest.mark.parametrize("policy", ["open", "local"])
def test_a_client_near_its_limit_when_redis_fills_gets_only_what_was_left(policy: str) -> None:
    """What Redis last said was left is where the local fallback starts, whatever the route's
    policy: under ``open`` it was never kept, so a client with one request left at 2 of 3 got
    a whole share again when Redis filled up (5 admitted in the window)."""
    server = start_redis("--maxmemory-policy", "noeviction")
    clock = FakeClock(start=1_700_000_040.0)
    try:
        app, limiter = _app(server, policy, clock)
        client = app.test_client()
        assert [client.get("/login").status_code for _ in range(2)] == [200, 200]
        admin = server.client()
        used = cast(dict[str, int], admin.info("memory"))["used_memory"]
        admin.config_set("maxmemory", used // 2)  # full: every write refused from now on
        admin.close()
        codes = [client.get("/login").status_code for _ in range(3)]
        assert codes == [200, 429, 429]  # old code under open: [200, 200, 200]
        assert limiter.state(app).guard.fallback.holding  # decided here: Redis refused writes
    finally:
        server.stop()


def test_policy_closed_answers_503_and_keeps_the_breaker_closed(full_redis: RedisProcess) -> None:
    clock = FakeClock(start=1_700_000_040.0)
    app, limiter = _app(full_redis, "closed", clock)
    client = app.test_client()
    codes = [client.get("/login").status_code for _ in range(10)]
    assert codes == [503] * 10
    assert limiter.state(app).guard.breaker.state == "closed"


def test_after_redis_has_room_open_keeps_the_local_share_for_the_window(
    full_redis: RedisProcess,
) -> None:
    """Under policy open, a client given its local share while Redis was full is not then
    given Redis's whole quota in the same window: Redis never counted those admissions."""
    clock = FakeClock(start=1_700_000_040.0)
    app, _ = _app(full_redis, "open", clock)
    client = app.test_client()
    assert [client.get("/login").status_code for _ in range(2)] == [200, 200]
    full_redis.client().flushall()  # room again
    codes = [client.get("/login").status_code for _ in range(4)]
    assert codes == [200, 429, 429, 429]
    clock.advance(180.0)  # the keys decided locally are handed back: open is open again
    assert [client.get("/login").status_code for _ in range(4)] == [200, 200, 200, 429]


def test_refused_writes_log_one_warning_a_minute(
    full_redis: RedisProcess, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock(start=1_700_000_040.0)
    storage = RedisStorage(host="127.0.0.1", port=full_redis.port, timeout=2.0)
    guard = Guard(storage, policy="open", clock=clock)
    check = [Check("ratelimit:{c}:x:fixed_window", "fixed_window", 3, 60, 1)]
    try:
        with caplog.at_level(logging.WARNING, logger="flask_distlimit.guard"):
            for _ in range(50):
                outcome = guard.evaluate(check)
                assert outcome.degraded and outcome.evaluation is not None
            clock.advance(61.0)
            guard.evaluate(check)
        lines = [r for r in caplog.records if "refuses writes" in r.getMessage()]
        assert len(lines) == 2
        assert guard.breaker.state == "closed" and guard.breaker.failures == 0
    finally:
        storage.close()


@pytest.mark.cluster
@pytest.mark.slow
def test_one_full_cluster_shard_is_decided_locally_and_the_others_by_redis(
    cluster_factory: Callable[..., ClusterServers],
) -> None:
    """On a Redis Cluster one full primary refuses its slot groups' writes: those checks are
    decided at the local share (policy open), the other shards' exactly, and no breaker opens.
    A refused write is an answer on the latency metric (outcome ``ok``), as on a single node;
    a call the storage answered tells its latency with its decisions, in one call."""
    cluster = cluster_factory(primaries=3, replicas=0)
    full = Check("ratelimit:{a}:r_x_3/60:fixed_window", "fixed_window", 3, 60, 1)
    other = next(
        Check(f"ratelimit:{{{t}}}:r_x_3/60:fixed_window", "fixed_window", 3, 60, 1)
        for t in "bcdefghijklmnop"
        if cluster.primary_for(f"ratelimit:{{{t}}}:x").port
        != cluster.primary_for("ratelimit:{a}:x").port
    )
    node = cluster.primary_for("ratelimit:{a}:x").client()
    node.config_set("maxmemory-policy", "noeviction")
    node.config_set("maxmemory", str(int(node.info("memory")["used_memory"]) + 200_000))
    fill(node, prefix="{a}")  # keys in the slot of the checks on {a}
    node.close()
    now = [1_000.0]
    storage = ClusterStorage(cluster.startup_nodes, timeout=2.0)
    guard = Guard(storage, policy="open", clock=lambda: now[0])
    told = Told()
    guard.add_sink(cast(Metrics, told))
    try:
        on_full = [guard.evaluate([full], now_us=NOW_US) for _ in range(6)]
        assert told.outcomes == ["ok"] * 6 and told.calls == ["storage_call"] * 6
        assert [o.evaluation.allowed for o in on_full if o.evaluation] == [True] * 3 + [False] * 3
        assert all(o.degraded for o in on_full)
        on_other = [guard.evaluate([other], now_us=NOW_US) for _ in range(4)]
        assert [o.degraded for o in on_other] == [False] * 4
        assert [o.evaluation.allowed for o in on_other if o.evaluation] == [True] * 3 + [False]
        assert told.outcomes[6:] == ["ok"] * 4 and told.calls[6:] == ["evaluated"] * 4
        assert all(b.state == "closed" and b.failures == 0 for b in guard.breakers.all())
    finally:
        storage.close()
