"""Redis single node and Sentinel: one EVALSHA per request over a pooled, timeout-bound client.

The client is built for a rate limiter on the request path (:func:`connection_options`):

- connect and read timeouts = ``timeout`` (``DISTLIMIT_REDIS_TIMEOUT``, 100 ms by default), and a
  blocking pool that waits no longer than that for a free connection (for a single node our
  leaner :class:`~redis.BlockingConnectionPool` subclass, ``_LeanPool``; for Sentinel,
  redis-py's own). On a single node these waits share one budget per request: the pool wait,
  the connect and handshake, the send and the read all end by one deadline
  (:meth:`_LeanPool.checkout`); Sentinel bounds each of them by ``timeout`` separately;
- no automatic retries (redis-py 8 defaults to 5 s timeouts and 10 retries with backoff: a dead
  Redis would cost every request many seconds); the circuit breaker above decides what to do;
- no periodic health check PING on the hot path, no maintenance notifications (which would
  relax the read timeout to 10 s while a server announces maintenance).

redis-py pools check the process id and never hand a parent's connection to a forked child
(gunicorn forks workers after the app may have connected); :meth:`RedisStorage.reset_after_fork`
does the same explicitly and closes the inherited sockets without touching the parent's.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Final

import redis
from redis.backoff import NoBackoff
from redis.commands.core import Script
from redis.exceptions import NoScriptError
from redis.maint_notifications import MaintNotificationsConfig
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool

from ..decision import Check, Evaluation
from ..scripts import SCRIPT_SOURCE, parse_reply, script_args
from .base import Storage
from .heartbeat import HEARTBEAT_SOURCE, Fleet, fleet_from_reply, peak_key
from .shared_value import SHARED_VALUE_SOURCE
from .translate import REDIS_FAILURES, storage_error
from .wire import EvalshaPacker, read_bulk

__all__ = ["DEFAULT_TIMEOUT", "RedisStorage", "connection_options"]

#: Connect/read timeout and pool wait, seconds (``DISTLIMIT_REDIS_TIMEOUT``).
DEFAULT_TIMEOUT: Final = 0.1
#: Pool size per process: more than any gthread worker's threads.
DEFAULT_MAX_CONNECTIONS: Final = 50
_DELETE_CHUNK: Final = 500
#: What a checkout may spend before the socket's timeout is cut to the budget's rest, seconds.
_CUT_SLACK: Final = 0.001
_poll: Final = getattr(select, "poll", None)
_POLLIN: Final = getattr(select, "POLLIN", 1)


def connection_options(timeout: float) -> dict[str, Any]:
    """Keyword arguments of every connection we open (single node, Sentinel, Cluster nodes)."""
    return {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 0,
        # No CLIENT SETINFO round trips on every new connection (e.g. after a failover).
        "driver_info": None,
        # redis-py 8 would relax the read timeout to 10 s during announced server maintenance.
        "maint_notifications_config": MaintNotificationsConfig(enabled=False),
    }


class _LeanPool(redis.BlockingConnectionPool):
    """The pool of a single-node client we build: redis-py's guarantees, less of its per-call cost.

    ``BlockingConnectionPool`` spends about 9 us per checkout and release (idle machine): a
    ``LifoQueue`` (a lock, two conditions), a ``connect()`` through the retry helper even when
    connected, redis-py 8's observability counters (four calls per checkout), and ``can_read()``
    as its freshness check, several system calls on a socket with a timeout. Here:

    - idle connections on a ``deque`` under one ``Condition``; a new connection while fewer than
      ``max_connections`` exist; when all are busy, a wait of at most ``timeout`` and then
      ``ConnectionError("No connection available.")``, as redis-py;
    - freshness: one ``poll(0)`` system call on the socket: no event means ready; readable
      (unread bytes, or end of stream: the server closed it, e.g. a restart), hung up or in
      error means the connection is dropped and a new one opened, as redis-py does when
      ``can_read()`` is true. (A ``recv(MSG_PEEK)`` would wait for the socket timeout: Python
      polls first on a socket with a timeout; ``can_read()`` switches the timeout off and
      back, three system calls and more Python.) The
      parser's own buffer needs no look: ``read_response`` reads exactly one reply and
      disconnects on any exception, and nothing here uses pub/sub or RESP3 pushes. SSL sockets
      (which may hold decrypted bytes the socket does not show) and platforms without
      ``select.poll`` keep ``can_read()``;
    - fork safety: the pid is checked on every checkout and release; a child forgets every
      connection it inherited (``reset``) without closing the parent's sockets, and a
      connection made in another process is never put back;
    - a connection that failed is disconnected by redis-py (``read_response`` and
      ``send_packed_command`` do it on any exception) or by the caller, so it never returns
      with unread data; ``disconnect()`` closes all.

    Not for Sentinel, whose pool asks Sentinel for the master on every new connection; no
    client-side cache, no maintenance notifications (:func:`connection_options` turns them
    off), and redis-py's OpenTelemetry pool metrics do not see it.
    """

    def reset(self) -> None:
        self._ready = threading.Condition(threading.Lock())
        self._idle: deque[Any] = deque()
        self._connections: list[Any] = []
        self._waiting = 0  # threads in wait_for: release notifies only when there are some
        # Connections whose socket timeout is cut to a request's deadline (see checkout).
        self._cut: set[Any] = set()
        kwargs = self.connection_kwargs
        self._socket_timeout = kwargs.get("socket_timeout")
        self._connect_timeout = kwargs.get("socket_connect_timeout")
        # A checkout that leaves less than this of the budget cuts the socket's timeout: 1 ms of
        # our own work (a lock, a poll(0)) is not worth the 1.5 us of a cut and its restore.
        self._cut_below = (self._socket_timeout or self.timeout) - _CUT_SLACK
        self.pid = os.getpid()  # last, as in redis-py: other threads then see a reset pool

    def make_connection(self) -> Any:
        connection = self.connection_class(**self.connection_kwargs)
        self._connections.append(connection)
        return connection

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        return self.checkout(time.monotonic() + self.timeout)

    def checkout(self, deadline: float) -> Any:
        """A connection ready for a command, every wait on the way bounded by ``deadline``.

        ``deadline`` is a :func:`time.monotonic` time. The wait for a free connection, the
        connect and the handshake wait at most until then; so do the send and the read on the
        connection returned: when less than the whole timeout is left (this checkout waited,
        connected, or the thread was kept from running), its socket's timeout is cut to what is
        left, and :meth:`release` puts it back.
        """
        if self.pid != os.getpid():
            self._checkpid()
        with self._ready:
            if not self._idle and len(self._connections) >= self.max_connections:
                self._waiting += 1
                try:
                    self._ready.wait_for(self._can_take, deadline - time.monotonic())
                finally:
                    self._waiting -= 1
            if self._idle:
                connection = self._idle.pop()
            elif len(self._connections) < self.max_connections:
                connection = self.make_connection()
            else:
                raise redis.ConnectionError("No connection available.")
        try:
            if not connection.is_connected:
                self.renew(connection, deadline)
            elif not self._fresh(connection):
                connection.disconnect()
                self.renew(connection, deadline)
            else:
                left = deadline - time.monotonic()
                if left < self._cut_below:
                    self._cut_to(connection, left)
        except BaseException:
            self.release(connection)
            raise
        return connection

    def renew(self, connection: Any, deadline: float) -> None:
        """Connect a disconnected ``connection`` (and shake hands) by ``deadline``.

        The connect timeout and the socket timeout of the handshake's replies are what is left
        of the budget (redis-py's public ``socket_connect_timeout`` / ``socket_timeout``
        settings, put back right after); then the socket keeps what is left for the command.
        """
        left = deadline - time.monotonic()
        if left <= 0:
            raise redis.TimeoutError("DISTLIMIT_REDIS_TIMEOUT spent before connecting to Redis.")
        connection.socket_connect_timeout = left
        connection.socket_timeout = left
        try:
            connection.connect()
        finally:
            connection.socket_connect_timeout = self._connect_timeout
            connection.socket_timeout = self._socket_timeout
        self._cut_to(connection, deadline - time.monotonic())

    def bound(self, connection: Any, deadline: float) -> None:
        """Cut a checked-out ``connection``'s socket timeout to what is left until ``deadline``."""
        self._cut_to(connection, deadline - time.monotonic())

    def _cut_to(self, connection: Any, left: float) -> None:
        """Cut ``connection``'s socket timeout to ``left`` seconds until it is released."""
        if left <= 0:
            raise redis.TimeoutError("DISTLIMIT_REDIS_TIMEOUT spent before sending to Redis.")
        connection.update_current_socket_timeout(left)  # public: sets the socket's timeout
        self._cut.add(connection)

    def _can_take(self) -> bool:
        return bool(self._idle) or len(self._connections) < self.max_connections

    def _fresh(self, connection: Any) -> bool:
        """Nothing to read and not closed by the server: ready for a command."""
        sock = connection._sock
        if _poll is None or type(sock) is not socket.socket:
            try:
                return not connection.can_read()
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                return False
        poller = _poll()
        poller.register(sock, _POLLIN)
        return not poller.poll(0)  # readable, hung up or in error: not fresh

    def release(self, connection: Any) -> None:
        if self.pid != os.getpid():
            self._checkpid()
        if connection.pid != self.pid:  # inherited across a fork: never reuse it here
            connection.disconnect()  # closes this process's copy only (no shutdown)
            return
        if self._cut and connection in self._cut:
            self._cut.discard(connection)
            connection.update_current_socket_timeout(-1)  # back to its socket_timeout
        with self._ready:
            self._idle.append(connection)
            if self._waiting:
                self._ready.notify()

    def disconnect(self, inuse_connections: bool = True) -> None:
        if self.pid != os.getpid():
            self._checkpid()
        with self._ready:
            connections = list(self._connections if inuse_connections else self._idle)
        for connection in connections:
            connection.disconnect()

    def _get_free_connections(self) -> set[Any]:
        with self._ready:
            return set(self._idle)

    def _get_in_use_connections(self) -> set[Any]:
        with self._ready:
            return set(self._connections) - set(self._idle)


