"""The hot call's pool never probes a connection at checkout (``checkout(probe=False)``): it
relies on no connection ever going back to the pool with a reply unread, or the next request on
it would read another request's reply. These tests try to break that on real Redis and a real
Cluster: an exception that is not a Redis error (a signal handler's, a gevent-style timeout's,
``KeyboardInterrupt``) raised just after a send returned, before its reply is read, on the
first send, after ``NOSCRIPT``, and on a Cluster group; a read that raises something unexpected;
a command the packer refuses; many threads on few connections; the pool dropped by another
thread between a send and its read (Sentinel's READONLY); the PING of ``answers()``.

And the Cluster's own edges of the hot call: a request token always in its first key's slot
(keys without a hash tag, or odd ones), and slot groups that share a primary taking its
connections one at a time."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from flask_distlimit.core.decision import Check
from flask_distlimit.storage.cluster import ClusterStorage
from flask_distlimit.storage.pool import DeadlinePool
from flask_distlimit.storage.redis import RedisStorage
from flask_distlimit.storage.slot_keys import slot_of
from tests.servers import ClusterServers, RedisProcess, tags_on_distinct_primaries

pytestmark = pytest.mark.redis


class Interrupt(BaseException):
    """What a signal handler or a gevent-style timeout raises: not an ``Exception``."""


def _check(tag: str, limit: int, route: str = "") -> Check:
    """A check of client ``tag`` on a route of its own (a fresh count) unless ``route``."""
    route = route or uuid.uuid4().hex
    return Check(f"ratelimit:{{{tag}}}:{route}:{limit}/60:fixed_window", "fixed_window", limit, 60)


def interrupt_after_send(monkeypatch: pytest.MonkeyPatch, nth: int = 1) -> list[int]:
    """The ``nth`` send from now completes, then an :class:`Interrupt` is raised as the next
    Python line runs (where a pending signal's handler would run): the reply is left unread."""
    real = DeadlinePool.send
    sends = [0]

    def send(self: DeadlinePool, connection: Any, command: Any) -> None:
        real(self, connection, command)
        sends[0] += 1
        if sends[0] == nth:
            raise Interrupt

    monkeypatch.setattr(DeadlinePool, "send", send)
    return sends


@pytest.fixture
def storage(redis_server: RedisProcess) -> Iterator[RedisStorage]:
    # one connection: the next call gets the very connection the interrupted call used
    built = RedisStorage(host="127.0.0.1", port=redis_server.port, timeout=2, max_connections=1)
    yield built
    built.close()


def test_an_interrupt_between_send_and_read_never_leaves_a_reply_for_the_next_call(
    storage: RedisStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage.evaluate([_check("warm", 7)])  # the connection is made and idle in the pool
    with monkeypatch.context() as patch:
        interrupt_after_send(patch)
        with pytest.raises(Interrupt):
            storage.evaluate([_check("first", 10)])
    # the next request on the same (only) connection reads its own reply, not the first's
    decision = storage.evaluate([_check("second", 3)]).decisions[0]
    assert (decision.limit, decision.remaining) == (3, 2)


def test_an_interrupt_after_noscript_never_leaves_a_reply_for_the_next_call(
    storage: RedisStorage, redis_server: RedisProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage.evaluate([_check("warm", 7)])
    admin = redis_server.client()
    for nth in (2,):  # after the SCRIPT LOAD and the EVALSHA sent once more, in one write
        admin.script_flush()
        with monkeypatch.context() as patch:
            interrupt_after_send(patch, nth)
            with pytest.raises(Interrupt):
                storage.evaluate([_check(f"noscript-{nth}", 10)])
        decision = storage.evaluate([_check(f"after-{nth}", 3)]).decisions[0]
        assert (decision.limit, decision.remaining) == (3, 2)
    admin.close()


def test_a_command_the_connection_cannot_encode_is_an_error_of_that_call_only(
    redis_server: RedisProcess,
) -> None:
    storage = RedisStorage(
        host="127.0.0.1", port=redis_server.port, timeout=2, max_connections=1, encoding="ascii"
    )
    with pytest.raises(UnicodeEncodeError):  # as redis-py's own pack_command raises
        storage.evaluate([_check("clé", 10)])
    decision = storage.evaluate([_check("plain", 3)]).decisions[0]
    assert (decision.limit, decision.remaining) == (3, 2)
    storage.close()


def test_many_threads_on_few_connections_each_read_their_own_reply(
    storage: RedisStorage,
) -> None:
    errors: list[BaseException] = []

    def run(n: int) -> None:
        route = uuid.uuid4().hex
        try:
            for round_ in range(20):
                limit = 1000 + n  # each thread's own limit: a reply read by another shows
                decision = storage.evaluate([_check(f"t{n}", limit, route)]).decisions[0]
                assert (decision.limit, decision.remaining) == (limit, limit - round_ - 1)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


# -- Redis Cluster: several slot groups in flight at once ------------------------------------


@pytest.fixture
def cluster_storage(redis_cluster: ClusterServers) -> Iterator[ClusterStorage]:
    built = ClusterStorage(
        [("127.0.0.1", redis_cluster.nodes[0].port)], timeout=2, max_connections=1
    )
    yield built
    built.close()


def _groups(cluster: ClusterServers, limits: tuple[int, int]) -> list[Check]:
    first, second = tags_on_distinct_primaries(cluster, 2)
    return [_check(first, limits[0]), _check(second, limits[1])]


@pytest.mark.cluster
@pytest.mark.parametrize("nth", [1, 2])  # the first group's send, the second's
def test_cluster_an_interrupt_after_a_group_sent_leaves_no_reply_and_no_lost_connection(
    cluster_storage: ClusterStorage,
    redis_cluster: ClusterServers,
    monkeypatch: pytest.MonkeyPatch,
    nth: int,
) -> None:
    a, b = _groups(redis_cluster, (7, 8))
    cluster_storage.evaluate([a, b])  # each primary's one connection made, idle
    with monkeypatch.context() as patch:
        interrupt_after_send(patch, nth)
        with pytest.raises(Interrupt):
            cluster_storage.evaluate([replace_limit(a, 10), replace_limit(b, 11)])
    # each primary's only connection came back, with nothing unread on it
    decisions = cluster_storage.evaluate([replace_limit(a, 3), replace_limit(b, 4)]).decisions
    assert [(d.limit, d.remaining) for d in decisions] == [(3, 2), (4, 3)]


@pytest.mark.cluster
def test_cluster_a_read_that_raises_something_unexpected_loses_no_connection(
    cluster_storage: ClusterStorage, redis_cluster: ClusterServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = _groups(redis_cluster, (7, 8))
    cluster_storage.evaluate([a, b])
    real = DeadlinePool.read

    def read(self: DeadlinePool, connection: Any, deadline: float) -> Any:
        real(self, connection, deadline)
        raise Interrupt

    with monkeypatch.context() as patch:
        patch.setattr(DeadlinePool, "read", read)
        with pytest.raises(Interrupt):
            cluster_storage.evaluate([replace_limit(a, 10), replace_limit(b, 11)])
    decisions = cluster_storage.evaluate([replace_limit(a, 3), replace_limit(b, 4)]).decisions
    assert [(d.limit, d.remaining) for d in decisions] == [(3, 2), (4, 3)]


@pytest.mark.cluster
def test_cluster_a_command_the_connection_cannot_encode_loses_no_connection(
    redis_cluster: ClusterServers,
) -> None:
    storage = ClusterStorage(
        [("127.0.0.1", redis_cluster.nodes[0].port)],
        timeout=2,
        max_connections=1,
        encoding="ascii",
    )
    a, b = _groups(redis_cluster, (7, 8))
    storage.evaluate([a, b])
    bad = Check(f"{a.key}é", "fixed_window", 10, 60)  # same slot as a
    with pytest.raises(UnicodeEncodeError):  # as redis-py's own pack_command raises
        storage.evaluate([bad, replace_limit(b, 11)])
    decisions = storage.evaluate([replace_limit(a, 3), replace_limit(b, 4)]).decisions
    assert [(d.limit, d.remaining) for d in decisions] == [(3, 2), (4, 3)]
    storage.close()


def replace_limit(check: Check, limit: int) -> Check:
    """The same client's check under another limit (its own key: a fresh count)."""
    return _check(check.key.split("{")[1].split("}")[0], limit)


def test_every_connection_dropped_by_another_thread_between_send_and_read(
    storage: RedisStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On Sentinel, a READONLY reply makes one request drop every connection of the pool
    # (pool.disconnect()) while other threads' requests are between their send and read.
    storage.evaluate([_check("warm", 7)])
    real = DeadlinePool.send
    dropped = [False]

    def send(self: DeadlinePool, connection: Any, command: Any) -> None:
        real(self, connection, command)
        if not dropped[0]:
            dropped[0] = True
            self.disconnect()  # as another thread's failover handling would, right now

    with monkeypatch.context() as patch:
        patch.setattr(DeadlinePool, "send", send)
        decision = storage.evaluate([_check("dropped", 10)]).decisions[0]
    assert (decision.limit, decision.remaining) == (10, 9)  # made again on a fresh connection
    decision = storage.evaluate([_check("next", 3)]).decisions[0]
    assert (decision.limit, decision.remaining) == (3, 2)


# -- request tokens: always in the first key's Cluster slot ----------------------------------

#: first keys without a usable hash tag, or with an odd one: Redis hashes the whole key, or
#: what is between the first "{" and the first "}" after it
ODD_KEYS = (
    "plain",
    "ratelimit:instances",
    "a{}b",
    "{}",
    "a{b",
    "{",
    "}",
    "a}b",
    "}{",
    "a{}b}c",
    "x{{y}z",
    "x{y}{z}",
    "{}{y}",
    "p{x}:{y}:z",
    "",
    "a b\r\n{ü}",
)


@pytest.mark.slow
@pytest.mark.cluster
def test_cluster_groups_whose_keys_have_no_tag_or_an_odd_one_are_counted(
    redis_cluster: ClusterServers,
) -> None:
    storage = ClusterStorage([("127.0.0.1", redis_cluster.nodes[0].port)], timeout=2)
    route = uuid.uuid4().hex
    checks = [Check(f"{key}{route}", "fixed_window", 5, 60) for key in ODD_KEYS]
    assert len({slot_of(c.key) for c in checks}) > 1  # several groups in flight at once
    for n in (1, 2):
        decisions = storage.evaluate(checks).decisions
        assert [(d.limit, d.remaining) for d in decisions] == [(5, 5 - n)] * len(checks)
    storage.close()


def test_an_interrupt_between_the_ping_s_send_and_read_leaves_no_pong_for_the_next_call(
    storage: RedisStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the PING that tells a lost reply from an outage (pool.answers) shares the pool
    pool = storage.pool
    assert pool is not None
    storage.evaluate([_check("warm", 7)])
    with monkeypatch.context() as patch:
        interrupt_after_send(patch)
        with pytest.raises(Interrupt):
            pool.answers(time.monotonic() + 2)
    decision = storage.evaluate([_check("after-ping", 3)]).decisions[0]
    assert (decision.limit, decision.remaining) == (3, 2)


# -- Redis Cluster: several slot groups on one primary ---------------------------------------


def _tags_on_one_primary(cluster: ClusterServers, count: int) -> list[str]:
    """Hash tags of ``count`` different slots, all served by the first tag's primary."""
    first = "same-0"
    port = cluster.primary_for(f"{{{first}}}").port
    found = [first]
    for n in range(1, 1000):
        tag = f"same-{n}"
        if cluster.primary_for(f"{{{tag}}}").port == port:
            found.append(tag)
            if len(found) == count:
                return found
    raise AssertionError("no tags found on one primary")


@pytest.mark.cluster
def test_cluster_groups_on_one_primary_need_no_more_connections_than_one(
    redis_cluster: ClusterServers,
) -> None:
    # a request's slot groups that one primary serves take its pool's connections one at a
    # time: with max_connections=1 (a URL's ?max_connections=1) all are counted, none waits
    # for a connection the same request holds
    storage = ClusterStorage(
        [("127.0.0.1", redis_cluster.nodes[0].port)], timeout=2, max_connections=1
    )
    other = tags_on_distinct_primaries(redis_cluster, 3)
    tags = [*_tags_on_one_primary(redis_cluster, 3), *other]
    route = uuid.uuid4().hex
    checks = [_check(tag, 5 + n, route) for n, tag in enumerate(tags)]
    for round_ in (1, 2):
        decisions = storage.evaluate(checks).decisions
        assert [(d.limit, d.remaining) for d in decisions] == [
            (5 + n, 5 + n - round_) for n in range(len(tags))
        ]
    storage.close()


@pytest.mark.cluster
def test_cluster_threads_whose_groups_share_primaries_never_wait_on_each_other(
    redis_cluster: ClusterServers,
) -> None:
    # each thread holds at most one connection of a pool at a time, taken in one order: two
    # threads never hold one primary's connection each while waiting for the other's
    storage = ClusterStorage(
        [("127.0.0.1", redis_cluster.nodes[0].port)], timeout=2, max_connections=1
    )
    a, b = tags_on_distinct_primaries(redis_cluster, 2)
    errors: list[BaseException] = []

    def run(order: tuple[str, str]) -> None:
        route = uuid.uuid4().hex
        try:
            for round_ in range(1, 31):
                decisions = storage.evaluate([_check(t, 100, route) for t in order]).decisions
                assert [d.remaining for d in decisions] == [100 - round_] * 2
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(o,)) for o in ((a, b), (b, a)) * 2]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    storage.close()
