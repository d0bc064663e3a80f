"""DISTLIMIT_REDIS_TIMEOUT on the single-node storage (Redis's time, never this process's
waits), and its one safe retry.

The deadline tests put a proxy in front of a real redis-server that holds every reply for
``DELAY`` seconds: two waits of ``DELAY`` each fit in the timeout one by one but not together,
so a request that spends two of them on Redis's time (a reply, then the reply after
``NOSCRIPT``) must fail, and one that spends one in this process's own queue and one on Redis
must not. Delays only ever add up on a busy machine, so these outcomes do not depend on timing
being tight. The retry tests count what Redis ran.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from flask import Flask

from flask_distlimit import Limiter
from flask_distlimit.core.decision import Check
from flask_distlimit.engine.scripts import SCRIPT_SOURCE
from flask_distlimit.errors import StorageReplyLost, StorageUnavailable
from flask_distlimit.storage.pool import NoConnectionAvailable
from flask_distlimit.storage.redis import RedisStorage
from tests.faults import DelayingProxy
from tests.servers import RedisProcess

pytestmark = pytest.mark.redis

# a window of a year: the counts these tests read never straddle a window's boundary (a
# minute-long one was straddled once under load: a count read back as if nothing had run)
ONE = [Check("t:{alice}:per-ip:fixed_window", "fixed_window", 5, 365 * 86400)]
TIMEOUT = 0.5
DELAY = 0.3  # one delayed reply fits in TIMEOUT, two do not


@pytest.fixture
def proxy(redis_server: RedisProcess, redis_client: redis.Redis) -> Iterator[DelayingProxy]:
    redis_client.script_load(SCRIPT_SOURCE)  # no NOSCRIPT round trip in these tests
    delaying = DelayingProxy(redis_server.port, DELAY)
    yield delaying
    delaying.close()


def _through(proxy: DelayingProxy, **connection: Any) -> RedisStorage:
    return RedisStorage(host="127.0.0.1", port=proxy.port, timeout=TIMEOUT, **connection)


# -- Redis's time -------------------------------------------------------------------------------


def _connected(proxy: DelayingProxy, **connection: Any) -> RedisStorage:
    """A storage through ``proxy`` whose one connection is made while replies are not held."""
    delay, proxy.delay = proxy.delay, 0.0
    storage = _through(proxy, max_connections=1, **connection)
    assert storage.evaluate(ONE).allowed
    proxy.delay = delay
    return storage


def test_one_delayed_reply_fits_in_the_timeout(proxy: DelayingProxy) -> None:
    storage = _connected(proxy)
    assert storage.evaluate(ONE).allowed  # one wait of DELAY
    storage.close()


@pytest.mark.slow
def test_a_connect_and_the_reply_each_get_one_timeout(proxy: DelayingProxy) -> None:
    # A new connection waits for HELLO's reply (RESP3, redis-py 8's default), then EVALSHA's:
    # each within the timeout, together more. The time the connect took, like any wait before
    # the send, is not the reply's (flask_distlimit/storage/pool.py, "Two clocks").
    storage = _connected(proxy, protocol=3)
    assert storage.pool is not None
    storage.pool.disconnect()  # the next call connects again, through the delay
    assert storage.evaluate(ONE).allowed
    proxy.delay = TIMEOUT + 0.1  # a handshake slower than the timeout fails the call
    storage.pool.disconnect()
    with pytest.raises(StorageUnavailable, match="Timeout"):
        storage.evaluate(ONE)
    storage.close()


def test_the_pool_wait_is_not_redis_time(proxy: DelayingProxy) -> None:
    storage = _connected(proxy)
    pool: Any = storage.pool
    held = pool.get_connection()
    threading.Timer(DELAY, pool.release, [held]).start()
    # Waits DELAY for the connection (this process's load), then DELAY for the reply: more
    # than the timeout together, each less: answered (old code: a timeout, an outage).
    assert storage.evaluate(ONE).allowed
    storage.close()


def test_reloading_a_flushed_script_shares_the_deadline(
    proxy: DelayingProxy, redis_client: redis.Redis
) -> None:
    storage = _connected(proxy)
    redis_client.script_flush()
    # NOSCRIPT after DELAY, then SCRIPT LOAD's reply after DELAY more: past the deadline.
    with pytest.raises(StorageUnavailable, match="Timeout"):
        storage.evaluate(ONE)
    proxy.delay = 0.0
    redis_client.script_flush()
    assert storage.evaluate(ONE).allowed  # loaded and run again on the same connection
    assert redis_client.script_exists(storage._script.sha) == [True]
    storage.close()


def test_a_connection_made_late_in_a_budget_still_gets_a_whole_one_later(
    proxy: DelayingProxy,
) -> None:
    # Its socket was connected with little of a budget left: a later request must still wait
    # for its reply up to its own whole deadline, not up to that short socket timeout.
    delay, proxy.delay = proxy.delay, 0.0
    storage = _through(proxy, max_connections=1)
    assert storage.pool is not None
    connection = storage.pool.checkout(time.monotonic() + 0.05)
    storage.pool.release(connection)
    proxy.delay = delay  # < TIMEOUT, > 0.05
    assert storage.evaluate(ONE).allowed
    storage.close()


def test_a_spent_queue_budget_fails_only_a_wait_for_a_busy_pool(
    redis_server: RedisProcess, redis_client: redis.Redis
) -> None:
    storage = RedisStorage(host="127.0.0.1", port=redis_server.port, timeout=5.0, max_connections=1)
    pool: Any = storage.pool
    # a new connection is made however late: its connect has a timeout of its own
    connection = pool.checkout(time.monotonic() - 0.001)
    with pytest.raises(NoConnectionAvailable):  # every connection busy: no wait at all
        pool.checkout(time.monotonic() - 0.001)
    pool.send(connection, [b"*1\r\n$4\r\nPING\r\n"])
    assert pool.read(connection, time.monotonic() + 5.0) == b"PONG"
    pool.release(connection)
    storage.close()


def test_a_reply_that_came_while_this_process_was_late_is_read(
    redis_server: RedisProcess, redis_client: redis.Redis
) -> None:
    # The thread comes to the read after its deadline (it waited for the GIL, the event loop):
    # the reply is in the socket, so Redis answered in time.
    storage = RedisStorage(host="127.0.0.1", port=redis_server.port, timeout=0.05)
    pool: Any = storage.pool
    connection = pool.checkout(time.monotonic() + 5.0)
    pool.send(connection, [b"*1\r\n$4\r\nPING\r\n"])
    deadline = time.monotonic() + 0.05
    time.sleep(0.1)
    assert pool.read(connection, deadline) == b"PONG"  # old code: a timeout
    pool.release(connection)
    storage.close()


class _LateSends(redis.Connection):
    """A connection whose thread is held up (say, by the GIL) before each send."""

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        time.sleep(TIMEOUT * 1.5)
        super().send_packed_command(command, check_health)


def test_time_lost_before_the_send_is_not_redis_time(
    redis_server: RedisProcess, redis_client: redis.Redis
) -> None:
    storage = RedisStorage(
        host="127.0.0.1", port=redis_server.port, timeout=TIMEOUT, connection_class=_LateSends
    )
    assert storage.evaluate(ONE).allowed  # old code: spent before sending, an outage
    storage.close()


def test_a_stalled_server_costs_one_timeout(proxy: DelayingProxy) -> None:
    # The one wall-clock check, with generous slack: HELLO's reply never comes in time.
    proxy.delay = 10.0
    storage = _through(proxy)
    started = time.monotonic()
    with pytest.raises(StorageUnavailable):
        storage.evaluate(ONE)
    assert time.monotonic() - started < TIMEOUT * 2
    storage.close()


# -- one retry where it is safe ------------------------------------------------------------------


class _FailingSends(redis.Connection):
    """A connection whose next ``fail_sends`` sends fail before any byte leaves."""

    fail_sends = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if type(self).fail_sends:
            type(self).fail_sends -= 1
            self.disconnect()
            raise redis.ConnectionError("Error 32 while writing to socket. Broken pipe.")
        super().send_packed_command(command, check_health)


class _LostReplies(redis.Connection):
    """A connection that sends, then loses the reply (the server closed it after running)."""

    lose = False

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        super().send_packed_command(command, check_health)
        self.lose = b"EVALSHA" in b"".join(command)

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        if self.lose:
            time.sleep(0.05)  # the script has run
            self.disconnect()
            raise redis.ConnectionError("Connection closed by server.")
        return super().read_response(*args, **kwargs)


def _remaining(storage: RedisStorage) -> int:
    return storage.evaluate(ONE).decisions[0].remaining


def test_a_failed_send_is_made_once_more_on_a_fresh_connection(
    redis_server: RedisProcess, redis_client: redis.Redis
) -> None:
    class Once(_FailingSends):
        fail_sends = 0

    storage = RedisStorage(
        host="127.0.0.1", port=redis_server.port, timeout=TIMEOUT, connection_class=Once
    )
    assert _remaining(storage) == 4
    Once.fail_sends = 1
    assert _remaining(storage) == 3  # answered, and counted once
    Once.fail_sends = 2  # the retry fails too: an outage, not a second retry
    with pytest.raises(StorageUnavailable, match="Broken pipe"):
        storage.evaluate(ONE)
    assert Once.fail_sends == 0
    assert _remaining(storage) == 2  # the failed request ran nowhere
    storage.close()


@pytest.mark.parametrize(("tokens", "counted"), [("always", 1), ("auto", 2)])
def test_a_reply_lost_after_the_send_is_counted_as_the_tokens_promise(
    redis_server: RedisProcess, redis_client: redis.Redis, tokens: str, counted: int
) -> None:
    # Every EVALSHA's reply is lost, each repeat's too; a fresh connection answers PING: the
    # store is up. "always": the repeats answer the first try's kept reply, counted once;
    # "auto": a calm storage's first try carries no token, so its first repeat runs again
    # (storage/tokens.py), and the later ones answer that one's reply.
    lossy = RedisStorage(
        host="127.0.0.1",
        port=redis_server.port,
        timeout=TIMEOUT,
        connection_class=_LostReplies,
        request_tokens=tokens,
    )
    with pytest.raises(StorageReplyLost):
        lossy.evaluate(ONE)
    lossy.close()
    storage = RedisStorage(host="127.0.0.1", port=redis_server.port, timeout=TIMEOUT)
    assert _remaining(storage) == 5 - counted - 1
    storage.close()


class KillStorm:
    """A thread that runs ``CLIENT KILL TYPE normal`` every ``every`` seconds until stopped.

    With ``between_requests``, each kill waits for the request running (if any) to end, so it
    lands on an idle pooled connection (what an idle timeout or a proxy does between requests);
    without it, kills land wherever the requests are.
    """

    def __init__(self, client: redis.Redis, every: float, between_requests: bool) -> None:
        self.client = client
        self.every = every
        self.request = threading.Lock() if between_requests else contextlib.nullcontext()
        self.kills = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stopped.wait(self.every):
            with self.request:
                self.kills += self.client.client_kill_filter(_type="normal", skipme=True)

    def __enter__(self) -> KillStorm:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join()


def _storm_app(url: str) -> tuple[Flask, Limiter]:
    app = Flask("kill-storm")
    app.config.update(
        DISTLIMIT_STORAGE_URL=url,
        DISTLIMIT_REDIS_TIMEOUT=TIMEOUT,
        DISTLIMIT_FAILURE_POLICY="closed",
        DISTLIMIT_TIERS={"anonymous": ""},
    )
    limiter = Limiter(app)

    @app.get("/")
    @limiter.limit("1000000/hour", key_func=lambda: "storm")
    def index() -> str:
        return "ok"

    return app, limiter


@pytest.mark.slow
def test_a_client_kill_storm_between_requests_costs_no_answer_under_policy_closed(
    redis_server: RedisProcess, redis_client: redis.Redis
) -> None:
    app, _ = _storm_app(redis_server.url)
    state = Limiter.state(app)
    client = app.test_client()
    assert client.get("/").status_code == 200
    with KillStorm(redis_client, 0.02, between_requests=True) as storm:
        answered = 0
        while storm.kills < 40:  # every pooled connection killed every ~20 ms
            with storm.request:
                response = client.get("/")
            assert response.status_code == 200, response.get_data(as_text=True)
            answered += 1
    assert answered > 40
    assert state.guard.breaker.failures == 0  # no outage counted
    state.storage.close()


@pytest.mark.slow
@pytest.mark.parametrize("request_tokens", ["always", "auto"])
def test_a_client_kill_storm_anywhere_never_runs_a_request_twice(
    redis_server: RedisProcess, redis_client: redis.Redis, request_tokens: str
) -> None:
    # Kills that land while Redis holds a request may cost its answer (every repeat cut); what
    # Redis ran is never more than what was asked once each, but for "auto": the first cut of a
    # calm storage (its call carried no token) may count that one request twice, and arms the
    # tokens for the rest of the storm.
    storage = RedisStorage(
        host="127.0.0.1", port=redis_server.port, timeout=TIMEOUT, request_tokens=request_tokens
    )
    many = [Check("t:{storm}:any:fixed_window", "fixed_window", 10**9, 600)]
    answered = failed = 0
    with KillStorm(redis_client, 0.02, between_requests=False) as storm:
        while storm.kills < 40:
            try:
                storage.evaluate(many)
                answered += 1
            except StorageUnavailable:
                failed += 1
    ran = int(redis_client.hget("t:{storm}:any:fixed_window", "n") or 0)
    twice = 1 if request_tokens == "auto" else 0  # one thread: one call in flight at a time
    assert answered <= ran <= answered + failed + twice, (answered, failed, ran)
    storage.close()
