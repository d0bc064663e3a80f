"""RedisStorage on a real redis-server: one round trip per request whatever the number of
limits, scripts recovered after SCRIPT FLUSH and restarts, bounded waits without retries,
outages and answered errors kept apart, and no connection shared across fork."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import fakeredis
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st
from redis import exceptions as rx
from redis.sentinel import MasterNotFoundError

from flask_distlimit.core.decision import Check
from flask_distlimit.engine.scripts import with_token
from flask_distlimit.errors import (
    StorageBusy,
    StorageFull,
    StorageMisconfigured,
    StorageResponseError,
    StorageUnavailable,
)
from flask_distlimit.storage import from_url
from flask_distlimit.storage.evalsha import EvalshaPacker
from flask_distlimit.storage.heartbeat import Fleet
from flask_distlimit.storage.redis import RedisStorage
from flask_distlimit.storage.translate import storage_error
from tests.servers import RedisProcess, free_port, start_redis

pytestmark = pytest.mark.redis

ONE = [Check("t:{alice}:per-ip:fixed_window", "fixed_window", 5, 60)]
THREE = [
    Check("t:{alice}:per-ip:fixed_window", "fixed_window", 5, 60),
    Check("t:{alice}:burst:token_bucket", "token_bucket", 10, 10),
    Check("t:{acme}:tenant:sliding_window_log", "sliding_window_log", 100, 3600),
]


@pytest.fixture
def storage(redis_server: RedisProcess, redis_client: redis.Redis) -> Iterator[RedisStorage]:
    built = from_url(redis_server.url, timeout=0.5)
    assert isinstance(built, RedisStorage)
    yield built
    built.close()


@pytest.fixture
def own_server() -> Iterator[RedisProcess]:
    """A private redis-server this test may stop, kill or restart."""
    server = start_redis()
    try:
        yield server
    finally:
        server.stop()


class CountingConnection(redis.Connection):
    """A connection that counts what it sends: one packed send = one round trip."""

    sends = 0

    def send_packed_command(self, command: object, check_health: bool = True) -> None:
        type(self).sends += 1
        super().send_packed_command(command, check_health)


def _hot_address(storage: RedisStorage) -> str:
    pool = storage.pool
    assert pool is not None
    connection = pool.get_connection()
    try:
        connection.send_command("CLIENT", "INFO")
        info = connection.read_response()
    finally:
        pool.release(connection)
    text = info.decode() if isinstance(info, bytes) else str(info)
    return next(f[5:] for f in text.split() if f.startswith("addr="))


def top_level_commands(client: redis.Redis, source: str, run: Callable[[], None]) -> list[str]:
    """The commands the connection at address ``source`` sent while ``run()`` ran, as the
    server saw them (MONITOR); the commands scripts ran inside Redis are left out."""
    marker = f"end-of-run-{time.monotonic_ns()}"
    seen: list[str] = []
    with client.monitor() as monitor:
        run()
        client.echo(marker)
        while True:
            command = monitor.next_command()
            if marker in command["command"]:
                return seen
            address = f"{command.get('client_address')}:{command.get('client_port')}"
            if command["client_type"] != "lua" and address == source:
                seen.append(command["command"].split()[0].upper())


def hot_client_id(storage: RedisStorage) -> int:
    """CLIENT ID of the connection the hot path uses next (the pool hands out the last idle)."""
    pool = storage.pool
    assert pool is not None
    connection = pool.get_connection()
    try:
        connection.send_command("CLIENT", "ID")
        return int(connection.read_response())
    finally:
        pool.release(connection)


# -- the hot path --------------------------------------------------------------------------


@pytest.mark.parametrize("checks", [ONE, THREE], ids=["1 limit", "3 limits"])
def test_one_round_trip_per_evaluate(
    redis_server: RedisProcess, redis_client: redis.Redis, checks: list[Check]
) -> None:
    storage = RedisStorage(
        host="127.0.0.1", port=redis_server.port, connection_class=CountingConnection
    )
    storage.evaluate(checks)  # connects and loads the script
    source = _hot_address(storage)  # the one pooled connection
    answers: list[bool] = []

    def run() -> None:
        CountingConnection.sends = 0
        answers.extend(storage.evaluate(checks).allowed for _ in range(10))

    sent = top_level_commands(redis_client, source, run)
    assert answers == [True] * 4 + [False] * 6  # allowed or denied: one EVALSHA each
    assert CountingConnection.sends == 10  # the client sent 10 times ...
    assert sent == ["EVALSHA"] * 10  # ... and the server received 10 EVALSHA, nothing else
    storage.close()


def test_decisions_are_all_or_nothing(storage: RedisStorage) -> None:
    checks = [
        Check("t:{a}:one:fixed_window", "fixed_window", 5, 60),
        Check("t:{a}:two:fixed_window", "fixed_window", 2, 60),
    ]
    assert [storage.evaluate(checks).allowed for _ in range(3)] == [True, True, False]
    first, second = storage.evaluate(checks).decisions
    assert (first.allowed, first.remaining) == (True, 3)  # nothing consumed on the denial
    assert (second.allowed, second.remaining) == (False, 0)


def test_script_flush_is_recovered_without_an_error(
    storage: RedisStorage, redis_client: redis.Redis
) -> None:
    assert storage.evaluate(ONE).decisions[0].remaining == 4
    assert storage.scripts_loaded()
    redis_client.script_flush()
    assert not storage.scripts_loaded()
    assert storage.evaluate(ONE).decisions[0].remaining == 3
    assert storage.scripts_loaded()


def test_restart_is_recovered_without_an_error(own_server: RedisProcess) -> None:
    storage = from_url(own_server.url, timeout=0.5)
    assert storage.evaluate(ONE).decisions[0].remaining == 4
    own_server.restart()  # same port, empty, no scripts
    # The pooled connection is dead: the pool notices at checkout and reconnects; the script
    # is re-sent on NOSCRIPT. The quota starts again (the restarted Redis is empty).
    assert storage.evaluate(ONE).decisions[0].remaining == 4
    storage.close()


def test_works_on_a_ready_client_such_as_fakeredis() -> None:
    storage = RedisStorage(fakeredis.FakeRedis())
    assert [storage.evaluate(THREE).allowed for _ in range(6)] == [True] * 5 + [False]
    storage.close()


# -- outages: bounded, no retries -----------------------------------------------------------


def _attempts(retry: Any) -> int:
    """How many times redis-py's ``Retry`` tries a call that always fails (public API)."""
    calls: list[int] = []

    def fail() -> None:
        calls.append(1)
        raise rx.ConnectionError("down")

    with pytest.raises(rx.ConnectionError):
        retry.call_with_retry(fail, lambda error: None)
    return len(calls)


