"""A reply lost to a closed connection is not an outage (issue 11, item 4; found by the fault
harness: a ``CLIENT KILL`` storm cut every connection in flight at once, the breaker counted each
as a consecutive failure and answered with the failure policy for a whole reset timeout while
Redis was healthy).

A request whose connection the server closes after the send may have run, so it is never sent
again (:mod:`flask_distlimit.storage.redis`); but when a fresh connection answers at once, the
storage raises :class:`~flask_distlimit.errors.StorageReplyLost`: the policy answers that one
request and the breaker is not told. On a real redis-server: ``CLIENT PAUSE WRITE`` holds the
script, ``CLIENT KILL`` closes its connection under it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import redis

from flask_distlimit.decision import Check
from flask_distlimit.errors import StorageReplyLost, StorageUnavailable
from flask_distlimit.guard import Guard
from flask_distlimit.storage.redis import RedisStorage
from tests.guard_helpers import FakeClock
from tests.servers import RedisProcess, start_redis

pytestmark = pytest.mark.redis

CHECK = Check("ratelimit:{lost}:r:10/60:fixed_window", "fixed_window", 10, 60)


@pytest.fixture
def storage(redis_server: RedisProcess, redis_client: redis.Redis) -> Iterator[RedisStorage]:
    made = RedisStorage(host="127.0.0.1", port=redis_server.port, timeout=3.0)
    made.evaluate([Check(CHECK.key, CHECK.algorithm, 10, 60, cost=0)])  # script loaded, pooled
    yield made
    made.close()


def _cut_under_the_request(admin: redis.Redis) -> threading.Thread:
    """Hold writes, then (once the request is waiting) close every other client's connection."""
    admin.execute_command("CLIENT", "PAUSE", 2000, "WRITE")

    def cut() -> None:
        for _ in range(200):  # until the script is held (it shows as a blocked client)
            if int(admin.info("clients").get("blocked_clients", 0)) or any(
                c.get("cmd") == "evalsha" for c in admin.client_list()
            ):
                break
            threading.Event().wait(0.01)
        admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        admin.execute_command("CLIENT", "UNPAUSE")

    thread = threading.Thread(target=cut)
    thread.start()
    return thread


def test_a_connection_closed_under_the_request_is_a_lost_reply(
    storage: RedisStorage, redis_client: redis.Redis
) -> None:
    thread = _cut_under_the_request(redis_client)
    try:
        with pytest.raises(StorageReplyLost, match="fresh one"):
            storage.evaluate([CHECK])
    finally:
        thread.join()
    assert storage.evaluate([CHECK]).allowed  # the next request: Redis decides again


def test_a_lost_reply_gets_the_policy_but_leaves_the_breaker_closed(
    storage: RedisStorage, redis_client: redis.Redis
) -> None:
    guard = Guard(storage, policy="closed", fail_max=1, reset_timeout=30.0, clock=FakeClock())
    thread = _cut_under_the_request(redis_client)
    try:
        lost = guard.evaluate([CHECK])
    finally:
        thread.join()
    assert lost.unavailable  # "closed": this one request cannot be decided
    assert guard.breaker.state == "closed"  # fail_max=1: a counted failure would have opened it
    decided = guard.evaluate([CHECK])
    assert decided.evaluation is not None and decided.evaluation.allowed
    assert not decided.degraded


def test_a_server_that_is_gone_is_still_an_outage() -> None:
    server = start_redis()
    storage = RedisStorage(host="127.0.0.1", port=server.port, timeout=1.0)
    try:
        storage.evaluate([CHECK])
        guard = Guard(storage, policy="closed", fail_max=1, reset_timeout=30.0, clock=FakeClock())
        server.stop()
        with pytest.raises(StorageUnavailable) as caught:
            storage.evaluate([CHECK])
        assert not isinstance(caught.value, StorageReplyLost)
        assert guard.evaluate([CHECK]).unavailable
        assert guard.breaker.state == "open"
    finally:
        storage.close()
        server.stop()
