"""RedisStorage through Redis Sentinel (1 master, 1 replica, 3 Sentinels, quorum 2): it works,
after the master is killed and the Sentinels fail over it carries on through the new one, and
the hot call has the single node's deadline and safe retries (a killed connection is replaced,
READONLY from a demoted master sends the request once to the master named now)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import redis

from flask_distlimit.core.decision import Check
from flask_distlimit.errors import StorageBusy, StorageUnavailable
from flask_distlimit.storage import from_url
from flask_distlimit.storage.pool import DeadlinePool
from flask_distlimit.storage.redis import RedisStorage
from tests.conftest import assert_every_key_has_ttl
from tests.servers import SentinelServers, free_port

pytestmark = [pytest.mark.redis, pytest.mark.sentinel]

#: The instant the failover test decides at (us): the same before and after the failover.
NOW_US = 1_800_000_000_000_000
CHECKS = [
    Check("t:{alice}:ip:fixed_window", "fixed_window", 10, 600),
    Check("t:{alice}:burst:token_bucket", "token_bucket", 20, 600),
]


@pytest.fixture
def master_client(redis_sentinel: SentinelServers) -> Iterator[redis.Redis]:
    client = redis_sentinel.current_master().client()
    client.flushall()
    yield client
    assert_every_key_has_ttl(client)
    client.close()


@pytest.mark.slow
def test_evaluates_on_the_master_the_sentinels_name(
    redis_sentinel: SentinelServers, master_client: redis.Redis
) -> None:
    storage = from_url(redis_sentinel.url, timeout=0.5)
    assert isinstance(storage, RedisStorage)
    assert storage.scheme == "redis+sentinel"
    assert [storage.evaluate(CHECKS).allowed for _ in range(11)] == [True] * 10 + [False]
    stored = [k.decode() for k in master_client.keys("t:*") if not k.startswith(b"t:rq:")]
    assert sorted(stored) == sorted(c.key for c in CHECKS)
    assert storage.scripts_loaded()
    assert 0 < storage.ping() < 1
    storage.close()


def test_pool_blocks_for_at_most_the_queue_budget(
    redis_sentinel: SentinelServers, master_client: redis.Redis
) -> None:
    storage = from_url(redis_sentinel.url + "?max_connections=1", timeout=0.5)
    assert isinstance(storage, RedisStorage)
    pool = _hot(storage)
    assert pool.timeout == 0.5 and pool.max_connections == 1
    assert pool.queue_timeout == 5.0  # ten timeouts, at least 1 s
    pool.queue_timeout = 0.1
    assert storage.evaluate(CHECKS).allowed
    held = pool.get_connection()
    try:
        with pytest.raises(StorageBusy, match="queue budget"):  # load, not an outage
            storage.evaluate(CHECKS)
    finally:
        pool.release(held)
    assert storage.evaluate(CHECKS).allowed
    storage.close()


def test_no_sentinel_reachable_is_unavailable() -> None:
    storage = from_url(f"redis+sentinel://127.0.0.1:{free_port()}/mymaster", timeout=0.1)
    started = time.monotonic()
    with pytest.raises(StorageUnavailable, match="MasterNotFoundError"):
        storage.evaluate(CHECKS)
    assert time.monotonic() - started < 1.0


def wait_until_replica_caught_up(group: SentinelServers, timeout: float = 10.0) -> None:
    master, replica = group.master.client(), group.replica.client()
    try:
        offset = master.info("replication")["master_repl_offset"]
        deadline = time.monotonic() + timeout
        while replica.info("replication")["slave_repl_offset"] < offset:
            assert time.monotonic() < deadline, "the replica did not catch up"
            time.sleep(0.05)
    finally:
        master.close()
        replica.close()


@pytest.mark.slow
def test_failover_carries_on_through_the_new_master(
    sentinel_factory: Callable[..., SentinelServers],
) -> None:
    group = sentinel_factory()
    # One instant for every call: a failover takes seconds, and the fixed window's clock-aligned
    # 10 minutes could otherwise turn over between the counts before and after it.
    storage = from_url(group.url, timeout=0.2)
    for _ in range(3):
        assert storage.evaluate(CHECKS, now_us=NOW_US).allowed
    old = group.current_master()
    wait_until_replica_caught_up(group)

    old.stop()  # kill -9 the master
    with pytest.raises(StorageUnavailable):
        storage.evaluate(CHECKS, now_us=NOW_US)  # an outage, within the timeout, not a hang
    new = group.wait_for_failover(old)
    assert new is group.replica

    # The pool asks the Sentinels again on its next connection: the new master, same counters.
    evaluation = None
    for _ in range(20):
        try:
            evaluation = storage.evaluate(CHECKS, now_us=NOW_US)
            break
        except StorageUnavailable:
            time.sleep(0.1)
    assert evaluation is not None, "the storage never reached the new master"
    assert [d.remaining for d in evaluation.decisions] == [6, 16]
    assert storage.client.connection_pool.get_master_address() == ("127.0.0.1", new.port)
    storage.close()


def _hot(storage: RedisStorage) -> DeadlinePool:
    assert storage.pool is not None
    assert storage.pool.locate is not None  # asks the Sentinels before every connect
    return storage.pool


def test_a_killed_connection_is_replaced_through_the_sentinels(
    redis_sentinel: SentinelServers, master_client: redis.Redis
) -> None:
    storage = from_url(redis_sentinel.url, timeout=0.5)
    assert isinstance(storage, RedisStorage)
    pool = _hot(storage)
    asked: list[tuple[str, int]] = []
    locate = pool.locate
    assert locate is not None
    pool.locate = lambda: asked.append(locate()) or asked[-1]
    for _ in range(3):
        assert storage.evaluate(CHECKS).allowed
    assert len(asked) == 1  # one connection, one question
    master_client.client_kill_filter(_type="normal", skipme=True)
    time.sleep(0.05)
    assert storage.evaluate(CHECKS).allowed  # found closed at checkout: a new connection
    assert asked == [("127.0.0.1", redis_sentinel.current_master().port)] * 2
    storage.close()


def test_readonly_from_a_demoted_master_is_sent_once_to_the_master_named_now(
    redis_sentinel: SentinelServers, master_client: redis.Redis
) -> None:
    storage = from_url(redis_sentinel.url, timeout=0.5)
    assert isinstance(storage, RedisStorage)
    pool = _hot(storage)
    locate = pool.locate
    assert locate is not None
    master = redis_sentinel.current_master()
    replica = redis_sentinel.replica if master is redis_sentinel.master else redis_sentinel.master
    answers = [("127.0.0.1", replica.port)]  # the first connection lands on the replica
    pool.locate = lambda: answers.pop() if answers else locate()
    assert storage.evaluate(CHECKS).allowed  # READONLY there, then the master: one answer
    assert not answers
    assert int(master_client.hget(CHECKS[0].key, "n") or 0) == 1  # counted once
    storage.close()


def test_no_sentinel_answering_is_an_outage_however_late_the_call_came() -> None:
    # No Sentinel answers: the request fails as an outage, even when its queue budget is
    # spent (the question to the Sentinels is Redis's time, not this process's wait).
    storage = from_url(f"redis+sentinel://127.0.0.1:{free_port()}/mymaster", timeout=0.2)
    assert isinstance(storage, RedisStorage)
    pool = _hot(storage)
    with pytest.raises(redis.ConnectionError):
        pool.checkout(time.monotonic() - 0.001)
    with pytest.raises(StorageUnavailable):
        storage.evaluate(CHECKS)
    storage.close()


def test_after_readonly_every_request_reads_its_own_reply(
    redis_sentinel: SentinelServers, master_client: redis.Redis
) -> None:
    # the READONLY reply is read whole and its connection dropped with the pool's: with one
    # connection, the requests after it each read their own reply from the master
    storage = from_url(f"{redis_sentinel.url}?max_connections=1", timeout=0.5)
    assert isinstance(storage, RedisStorage)
    pool = _hot(storage)
    locate = pool.locate
    assert locate is not None
    master = redis_sentinel.current_master()
    replica = redis_sentinel.replica if master is redis_sentinel.master else redis_sentinel.master
    answers = [("127.0.0.1", replica.port)]
    pool.locate = lambda: answers.pop() if answers else locate()
    key = f"t:{{ro-{time.monotonic_ns()}}}:r:fixed_window"
    for limit in (7, 5, 3):  # each request its own limit: another's reply would show
        check = Check(f"{key}:{limit}", "fixed_window", limit, 60)
        decision = storage.evaluate([check]).decisions[0]
        assert (decision.limit, decision.remaining) == (limit, limit - 1)
    assert not answers
    storage.close()