def test_client_settings_are_timeouts_without_retries(redis_server: RedisProcess) -> None:
    storage = from_url(redis_server.url, timeout=0.25)
    assert isinstance(storage, RedisStorage)
    admin = storage.client.connection_pool
    assert isinstance(admin, redis.BlockingConnectionPool)
    assert storage.pool is not None
    for pool in (admin, storage.pool):
        assert pool.timeout == 0.25  # the wait for a free connection
        kwargs = pool.connection_kwargs
        assert kwargs["socket_timeout"] == kwargs["socket_connect_timeout"] == 0.25
        assert kwargs["health_check_interval"] == 0
        assert _attempts(kwargs["retry"]) == 1
    if hasattr(admin, "maint_notifications_enabled"):  # redis-py 7+
        assert not admin.maint_notifications_enabled()  # no relaxed 10 s timeouts
    connection = storage.pool.get_connection()
    assert _attempts(connection.retry) == 1
    assert connection.socket_timeout == 0.25
    storage.pool.release(connection)
    storage.close()


def test_default_timeout_is_100_ms(redis_server: RedisProcess) -> None:
    storage = from_url(redis_server.url)
    assert isinstance(storage, RedisStorage)
    assert storage.pool is not None
    assert storage.pool.connection_kwargs["socket_timeout"] == 0.1
    storage.close()


