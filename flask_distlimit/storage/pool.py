"""The hot path's connection pool: a queue budget and a Redis deadline, on redis-py's public API.

Promises: a wait for a pooled connection ends by the queue budget (then
:class:`NoConnectionAvailable`: nothing was sent, this process's load); a connect with its
handshake ends by a Redis timeout of its own, and a reply by the deadline the caller takes once the
command is sent (Redis's time); only a socket found empty ends a wait (a reply that came while this
process was busy is read); a connection is disconnected on any failure while in use; a forked child
starts empty and never puts back a connection made in another process. Not a redis-py pool: a
``redis.Redis`` client cannot use it. Design: docs/design-notes.md, "The connection pool".
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final

import redis

from flask_distlimit.errors import StorageBusy

#: How far a socket's own timeout may end from the deadline before a read waits explicitly, as
#: a share of the timeout (at least 1 ms): a read then ends at most this early or late.
_SLACK_SHARE: Final = 0.02
_MIN_SLACK: Final = 0.001
#: The least time a connect is given, seconds, however late this process got to it (a
#: loopback or LAN connect takes microseconds; a refused one fails at once).
LAST_LOOK: Final = 0.001


def cooperative() -> bool:
    """Are sockets gevent's or eventlet's (a monkey-patched ``socket.socket``)? Then every wait
    lets their event loop run."""
    return socket.socket.__module__ != "socket"


def queue_budget(timeout: float) -> float:
    """The default queue budget of a pool whose Redis timeout is ``timeout``: ten times it, and
    at least 1 s. A call queues that long only in a process far past its capacity."""
    return max(1.0, 10 * timeout)


class NoConnectionAvailable(redis.ConnectionError):
    """Every connection of the pool stayed busy until the queue budget was spent: the request
    met load, not a failed connection (nothing was sent, no reply was lost), so it arms no
    request token, says nothing of a Cluster's topology, and is
    :class:`~flask_distlimit.errors.StorageBusy` to the guard."""


def busy(queue_timeout: float) -> StorageBusy:
    """The error of a call that waited its whole queue budget, ``queue_timeout`` seconds."""
    return StorageBusy(
        f"every connection to Redis stayed busy for this call's queue budget "
        f"({queue_timeout:g} s): this process is overloaded; nothing was sent to Redis"
    )


class DeadlinePool:
    """A blocking pool of ``connection_class`` connections whose every wait ends by a deadline.

    ``connection_kwargs`` are the keywords of each connection (``host``, ``port``,
    ``socket_timeout``, ...); ``timeout`` is the Redis deadline of one call
    (``DISTLIMIT_REDIS_TIMEOUT``), ``queue_timeout`` its queue budget (module docstring;
    default :func:`queue_budget`).
    """

    def __init__(
        self,
        *,
        timeout: float,
        max_connections: int,
        connection_class: type[redis.Connection] | Any = redis.Connection,
        locate: Callable[[], tuple[str, int]] | None = None,
        queue_timeout: float | None = None,
        **connection_kwargs: Any,
    ) -> None:
        self.timeout = timeout
        self.queue_timeout = queue_budget(timeout) if queue_timeout is None else queue_timeout
        #: sockets are gevent's or eventlet's (a monkey-patched ``socket.socket``): every read
        #: waits explicitly (module docstring)
        self.cooperative = cooperative()
        self.max_connections = max_connections
        self.connection_class = connection_class
        self.connection_kwargs = connection_kwargs
        self.locate = locate
        #: the address ``locate`` answered last (Sentinel: the master), ``None`` before any
        self.located: tuple[str, int] | None = None
        self.slack = max(_MIN_SLACK, timeout * _SLACK_SHARE)
        self.reset()

    def reset(self) -> None:
        """Forget every connection (without closing any): a new, empty pool."""
        # the lock itself guards the usual checkout and release (cheaper than the Condition's
        # own methods); the Condition, on the same lock, for waiting
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._idle: deque[Any] = deque()
        self._made: set[Any] = set()
        self._waiting = 0  # threads waiting for a connection: release notifies only then
        #: connection -> its socket's timeout, seconds, for each connection connected here
        self._live: dict[Any, float] = {}
        self.pid = os.getpid()  # last: other threads then see a reset pool

    # -- checkout and release ----------------------------------------------------------------

    def get_connection(self) -> Any:
        """A connection ready for a command, waited for at most one queue budget from now."""
        return self.checkout(time.monotonic() + self.queue_timeout)

    def checkout(
        self,
        wait_until: float,
        *,
        probe: bool = True,
        connect: bool = True,
        connect_by: float | None = None,
    ) -> Any:
        """A connected connection (any, with ``connect=False``: the caller connects it).

        A wait for a connection ends by ``wait_until`` (the queue budget), then
        :class:`NoConnectionAvailable`; a connect ends by ``connect_by``, by default a whole
        Redis timeout of its own.
        ``probe``: an idle connection is first checked fresh (``can_read(0)``: nothing unread,
        not closed by the server) and replaced if not. A caller whose call survives a closed
        connection on its own (the hot call: a failed send is sent again, a lost reply is
        repeated under its request token) passes ``False`` and saves the check's three system
        calls and its Python (about 5 us per call).
        """
        if self.pid != os.getpid():
            self.forget_inherited()
        with self._lock:
            if not self._idle and len(self._made) >= self.max_connections:  # not _can_take()
                self._waiting += 1
                try:
                    self._ready.wait_for(self._can_take, wait_until - time.monotonic())
                finally:
                    self._waiting -= 1
            if self._idle:
                connection = self._idle.pop()
            elif len(self._made) < self.max_connections:
                connection = self.connection_class(**self.connection_kwargs)
                self._made.add(connection)
            else:
                raise NoConnectionAvailable("No connection available.")
        try:
            if connect:
                if probe and connection in self._live:
                    self._drop_if_stale(connection)
                if connection not in self._live:  # as ready() asks: no call on the hot path
                    self.ready(connection, connect_by)
        except BaseException:
            self.release(connection)
            raise
        return connection

    def ready(self, connection: Any, connect_by: float | None = None) -> None:
        """Connect ``connection``, held by the caller, unless it is connected: by ``connect_by``,
        by default a Redis timeout of its own."""
        if connection in self._live:
            return
        deadline = time.monotonic() + self.timeout if connect_by is None else connect_by
        try:
            self.renew(connection, deadline)
        except redis.ConnectionError:
            # Closed during the handshake (a CLIENT KILL, a proxy reset): no command was sent
            # yet, so once more within the same deadline.
            self.renew(connection, deadline)

    def release(self, connection: Any) -> None:
        """Give ``connection`` back (connected or not)."""
        if self.pid != os.getpid():
            self.forget_inherited()
        if connection not in self._made:  # made before a fork or a reset: never reused here
            connection.disconnect()
            return
        with self._lock:
            self._idle.append(connection)
            if self._waiting:
                self._ready.notify()

    def _can_take(self) -> bool:
        return bool(self._idle) or len(self._made) < self.max_connections

    def _drop_if_stale(self, connection: Any) -> None:
        """Forget that ``connection`` was connected unless it is ready for a command (nothing
        to read, not closed by the server)."""
        with contextlib.suppress(redis.ConnectionError, redis.TimeoutError, OSError):
            if not connection.can_read(0):
                return
        self.broken(connection)

    # -- connecting, reading, failing ----------------------------------------------------------

    def renew(self, connection: Any, deadline: float) -> None:
        """(Re)connect ``connection`` and shake hands by ``deadline``.

        With ``locate`` (Sentinel), the address is asked first (the Sentinels' own timeout is
        the Redis timeout). The connect gets what is left, and at least :data:`LAST_LOOK`:
        time this process lost before it (waiting for the CPU) is not Redis's.
        """
        self._live.pop(connection, None)
        connection.disconnect()  # redis-py's connect() keeps a socket it still has
        if self.locate is not None:
            self.located = connection.host, connection.port = self.locate()
        left = max(LAST_LOOK, deadline - time.monotonic())
        connection.socket_connect_timeout = left
        connection.socket_timeout = left  # the handshake's replies, and the socket after it
        try:
            connection.connect()
        except BaseException:
            connection.disconnect()
            raise
        finally:  # the connection's own timeouts again
            connection.socket_connect_timeout = self.connection_kwargs.get("socket_connect_timeout")
            connection.socket_timeout = self.connection_kwargs.get("socket_timeout")
        self._live[connection] = left

    def read(self, connection: Any, deadline: float) -> Any:
        """The reply to what was sent on ``connection``, by ``deadline``.

        Only a socket found empty times out: after a wait that ended (or with ``deadline``
        passed already, this process having come late), one more look that does not wait; a
        reply that arrived meanwhile is read. An error reply is raised as redis-py raises it,
        the connection staying usable; on any other failure it is disconnected (what is left in
        its socket is unknown).
        """
        try:
            left = deadline - time.monotonic()
            # the socket's timeout; None once :meth:`disconnect` forgot the connection (in use
            # by this thread meanwhile): its timeout is unknown
            live = self._live.get(connection)
            # When the socket's own timeout would end too early or too late, or an event
            # loop's timer may fire first: wait explicitly, then look once more.
            if (
                (self.cooperative or live is None or abs(live - left) > self.slack)
                and not connection.can_read(max(left, 0.0))
                and (left <= 0 or not connection.can_read(0))
            ):
                raise redis.TimeoutError("Timeout reading from Redis (DISTLIMIT_REDIS_TIMEOUT)")
            return connection.read_response()
        except redis.ResponseError:
            raise
        except BaseException:
            self.broken(connection)
            raise

    def answers(self, deadline: float) -> bool:
        """Does the server answer a ``PING`` on a fresh connection by ``deadline``? Asked after a
        connection was closed under a request, to tell a lost reply from an outage."""
        try:
            connection = self.checkout(deadline)
        except redis.RedisError:
            return False
        try:
            self.send(connection, connection.pack_command("PING"))
            # at least a moment for the answer, however late this process is
            last = max(deadline, time.monotonic() + LAST_LOOK)
            return self.read(connection, last) in (b"PONG", "PONG", True)
        except redis.RedisError:
            return False  # an error reply read whole, or a failure: send and read broke it
        except BaseException:  # e.g. a signal handler's, between the send and the read
            self.broken(connection)
            raise
        finally:
            self.release(connection)

    def send(self, connection: Any, command: Any) -> None:
        """Send a packed ``command``; redis-py disconnects the connection if that fails. Never
        refused for the time this process spent before it: a send hands bytes to the kernel
        (bounded by the socket's timeout when Redis reads nothing), and the Redis deadline of
        a call on a connected connection starts when it returns."""
        try:
            connection.send_packed_command(command, check_health=False)
        except BaseException:
            self.broken(connection)
            raise

    def broken(self, connection: Any) -> None:
        """Disconnect ``connection`` and forget it was connected (it reconnects at checkout)."""
        if self._live.pop(connection, None) is not None:
            connection.disconnect()

    def disconnect(self) -> None:
        """Disconnect every connection: each reconnects on its next checkout.

        An idle one is closed now; one in use by another thread (Sentinel: a ``READONLY``
        reply drops the pool while other requests are between their send and their read) is
        only forgotten, and closed when next checked out: closing a socket under a thread that
        reads it would raise there whatever redis-py's parser meets.
        """
        if self.pid != os.getpid():
            self.forget_inherited()
        with self._lock:  # the idle ones are taken out while they are closed
            idle = list(self._idle)
            self._idle.clear()
            self._live.clear()
        try:
            for connection in idle:
                connection.disconnect()
        finally:
            with self._lock:
                self._idle.extend(idle)
                if self._waiting:
                    self._ready.notify_all()

    def forget_inherited(self) -> None:
        """In a forked child: close this process's copies of the inherited sockets (redis-py
        does not shut a socket down from another process) and start empty."""
        made = list(self._made)
        self.reset()
        for connection in made:
            connection.disconnect()