class _BlockingSentinelPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """A Sentinel-managed pool that blocks (at most ``timeout``) for a free connection."""


class RedisStorage(Storage):
    """Rate limits in one Redis (a single node, or the master a Sentinel names).

    Build it from a URL with :func:`flask_distlimit.storage.from_url`, or pass a ready client
    (e.g. ``RedisStorage(fakeredis.FakeRedis())`` in tests); a client passed in is used as is
    (its own timeouts and retries) and not closed by :meth:`close`.
    """

    scheme = "redis"
    #: The Sentinel manager when built by :meth:`sentinel` (its clients are closed with ours).
    _sentinel: Sentinel | None = None

    def __init__(
        self,
        client: redis.Redis | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        scheme: str = "redis",
        **connection: Any,
    ) -> None:
        """``connection`` holds redis-py connection keywords (``host``, ``port``, ``db``,
        ``password``, ``connection_class``, ...) used when no ``client`` is given."""
        if client is None:
            pool = _LeanPool(  # type: ignore[no-untyped-call]
                timeout=timeout,
                max_connections=max_connections,
                **{**connection, **connection_options(timeout)},
            )
            client = redis.Redis(connection_pool=pool)
            self._owns_client = True
        else:
            self._owns_client = False
        self.scheme = scheme
        self.timeout = timeout
        self.client: redis.Redis = client
        self._script: Script = client.register_script(SCRIPT_SOURCE)
        # The hot path calls EVALSHA itself, skipping Script.__call__'s wrapping; on a client we
        # built, straight on a pooled connection (see _execute_on_pool).
        self._execute: Callable[..., Any] = (
            self._execute_on_pool if self._owns_client else client.execute_command
        )
        self._heartbeat: Script = client.register_script(HEARTBEAT_SOURCE)
        self._shared_value: Script = client.register_script(SHARED_VALUE_SOURCE)
        # On the single-node pool we built, EVALSHA is packed and its reply read by hand
        # (storage/wire.py: about 8 us less per call).
        self._packer: EvalshaPacker | None = None
        if self._owns_client and type(client.connection_pool) is _LeanPool:
            kwargs = client.connection_pool.connection_kwargs
            self._packer = EvalshaPacker(
                self._script.sha,
                encoding=kwargs.get("encoding", "utf-8"),
                errors=kwargs.get("encoding_errors", "strict"),
            )

    @classmethod
    def sentinel(
        cls,
        sentinels: Sequence[tuple[str, int]],
        service_name: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        sentinel_options: dict[str, Any] | None = None,
        **connection: Any,
    ) -> RedisStorage:
        """The master of ``service_name`` as the Sentinels report it; follows failovers.

        Every new connection asks the Sentinels for the current master; after a failover the
        pool drops its idle connections to the old one.
        """
        options = connection_options(timeout)
        manager = Sentinel(  # type: ignore[no-untyped-call]
            list(sentinels),
            sentinel_kwargs={**options, **(sentinel_options or {})},
            **{**connection, **options},
        )
        client = manager.master_for(  # type: ignore[no-untyped-call]
            service_name,
            connection_pool_class=_BlockingSentinelPool,
            timeout=timeout,
            max_connections=max_connections,
        )
        storage = cls(client, timeout=timeout, scheme="redis+sentinel")
        storage._owns_client = True
        storage._execute = storage._execute_on_pool
        storage._sentinel = manager
        return storage

    # The hot path: one EVALSHA; on NOSCRIPT, redis-py's Script loads the source and retries.
    def evaluate(self, checks: Sequence[Check], *, now_us: int | None = None) -> Evaluation:
        keys, args = script_args(checks, now_us)
        try:
            try:
                packer = self._packer
                if packer is not None:
                    reply = self._evalsha_on_pool(packer, keys, args)
                else:
                    reply = self._execute("EVALSHA", self._script.sha, len(keys), *keys, *args)
            except NoScriptError:  # flushed, restarted, failed over: load it and run it again
                reply = self._script(keys, args)
        except REDIS_FAILURES as exc:
            raise storage_error(exc) from exc
        return parse_reply(reply, checks)

    def _evalsha_on_pool(
        self, packer: EvalshaPacker, keys: list[str], args: list[str | int]
    ) -> bytes | None:
        """EVALSHA on a pooled connection of our single-node pool, packed and read by hand.

        One deadline, ``DISTLIMIT_REDIS_TIMEOUT`` from now, bounds the pool wait, the connect and
        handshake, the send and the read (:meth:`_LeanPool.checkout`), and after ``NOSCRIPT``
        the ``SCRIPT LOAD`` and the second ``EVALSHA`` too. A pooled connection the
        server closed (``CLIENT KILL``, an idle timeout, a proxy reset) is replaced at checkout;
        a send that fails (the close went unseen until then) is made once more on a fresh
        connection within the same deadline. Nothing is retried once the send succeeded: the
        script may have run.

        Failures behave as in :meth:`_execute_on_pool`: a connection whose send or read failed is
        disconnected (by redis-py's ``send_packed_command`` or by :func:`read_bulk`), an error
        reply (``NOSCRIPT``, a script error) is raised as redis-py raises it, and every
        connection goes back to the pool.
        """
        deadline = time.monotonic() + self.timeout
        pool: Any = self.client.connection_pool  # a _LeanPool (see __init__)
        command = [packer.pack(keys, args)]
        connection: Any = pool.checkout(deadline)
        try:
            try:
                connection.send_packed_command(command, check_health=False)
            except redis.ConnectionError:
                # The send failed, so Redis never had the whole command: the script did not run.
                # Once more on a fresh connection (redis-py has closed this one), same deadline.
                pool.renew(connection, deadline)
                connection.send_packed_command(command, check_health=False)
            return read_bulk(connection)
        except NoScriptError:  # flushed, restarted: load it on this connection, run it again
            pool.bound(connection, deadline)
            connection.send_command("SCRIPT", "LOAD", self._script.script)
            connection.read_response()
            pool.bound(connection, deadline)
            connection.send_packed_command(command, check_health=False)
            return read_bulk(connection)
        finally:
            pool.release(connection)

    def _execute_on_pool(self, *args: Any) -> Any:
        """One command on a pooled connection of a client we built (about 10 us less per call).

        What redis-py's ``execute_command`` does for such a client, minus its per-call wrapping:
        a client we built makes no retries (:func:`connection_options`) and no single-connection
        or maintenance handling applies. As there, a connection that failed is dropped (redis-py
        already disconnects it on a socket error or timeout) and every connection goes back to
        the pool. (redis-py's optional OpenTelemetry metrics do not see these calls.)
        """
        pool = self.client.connection_pool
        connection: Any = pool.get_connection()
        try:
            connection.send_command(*args)
            return connection.read_response()
        except (redis.ConnectionError, redis.TimeoutError):
            connection.disconnect()
            raise
        finally:
            pool.release(connection)

    def ping(self) -> float:
        started = time.perf_counter()
        try:
            self.client.ping()
        except REDIS_FAILURES as exc:
            raise storage_error(exc) from exc
        return time.perf_counter() - started

    def scan(self, match: str) -> Iterator[str]:
        try:
            for key in self.client.scan_iter(match=match, count=1000):
                yield key.decode() if isinstance(key, bytes) else str(key)
        except REDIS_FAILURES as exc:
            raise storage_error(exc) from exc

    def delete(self, keys: Iterable[str]) -> int:
        batch = list(keys)
        deleted = 0
        try:
            for start in range(0, len(batch), _DELETE_CHUNK):
                deleted += int(self.client.delete(*batch[start : start + _DELETE_CHUNK]))
        except REDIS_FAILURES as exc:
            raise storage_error(exc) from exc
        return deleted

    def heartbeat(self, key: str, member: str, ttl: float) -> int:
        return self.heartbeat_fleet(key, member, ttl).live

    def heartbeat_fleet(self, key: str, member: str, ttl: float, known: int = 0) -> Fleet:
        try:
            reply = self._heartbeat(
                [key, peak_key(key)], [member, max(1, round(ttl * 1000)), max(0, int(known))]
            )
        except REDIS_FAILURES as exc:
            raise storage_error(exc) from exc
        return fleet_from_reply(reply, key)

    def shared_value(self, key: str, candidate: str, ttl: int) -> str:
        try:
            value = self._shared_value([key], [candidate, int(ttl)])
        except REDIS_FAILURES as exc:
            raise storage_error(exc) from exc
        return value.decode() if isinstance(value, bytes) else str(value)

    def scripts_loaded(self) -> bool:
        try:
            return bool(self.client.script_exists(self._script.sha)[0])
        except REDIS_FAILURES as exc:
            raise storage_error(exc) from exc

    def close(self) -> None:
        if self._owns_client:
            self.client.close()
            self.client.connection_pool.disconnect()
            if self._sentinel is not None:
                self._sentinel.close()

    def reset_after_fork(self) -> None:
        """Forget the connections inherited from the parent process.

        redis-py closes a parent's socket in a child without ``shutdown()``, so the parent's
        connection stays intact; the child opens its own on first use.
        """
        pools = [self.client.connection_pool]
        if self._sentinel is not None:
            pools += [s.connection_pool for s in self._sentinel.sentinels]
        for pool in pools:
            for conn in _pool_connections(pool):
                conn.disconnect()
            pool.reset()

    def node(self, refresh: bool = False) -> str:
        """Sentinel: the master's ``host:port`` as last discovered (``refresh``: ask the
        Sentinels now; a failure keeps the last one); ``"redis"`` before any, and always on a
        single node (one breaker per node: flask_distlimit/breakers.py)."""
        pool = self.client.connection_pool
        if self._sentinel is None or not isinstance(pool, SentinelConnectionPool):
            return super().node(refresh)
        address = pool.master_address
        if refresh:
            try:
                address = pool.get_master_address()  # type: ignore[no-untyped-call]
            except REDIS_FAILURES:  # no Sentinel answers: keep the last known master
                address = pool.master_address
        return super().node() if not address else f"{address[0]}:{address[1]}"


def _pool_connections(pool: redis.ConnectionPool) -> list[Any]:
    """Every connection a pool made (BlockingConnectionPool and ConnectionPool differ)."""
    made = list(getattr(pool, "_connections", ()))
    made += getattr(pool, "_available_connections", [])
    made += getattr(pool, "_idle", [])
    made += list(getattr(pool, "_in_use_connections", ()))
    return made
