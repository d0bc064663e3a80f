"""The hot call's batches (flask_distlimit/storage/pipeline.py) on a real redis-server: many
calls in flight share a few connections, each reads its own reply, and a queued call's wait is
this process's load."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from flask_distlimit.core.decision import Check, Evaluation
from flask_distlimit.errors import StorageBusy
from flask_distlimit.storage.cluster import ClusterStorage
from flask_distlimit.storage.pipeline import Call, Pipeline
from flask_distlimit.storage.pool import DeadlinePool, NoConnectionAvailable
from flask_distlimit.storage.redis import RedisStorage
from tests.faults import DelayingProxy
from tests.servers import ClusterServers, RedisProcess

pytestmark = pytest.mark.redis


def _pack(*args: str) -> bytes:
    return b"".join(redis.Connection().pack_command(*args))


def _on_threads(threads: int, work: object) -> list[BaseException]:
    """Run ``work(i)`` on ``threads`` threads released at once; what they raised."""
    start = threading.Barrier(threads)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        start.wait()
        try:
            work(i)  # type: ignore[operator]
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return errors


@pytest.fixture
def storage(redis_server: RedisProcess, redis_client: redis.Redis) -> Iterator[RedisStorage]:
    made = RedisStorage(host="127.0.0.1", port=redis_server.port, timeout=5.0)
    yield made
    made.close()


def _newest_client_id(client: redis.Redis) -> int:
    """The id of the newest connection to the server: Redis numbers its connections in order,
    so the ones made after this call have larger ids."""
    return max(int(c["id"]) for c in client.client_list())


def _made_since(client: redis.Redis, newest: int) -> int:
    """Connections open now that were made after ``newest`` (a session's server also holds
    other tests' connections until they are collected)."""
    return sum(1 for c in client.client_list() if int(c["id"]) > newest)


def test_many_threads_share_few_connections_each_reading_its_own_reply(
    storage: RedisStorage, redis_client: redis.Redis
) -> None:
    threads, calls = 150, 4
    seen: dict[int, list[tuple[int, int]]] = {}

    def work(i: int) -> None:
        check = Check(f"t:{{client-{i}}}:route:fixed_window", "fixed_window", 10 + i, 3600)
        seen[i] = [
            (d.limit, d.remaining)
            for _ in range(calls)
            for d in storage.evaluate([check]).decisions
        ]

    newest = _newest_client_id(redis_client)
    assert _on_threads(threads, work) == []
    for i, decisions in seen.items():
        assert decisions == [(10 + i, 10 + i - n) for n in range(1, calls + 1)]
    # a pipeline's few connections, not one per call in flight (old code: up to 50)
    assert _made_since(redis_client, newest) <= storage.pipeline.width


def test_an_error_reply_in_a_batch_is_its_call_s_alone(
    redis_server: RedisProcess, redis_client: redis.Redis
) -> None:
    pool = DeadlinePool(timeout=5.0, max_connections=4, host="127.0.0.1", port=redis_server.port)
    pipeline = Pipeline(pool, load=lambda c: _pack("PING"), width=1)
    for i in range(0, 60, 3):
        redis_client.set(f"word-{i}", "not a number", ex=60)
    answers: dict[int, object] = {}

    def work(i: int) -> None:
        call = pipeline.call(_pack("INCR", f"word-{i}"), time.monotonic() + 5.0)
        answers[i] = call.error if call.error is not None else call.reply

    assert _on_threads(60, work) == []
    for i, answer in answers.items():
        if i % 3 == 0:
            assert isinstance(answer, redis.ResponseError)  # read whole, its own
        else:
            assert answer == 1
    pool.disconnect()
    redis_client.delete(*[f"word-{i}" for i in range(60)])


def test_a_call_queued_past_its_budget_leaves_the_queue_unsent(
    redis_server: RedisProcess, redis_client: redis.Redis
) -> None:
    proxy = DelayingProxy(redis_server.port, 0.0)
    storage = RedisStorage(host="127.0.0.1", port=proxy.port, timeout=2.0, queue_timeout=0.1)
    try:
        storage.pipeline.width = 1
        check = Check("t:{queued}:route:fixed_window", "fixed_window", 10, 3600)
        assert storage.evaluate([check]).allowed
        proxy.delay = 0.6  # the one batch in flight takes that long; the next call queues
        slow = threading.Thread(target=storage.evaluate, args=([check],))
        slow.start()
        time.sleep(0.1)  # the slow call leads its batch
        with pytest.raises(StorageBusy):
            storage.evaluate([check])
        slow.join()
        proxy.delay = 0.0
        # the busy call was never sent: two counted (the first and the slow one)
        assert storage.evaluate([check]).decisions[0].remaining == 7
    finally:
        storage.close()
        proxy.close()


def test_no_batch_taking_a_call_is_no_connection_available(
    redis_server: RedisProcess,
) -> None:
    pool = DeadlinePool(timeout=5.0, max_connections=1, host="127.0.0.1", port=redis_server.port)
    pipeline = Pipeline(pool, load=lambda c: _pack("PING"))
    held = pool.get_connection()  # the pipeline's leader finds no connection in time
    try:
        call = pipeline.call(_pack("PING"), time.monotonic() + 0.05)
        assert isinstance(call.error, NoConnectionAvailable)
    finally:
        pool.release(held)
    assert pipeline.call(_pack("PING"), time.monotonic() + 5.0).reply == b"PONG"
    pool.disconnect()


def _ran(client: redis.Redis, key: str, count: int) -> None:
    """Wait until Redis ran ``count`` INCRs of ``key`` (sent, whatever happens to the reply)."""
    deadline = time.monotonic() + 10
    while int(client.get(key) or 0) < count:
        assert time.monotonic() < deadline, "the call was never sent"
        time.sleep(0.005)


def test_a_call_queued_behind_a_late_batch_answers_by_its_own_deadline(
    redis_server: RedisProcess, redis_client: redis.Redis
) -> None:
    # One batch at a time; the first batch's reply is held, so it times out. The call queued
    # behind it asked while Redis was late: its batch reads until its own deadline (from its
    # ask), not a whole timeout after its send (old code: its send came a timeout after the
    # first batch's, and it could wait two timeouts in all).
    proxy = DelayingProxy(redis_server.port, 0.0)
    storage = RedisStorage(host="127.0.0.1", port=proxy.port, timeout=0.5, max_connections=1)
    pool, pipeline = storage.pool, storage.pipeline
    assert pool is not None
    pipeline.loaded = True  # these calls are INCRs
    key = f"late-{uuid.uuid4().hex}"
    try:
        assert pipeline.call(_pack("INCR", key), time.monotonic() + 5.0).reply == 1
        proxy.released.clear()  # Redis runs what it gets; no reply comes back
        calls: dict[str, object] = {}
        asked: dict[str, float] = {}

        def ask(name: str) -> None:
            asked[name] = time.monotonic()
            calls[name] = pipeline.call(_pack("INCR", key), asked[name] + 10.0)

        first = threading.Thread(target=ask, args=("first",))
        first.start()
        _ran(redis_client, key, 2)  # the first batch is in flight
        queued = threading.Thread(target=ask, args=("queued",))
        queued.start()
        first.join()
        queued.join()
        proxy.released.set()
        late = calls["queued"]
        assert isinstance(late, Call) and isinstance(late.error, redis.TimeoutError)
        assert late.deadline <= asked["queued"] + pool.timeout + pool.slack
    finally:
        proxy.released.set()
        storage.close()
        proxy.close()
        redis_client.delete(key)


class _LateSends(redis.Connection):
    """A connection whose thread is held up (the GIL, a busy process) before each send."""

    def send_packed_command(self, command: object, check_health: bool = True) -> None:
        time.sleep(0.4)
        super().send_packed_command(command, check_health)


def test_a_call_queued_behind_a_busy_process_keeps_a_whole_timeout(
    redis_server: RedisProcess, redis_client: redis.Redis
) -> None:
    # The batch ahead was slow to be sent (this process's load), not slow in Redis: the call
    # queued behind it waits longer than a timeout in all, yet is sent and answered.
    pool = DeadlinePool(
        timeout=0.3,
        max_connections=1,
        connection_class=_LateSends,
        host="127.0.0.1",
        port=redis_server.port,
    )
    pipeline = Pipeline(pool, load=lambda c: _pack("PING"))
    pipeline.loaded = True
    key = f"busy-{uuid.uuid4().hex}"
    try:
        answers: dict[int, object] = {}

        def work(i: int) -> None:
            call = pipeline.call(_pack("INCR", key), time.monotonic() + 10.0)
            answers[i] = call.error if call.error is not None else call.reply

        assert _on_threads(3, work) == []
        assert sorted(answers.values()) == [1, 2, 3]  # type: ignore[type-var]
    finally:
        pool.disconnect()
        redis_client.delete(key)


@pytest.mark.cluster
def test_cluster_one_group_calls_are_batched_per_primary_each_reading_its_own(
    redis_cluster: ClusterServers,
) -> None:
    storage = ClusterStorage(redis_cluster.startup_nodes, timeout=5.0)
    threads, calls = 120, 3
    seen: dict[int, list[tuple[int, int]]] = {}
    route = uuid.uuid4().hex

    def work(i: int) -> None:
        check = Check(f"t:{{c-{i}}}:{route}:fixed_window", "fixed_window", 10 + i, 3600)
        seen[i] = []
        for _ in range(calls):
            (result,) = storage.evaluate_parts([[check]])  # the guarded path
            assert isinstance(result, Evaluation), result
            seen[i] += [(d.limit, d.remaining) for d in result.decisions]

    newest: dict[str, int] = {}
    for host, port in redis_cluster.startup_nodes:
        with redis.Redis(host=host, port=port) as node:
            newest[f"{host}:{port}"] = _newest_client_id(node)
    try:
        assert _on_threads(threads, work) == []
        for i, decisions in seen.items():
            assert decisions == [(10 + i, 10 + i - n) for n in range(1, calls + 1)]
        # every primary's calls went in its pipeline: at most its width of connections made
        # for this test's calls (the session's cluster holds other tests' connections too)
        assert storage._pipelines
        for name, pipeline in storage._pipelines.items():
            host, port = name.rsplit(":", 1)
            with redis.Redis(host=host, port=int(port)) as node:
                clients = [
                    c
                    for c in node.client_list()
                    if c.get("cmd") == "evalsha" and int(c["id"]) > newest[name]
                ]
                assert len(clients) <= pipeline.width, name
    finally:
        storage.close()


class Interrupt(BaseException):
    """What a signal handler or a gevent-style timeout raises: not an ``Exception``."""


def test_a_leader_interrupted_after_its_send_leaves_its_followers_answered(
    redis_server: RedisProcess, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # width 1: the first batch is held up, the others queue; the second batch's leader is
    # interrupted after its send. Its followers are lost, each made again as a repeat on a
    # connection of its own: answered, and the next calls read their own replies.
    storage = RedisStorage(
        host="127.0.0.1", port=redis_server.port, timeout=5.0, request_tokens="always"
    )
    storage.pipeline.width = 1
    real = DeadlinePool.send
    sends = [0]
    interrupted: list[int] = []

    def send(self: DeadlinePool, connection: object, command: object) -> None:
        sends[0] += 1
        n = sends[0]
        if n == 1:
            time.sleep(0.3)  # the others queue behind this batch
        real(self, connection, command)
        if n == 2:
            interrupted.append(command[0].count(b"EVALSHA"))  # type: ignore[index]
            raise Interrupt

    monkeypatch.setattr(DeadlinePool, "send", send)
    checks = [Check(f"t:{{f-{i}}}:route:fixed_window", "fixed_window", 5, 3600) for i in range(30)]
    answered: dict[int, int] = {}

    def work(i: int) -> None:
        answered[i] = storage.evaluate([checks[i]]).decisions[0].remaining

    first = threading.Thread(target=work, args=(0,))
    first.start()  # leads the first batch, alone, held up in its send
    time.sleep(0.1)
    errors = _on_threads(29, lambda i: work(i + 1))  # queued: the second batch
    first.join()
    monkeypatch.undo()
    assert [type(e) for e in errors] == [Interrupt], (sends, interrupted)  # the leader's own
    assert interrupted and interrupted[0] > 1  # its batch had followers
    assert sorted(answered.values()) == [4] * 29  # each counted once ("always": a token)
    for i, check in enumerate(checks):
        remaining = storage.evaluate([check]).decisions[0].remaining
        assert remaining == (3 if i in answered else 4 - (redis_client.exists(check.key) > 0))
    storage.close()


class _InterruptedWake:
    """A follower's wake lock whose wait raises :class:`Interrupt`, as a signal handler's
    exception would: at once (``woken`` False: still queued), or once the wait ended (the lead
    handed to it meanwhile). ``waiting`` is set when the follower starts to wait."""

    woken = True
    waiting = threading.Event()

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held = False

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self.held:  # the call's own first acquire, as it queues
            self.held = True
            return self.lock.acquire()
        self.waiting.set()
        if self.woken:
            self.lock.acquire(blocking, timeout)
        raise Interrupt

    def release(self) -> None:
        self.lock.release()


@pytest.mark.parametrize("woken", [True, False], ids=["handed-the-lead", "queued"])
def test_a_follower_interrupted_while_it_waits_loses_no_connection(
    redis_server: RedisProcess, monkeypatch: pytest.MonkeyPatch, woken: bool
) -> None:
    # One connection, one batch at a time: the leader is held in its send until a second call
    # waits; that call is interrupted, still queued or once handed the lead (before it leads).
    # The connection must go back (a lost one would leave every later call waiting its whole
    # budget) and the queue be left empty.
    pool = DeadlinePool(timeout=5.0, max_connections=1, host="127.0.0.1", port=redis_server.port)
    pipeline = Pipeline(pool, load=lambda c: _pack("PING"), width=1)
    real = DeadlinePool.send
    sending, queued = threading.Event(), threading.Event()

    def send(self: DeadlinePool, connection: object, command: object) -> None:
        sending.set()  # the leader took its batch: the next call queues for the next one
        queued.wait(10)
        real(self, connection, command)

    monkeypatch.setattr(DeadlinePool, "send", send)
    leader = threading.Thread(target=pipeline.call, args=(_pack("PING"), time.monotonic() + 10))
    leader.start()
    assert sending.wait(10)
    # the wake locks of the calls made from now on (the pipeline's own lock is made already)
    wake = type("Wake", (_InterruptedWake,), {"woken": woken, "waiting": threading.Event()})
    monkeypatch.setattr(
        "flask_distlimit.storage.pipeline.threading", type("Threading", (), {"Lock": wake})
    )
    follower: list[BaseException] = []

    def follow() -> None:
        try:
            pipeline.call(_pack("PING"), time.monotonic() + 10)
        except BaseException as exc:
            follower.append(exc)

    waiting = threading.Thread(target=follow)
    waiting.start()
    assert wake.waiting.wait(10)  # the follower queued and waits
    queued.set()
    leader.join()
    waiting.join()
    monkeypatch.undo()
    assert [type(e) for e in follower] == [Interrupt]
    assert pipeline._leading == 0 and not pipeline._queue
    # the connection is the pool's again: the next call finds it at once
    assert pipeline.call(_pack("PING"), time.monotonic() + 0.5).reply == b"PONG"
    pool.disconnect()