def test_stalled_server_raises_unavailable_within_the_timeout(own_server: RedisProcess) -> None:
    storage = from_url(own_server.url, timeout=0.1)
    storage.evaluate(ONE)
    own_server.signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(StorageUnavailable, match="Timeout"):
            storage.evaluate(ONE)
        assert time.monotonic() - started < 1.0
    finally:
        own_server.signal(signal.SIGCONT)
    assert storage.evaluate(ONE).allowed  # and it comes back by itself
    storage.close()


class SilentServer:
    """A TCP listener that accepts connections and never answers (a hung Redis); counts them."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = int(self.sock.getsockname()[1])
        self.accepted: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed by close()
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self.sock.close()
        self.thread.join(timeout=5)
        for conn in self.accepted:
            conn.close()


def test_a_hung_server_costs_one_connection_attempt_not_retries() -> None:
    silent = SilentServer()
    try:
        storage = from_url(f"redis://127.0.0.1:{silent.port}", timeout=0.1)
        started = time.monotonic()
        for _ in range(3):
            with pytest.raises(StorageUnavailable):
                storage.evaluate(ONE)
        assert time.monotonic() - started < 3.0
        # One connection per failed call: redis-py made no retry of its own.
        assert len(silent.accepted) == 3
        storage.close()
    finally:
        silent.close()


def test_refused_connection_is_unavailable() -> None:
    storage = from_url(f"redis://127.0.0.1:{free_port()}", timeout=0.1)
    with pytest.raises(StorageUnavailable, match="ConnectionError"):
        storage.evaluate(ONE)
    with pytest.raises(StorageUnavailable):
        storage.ping()


def test_pool_wait_is_bounded_by_the_queue_budget_and_is_load(storage: RedisStorage) -> None:
    small = RedisStorage(
        host="127.0.0.1",
        port=storage.client.connection_pool.connection_kwargs["port"],
        timeout=0.1,
        max_connections=1,
        queue_timeout=0.1,
    )
    small.evaluate(ONE)
    assert small.pool is not None
    held = small.pool.get_connection()  # every connection busy
    try:
        # this process's load (StorageBusy), not an outage: nothing was sent, nothing armed
        with pytest.raises(StorageBusy, match="queue budget"):
            small.evaluate(ONE)
        assert not isinstance(StorageBusy("x"), StorageUnavailable)
        assert small.tokens.armed_until < time.monotonic()
    finally:
        small.pool.release(held)
    assert small.evaluate(ONE).allowed
    small.close()


def _small(storage: RedisStorage, max_connections: int = 1, timeout: float = 0.5) -> RedisStorage:
    return RedisStorage(
        host="127.0.0.1",
        port=storage.client.connection_pool.connection_kwargs["port"],
        timeout=timeout,
        max_connections=max_connections,
    )


def test_a_waiter_gets_the_connection_released_within_the_timeout(storage: RedisStorage) -> None:
    small = _small(storage, timeout=2.0)
    pool: Any = small.pool
    held = pool.get_connection()
    threading.Timer(0.1, pool.release, [held]).start()
    started = time.monotonic()
    assert small.evaluate(ONE).allowed  # waited for the release, not for the whole timeout
    assert 0.05 < time.monotonic() - started < 1.5
    small.close()


@pytest.mark.slow
def test_the_pool_never_exceeds_max_connections(storage: RedisStorage) -> None:
    small = _small(storage, max_connections=3, timeout=5.0)
    seen: list[int] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(50):
                small.evaluate(ONE)
            seen.append(len(small.pool._made))  # type: ignore[union-attr]
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert max(seen) <= 3
    small.close()


def test_a_connection_the_server_closed_while_idle_is_replaced_and_the_call_answered(
    storage: RedisStorage, redis_client: redis.Redis
) -> None:
    small = _small(storage)
    # a window of a year: no window boundary between the two calls (one a minute long was
    # straddled once under load: the second call then started a new window)
    one = [Check("t:{alice}:per-ip:fixed_window", "fixed_window", 5, 365 * 86400)]
    small.evaluate(one)
    first = hot_client_id(small)
    redis_client.client_kill_filter(_id=first)
    time.sleep(0.05)
    redis_client.config_resetstat()
    # Not probed at checkout: the send goes to the closed socket, the reply is lost, and the
    # call is made again, marked as a repeat, on a new connection: answered, counted once.
    second = small.evaluate(one)
    assert second.allowed and second.decisions[0].remaining == 3
    assert redis_client.hget(one[0].key, "n") == b"2"
    stats = redis_client.info("commandstats")
    assert stats["cmdstat_get"]["calls"] == 1  # the repeat asked for the kept reply
    assert hot_client_id(small) != first
    small.close()


def test_a_connection_released_with_unread_data_is_not_reused(storage: RedisStorage) -> None:
    small = _small(storage)
    pool: Any = small.pool
    connection = pool.get_connection()
    connection.send_command("CLIENT", "ID")
    before = connection.read_response()
    connection.send_command("ECHO", "left unread")
    time.sleep(0.05)
    pool.release(connection)
    # The next checkout sees the pending reply and reconnects instead of handing it on.
    again = pool.get_connection()
    again.send_command("CLIENT", "ID")
    reply = again.read_response()
    assert isinstance(reply, int)  # not the stale b"left unread"
    assert reply != before  # a new connection
    pool.release(again)
    small.close()


def test_a_connection_that_failed_is_disconnected(own_server: RedisProcess) -> None:
    small = from_url(own_server.url, timeout=0.2)
    assert isinstance(small, RedisStorage)
    small.evaluate(ONE)
    os.kill(own_server.pid, signal.SIGSTOP)
    try:
        with pytest.raises(StorageUnavailable):
            small.evaluate(ONE)
        pool: Any = small.pool
        assert pool._idle and not pool._live  # back in the pool, disconnected
    finally:
        os.kill(own_server.pid, signal.SIGCONT)
    assert small.evaluate(ONE).allowed
    small.close()


def test_close_disconnects_every_connection(
    storage: RedisStorage, redis_client: redis.Redis
) -> None:
    small = _small(storage, max_connections=2)
    pool: Any = small.pool
    a, b = pool.get_connection(), pool.get_connection()
    ids = []
    for connection in (a, b):
        connection.send_command("CLIENT", "ID")
        ids.append(connection.read_response())
    pool.release(a)
    pool.release(b)
    small.close()
    assert not pool._live
    deadline = time.monotonic() + 5
    while {c["id"] for c in redis_client.client_list()} & {str(i) for i in ids}:
        assert time.monotonic() < deadline, "the server still sees the closed connections"
        time.sleep(0.01)


# -- answered errors are not outages ----------------------------------------------------------


def test_script_error_is_a_response_error(storage: RedisStorage) -> None:
    bad = [Check("t:{a}:bad:fixed_window", "fixed_window", 0, 60)]  # limit 0: rejected by Lua
    with pytest.raises(StorageResponseError, match="bad arguments"):
        storage.evaluate(bad)


def test_the_shared_value_key_of_another_type_is_repaired(
    storage: RedisStorage, redis_client: redis.Redis
) -> None:
    redis_client.hset("t:shared", "field", "a hash, not a string")
    redis_client.expire("t:shared", 60)
    assert storage.shared_value("t:shared", "candidate", 60) == "candidate"
    assert redis_client.get("t:shared") == b"candidate"


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (rx.ConnectionError("refused"), StorageUnavailable),
        (rx.TimeoutError("timeout"), StorageUnavailable),
        (rx.BusyLoadingError("loading"), StorageUnavailable),
        (MasterNotFoundError("no master"), StorageUnavailable),
        (rx.ClusterDownError("down"), StorageUnavailable),
        (rx.MasterDownError("down"), StorageUnavailable),
        (rx.TryAgainError("again"), StorageUnavailable),
        (rx.SlotNotCoveredError("slot"), StorageUnavailable),
        (rx.RedisClusterException("no node"), StorageUnavailable),
        (rx.ReadOnlyError("replica"), StorageUnavailable),
        (rx.OutOfMemoryError("oom"), StorageFull),
        (rx.ResponseError("BUSY Redis is busy running a script"), StorageUnavailable),
        (rx.ResponseError("WRONGTYPE Operation against a key"), StorageResponseError),
        (rx.ResponseError("ERR Error running script"), StorageResponseError),
        (rx.NoScriptError("NOSCRIPT"), StorageResponseError),
        (rx.DataError("bad value"), StorageResponseError),
    ],
)
def test_error_mapping(error: Exception, expected: type[Exception]) -> None:
    translated = storage_error(error)
    assert type(translated) is expected
    assert str(error) in str(translated)


def _wrapped_by_the_cluster_client(cause: Exception) -> Exception:
    """What RedisCluster raises when its startup node refused
    (tests/storage/test_storage_refusals.py shows it on a real cluster): "cannot be connected",
    caused by "Cluster mode is not enabled on this node", itself raised while handling ``cause``."""
    inner = rx.RedisClusterException("Cluster mode is not enabled on this node")
    inner.__context__ = cause
    outer = rx.RedisClusterException("Redis Cluster cannot be connected.")
    outer.__cause__ = inner
    return outer


@pytest.mark.parametrize(
    ("error", "says"),
    [
        # As redis-py raises them (it strips the code it knows from the text) ...
        (rx.AuthenticationError("invalid username-password pair"), "credentials"),
        (rx.AuthenticationError("Invalid Username or Password"), "credentials"),
        (
            rx.AuthenticationWrongNumberOfArgsError("wrong number of arguments for 'auth'"),
            "credentials",
        ),
        (
            rx.NoPermissionError("this user has no permissions to run the 'evalsha' command"),
            "ACL SETUSER",
        ),
        (rx.ResponseError("DB index is out of range"), "database number"),
        (
            rx.ResponseError("unknown command 'EVALSHA', with args beginning with: 'k'"),
            "does not offer a command",
        ),
        (
            rx.ResponseError("Unknown Redis command called from script script: abc"),
            "does not offer a command",
        ),
        (
            rx.ResponseError("The user executing the script can't run this command or subcommand"),
            "ACL SETUSER",
        ),
        (rx.ResponseError("This instance has cluster support disabled"), "without cluster mode"),
        # ... and with the code still in the text (other clients, proxies, older servers).
        (rx.ResponseError("NOPERM this user has no permissions"), "ACL SETUSER"),
        (rx.ResponseError("WRONGPASS invalid username-password pair"), "credentials"),
        (rx.ResponseError("NOAUTH Authentication required."), "credentials"),
        (rx.ResponseError("ERR invalid password"), "credentials"),
        (rx.ResponseError("ERR DB index is out of range"), "database number"),
        (
            rx.ResponseError("ERR unknown command `EVALSHA`, with args beginning with: "),
            "does not offer a command",
        ),
        (
            MasterNotFoundError(
                "No master found for 'mymaster' : <Redis> - auth:AuthenticationError"
            ),
            "Sentinels refuse",
        ),
        (_wrapped_by_the_cluster_client(rx.NoPermissionError("no permissions")), "ACL SETUSER"),
        (
            _wrapped_by_the_cluster_client(
                rx.ResponseError("This instance has cluster support disabled")
            ),
            "without cluster mode",
        ),
    ],
)
def test_refusals_are_misconfigurations(error: Exception, says: str) -> None:
    translated = storage_error(error)
    assert isinstance(translated, StorageMisconfigured)
    assert isinstance(translated, StorageUnavailable)  # the breaker counts it
    assert says in str(translated)
    assert "with args" not in str(translated)


@pytest.mark.parametrize(
    "error",
    [
        MasterNotFoundError("No master found for 'mymaster'"),
        MasterNotFoundError("No master found for 'm' : <Redis> - network:ConnectionError"),
        rx.RedisClusterException("Redis Cluster cannot be connected."),
        _wrapped_by_the_cluster_client(rx.ResponseError("ERR something else")),
        rx.ResponseError("ERR Error running script (call to f_1): @user_script:1: oops"),
        rx.ResponseError("ERR unknown subcommand 'FOO'"),
    ],
)
def test_other_failures_are_not_misconfigurations(error: Exception) -> None:
    assert not isinstance(storage_error(error), StorageMisconfigured)


# -- the rest of the interface ----------------------------------------------------------------


def test_ping_scan_delete(
    storage: RedisStorage, redis_server: RedisProcess, redis_client: redis.Redis
) -> None:
    assert 0 < storage.ping() < 1
    storage.evaluate(THREE)
    assert sorted(storage.scan("t:{alice}:*")) == sorted(c.key for c in THREE[:2])
    assert storage.delete(c.key for c in THREE) == 3
    assert storage.delete([]) == 0
    # Nothing is left: a calm storage's call keeps no reply under a request token (tokens.py)
    assert list(storage.scan("t:*")) == []
    always = from_url(redis_server.url, timeout=0.5, request_tokens="always")
    try:
        always.evaluate(THREE)
        assert storage.delete(c.key for c in THREE) == 3
        # ... and "always"'s does, for a second at most
        (token,) = storage.scan("t:*")
        assert token.startswith("t:rq:{alice}:")
        assert 0 < redis_client.pttl(token) <= 1000
    finally:
        always.close()


def test_heartbeat_counts_live_members_on_server_time(
    storage: RedisStorage, redis_client: redis.Redis
) -> None:
    assert storage.heartbeat("t:instances", "a", 30) == 1
    assert storage.heartbeat("t:instances", "b", 0.05) == 2
    assert storage.heartbeat("t:instances", "a", 30) == 2  # refreshing does not double count
    time.sleep(0.1)
    assert storage.heartbeat("t:instances", "a", 30) == 1  # b expired
    assert 0 < redis_client.pttl("t:instances") <= 30_000


def test_heartbeat_keeps_the_fleet_sizes_reported_within_the_ttl(
    storage: RedisStorage, redis_client: redis.Redis
) -> None:
    peak = "t:instances:peak:{t:instances}"
    assert storage.heartbeat_fleet("t:instances", "a", 30, known=3) == Fleet(1, 3)
    assert storage.heartbeat_fleet("t:instances", "b", 30) == Fleet(2, 3)  # b knew nothing
    redis_client.delete("t:instances")  # what a restart or an expiry does to the live set
    assert storage.heartbeat_fleet("t:instances", "c", 30) == Fleet(1, 3)
    assert {m.decode() for m in redis_client.zrange(peak, 0, -1)} == {"1", "2", "3"}
    assert 0 < redis_client.pttl(peak) <= 30_000
    redis_client.zadd(peak, {"3": 1})  # its expiry passed (in the past, server time)
    assert storage.heartbeat_fleet("t:instances", "c", 30) == Fleet(1, 2)


@pytest.mark.parametrize(
    "garbage",
    [
        {"t:instances": "a string"},
        {"t:instances:peak:{t:instances}": "a string"},
        {"t:instances:peak:{t:instances}": {"lots": 9_999_999_999_999}},  # not a size
        {"t:instances:peak:{t:instances}": {"1000000": 9_999_999_999_999}},  # too large
        {"t:instances": "a string", "t:instances:peak:{t:instances}": "another"},
    ],
)
def test_heartbeat_replaces_garbage_and_says_so(
    storage: RedisStorage, redis_client: redis.Redis, garbage: dict[str, object]
) -> None:
    for key, value in garbage.items():
        if isinstance(value, dict):
            redis_client.zadd(key, value)
            redis_client.expire(key, 60)
        else:
            redis_client.set(key, str(value), ex=60)
    fleet = storage.heartbeat_fleet("t:instances", "a", 30, known=2)
    assert fleet == Fleet(1, 2, tuple(garbage))
    assert storage.heartbeat_fleet("t:instances", "a", 30, known=2) == Fleet(1, 2)  # repaired


# -- fork safety ------------------------------------------------------------------------------


@pytest.mark.parametrize("reset", [True, False], ids=["reset_after_fork", "pid check only"])
def test_fork_never_shares_a_connection(
    storage: RedisStorage, redis_client: redis.Redis, reset: bool
) -> None:
    assert storage.evaluate(ONE).decisions[0].remaining == 4
    parent_id = hot_client_id(storage)  # the pooled connection the parent uses
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its connection id and the decision, never return
        code = 1
        try:
            os.close(read_end)
            if reset:
                storage.reset_after_fork()
            remaining = storage.evaluate(ONE).decisions[0].remaining
            child_id = hot_client_id(storage)
            os.write(write_end, f"{child_id} {remaining}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        report = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0, "the child failed"
    child_id, child_remaining = map(int, report.split())
    assert child_id != parent_id
    assert child_remaining == 3
    # The parent's own connection survived the child's exit intact, and state is shared.
    assert storage.evaluate(ONE).decisions[0].remaining == 2
    assert hot_client_id(storage) == parent_id


@pytest.mark.parametrize("protocol", [2, 3])
def test_the_storage_it_builds_and_a_client_passed_in_agree_in_either_protocol(
    redis_server: RedisProcess, redis_client: redis.Redis, protocol: int
) -> None:
    check = [Check("t:{w}:either:fixed_window", "fixed_window", 3, 60)]
    built = RedisStorage(host="127.0.0.1", port=redis_server.port, protocol=protocol)
    given = RedisStorage(redis_server.client(protocol=protocol))
    assert built.pool is not None
    assert given.pool is None  # a client passed in keeps redis-py's Script
    # Both count on the same key: 3 allowed, then denied, whichever path asks.
    allowed = [s.evaluate(check).allowed for s in (built, given, built, given)]
    assert allowed == [True, True, True, False]
    built.close()
    given.client.close()


def test_refusals_as_redis_py_5_raises_them_are_misconfigurations() -> None:
    # redis-py before 8 keeps no status_code; before 6 a cluster client says only this.
    wrongpass = storage_error(rx.AuthenticationError("invalid username-password pair"))
    assert isinstance(wrongpass, StorageMisconfigured) and "WRONGPASS" in str(wrongpass)
    noauth = storage_error(rx.AuthenticationError("Authentication required."))
    assert "NOAUTH" in str(noauth)
    noperm = storage_error(rx.NoPermissionError("this user has no permissions"))
    assert "NOPERM" in str(noperm)
    bare = storage_error(rx.RedisClusterException("Cluster mode is not enabled on this node"))
    assert isinstance(bare, StorageMisconfigured) and "without cluster mode" in str(bare)


SHA = "e0e1f9fabfc9d4800c877a703b823ac0578ff8db"


@pytest.mark.parametrize(
    ("keys", "args"),
    [
        (["ratelimit:{abc}:route:orders"], ["-1,0,1,100,60000000,1"]),
        (["a", "b{x}", "c d\r\n"], ["1,2", 7]),
        (["clé:{é}:ünïcode"], ["-1,0"]),
        ([], ["x" * 10_000]),
        (["k"] * 120, ["-1,0," + ",".join(["1,5,60000000,1"] * 120)]),
    ],
)
def test_the_evalsha_bytes_are_what_redis_py_packs(keys: list[str], args: list[str | int]) -> None:
    connection = redis.Connection()
    expected = b"".join(connection.pack_command("EVALSHA", SHA, len(keys), *keys, *args))
    assert EvalshaPacker(SHA).pack(keys, args) == expected
    # with a request token: the bytes of the lists scripts.with_token builds
    token = "ratelimit:rq:{abc}:5f3a.12.7"
    for again in (False, True):
        k, a = with_token(keys, args, token, 1000, again=again)
        mark = "1000,1" if again else "1000"
        expected = b"".join(connection.pack_command("EVALSHA", SHA, len(k), *k, *a))
        assert EvalshaPacker(SHA).pack(keys, args, token, mark) == expected


def test_the_evalsha_bytes_follow_the_connection_encoding(redis_server: RedisProcess) -> None:
    connection = redis.Connection(encoding="latin-1")
    expected = b"".join(connection.pack_command("EVALSHA", SHA, 1, "clé", "1"))
    assert EvalshaPacker(SHA, encoding="latin-1").pack(["clé"], ["1"]) == expected
    with pytest.raises(UnicodeEncodeError):
        EvalshaPacker(SHA, encoding="ascii").pack(["clé"], ["1"])
    storage = RedisStorage(host="127.0.0.1", port=redis_server.port, encoding="latin-1")
    ours = b"".join(connection.pack_command("EVALSHA", storage._script.sha, 1, "clé", "1"))
    assert storage._packer.pack(["clé"], ["1"]) == ours  # the pool's own encoding
    storage.close()


#: encodings that write ASCII as itself (in any other, redis-py garbles the command's SHA too)
_ENCODINGS = st.sampled_from(["utf-8", "latin-1", "ascii", "cp1252", "shift_jis", "koi8-r"])
_ERRORS = st.sampled_from(["strict", "replace", "ignore", "surrogateescape", "backslashreplace"])
#: keys and arguments an app or an attacker could bring: any text (surrogates, CR LF, spaces,
#: braces, empty), long text, ASCII text (the one-string path), integers
_TEXT = st.one_of(
    st.text(),
    st.text(alphabet=st.characters(max_codepoint=127)),
    st.sampled_from(["", "\r\n", "a b", "{}", "{", "}{", "clé:{é}", "$3\r\nabc\r\n", "*1"]),
    st.text(alphabet="ab{}é\r\n ", min_size=5000, max_size=7000),  # past redis-py's buffer cutoff
)
_VALUES = st.lists(st.one_of(_TEXT, st.integers()), max_size=5)


def _packed_or_error(pack: Callable[[], Any]) -> Any:
    """The packed bytes, or the type of the encoding error raised."""
    try:
        packed = pack()
    except UnicodeError as exc:
        return type(exc)
    return b"".join(packed) if isinstance(packed, list) else packed


@settings(max_examples=100, deadline=None)
@given(
    keys=st.lists(_TEXT, max_size=4),
    args=_VALUES,
    token=st.one_of(st.none(), _TEXT),
    mark=st.sampled_from(["1000", "1000,1", ""]),
    encoding=_ENCODINGS,
    errors=_ERRORS,
)
@pytest.mark.slow
def test_the_evalsha_bytes_are_what_redis_py_packs_for_any_text_and_encoding(
    keys: list[str],
    args: list[str | int],
    token: str | None,
    mark: str,
    encoding: str,
    errors: str,
) -> None:
    connection = redis.Connection(encoding=encoding, encoding_errors=errors)
    k, a = (keys, args) if token is None else ([*keys, token], [*args, mark])
    expected = _packed_or_error(lambda: connection.pack_command("EVALSHA", SHA, len(k), *k, *a))
    packer = EvalshaPacker(SHA, encoding=encoding, errors=errors)
    assert _packed_or_error(lambda: packer.pack(keys, args, token, mark)) == expected


@pytest.mark.parametrize("encoding", ["utf-8", "latin-1"])
def test_keys_of_any_text_are_counted_under_their_exact_bytes(
    redis_server: RedisProcess, encoding: str
) -> None:
    storage = RedisStorage(host="127.0.0.1", port=redis_server.port, timeout=2, encoding=encoding)
    admin = redis_server.client()
    for key in ("clé:{é}:ünï", "a b\r\n$3\r\n{x}", "{", "}{", "{}", "k" * 20_000):
        for n in (1, 2):
            decision = storage.evaluate([Check(key, "fixed_window", 5, 60)]).decisions[0]
            assert (decision.limit, decision.remaining) == (5, 5 - n)
        assert admin.exists(key.encode(encoding)) == 1
        admin.delete(key.encode(encoding))
    admin.close()
    storage.close()
