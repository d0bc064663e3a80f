"""Redis single node and Sentinel: one EVALSHA per request, batched with the requests in flight.

Promises: a call waits for a batch at most its queue budget, and for Redis at most
``DISTLIMIT_REDIS_TIMEOUT`` from the moment Redis has its command (docs/failure-modes.md); a call
left unsent by this process's own load is :class:`~flask_distlimit.errors.StorageBusy` (a 503,
never the failure policy); a reply lost after the send is made again once as a repeat of its
request token, never counted twice while tokens are on (:mod:`.tokens`); no connection goes back to
a pool with bytes unread; a forked child never uses its parent's connections. Admin commands go
through a stock ``redis.Redis`` client (:attr:`RedisStorage.client`). Design: docs/design-notes.md,
"The Redis storage".
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import redis
from redis.backoff import NoBackoff
from redis.commands.core import Script
from redis.exceptions import NoScriptError, ReadOnlyError
from redis.retry import Retry
from redis.sentinel import Sentinel

from flask_distlimit.core.decision import Check, Evaluation
from flask_distlimit.engine.scripts import SCRIPT_SOURCE, parse_reply, script_args
from flask_distlimit.errors import StorageError
from flask_distlimit.storage.evalsha import EvalshaPacker
from flask_distlimit.storage.pipeline import Call, Pipeline, script_load
from flask_distlimit.storage.pool import DeadlinePool, NoConnectionAvailable, busy
from flask_distlimit.storage.side_calls import RedisSideCalls, SideScripts
from flask_distlimit.storage.slot_keys import across_slots, by_slot
from flask_distlimit.storage.split_slots import outcome, send_parts
from flask_distlimit.storage.tokens import Made, RequestTokens, repeat_call
from flask_distlimit.storage.translate import REDIS_FAILURES, storage_error, translated

#: Connect/read timeout and pool wait, seconds (``DISTLIMIT_REDIS_TIMEOUT``).
DEFAULT_TIMEOUT: Final = 0.1
#: Pool size per process (the hot call's batches use a few: :mod:`.pipeline`).
DEFAULT_MAX_CONNECTIONS: Final = 50
#: Connection keywords our clients default to unless given: RESP2, so that a new connection
#: costs no ``HELLO`` round trip (redis-py 8 defaults to RESP3; none of our commands needs it,
#: and a connect that asks Redis nothing leaves a reply the whole timeout: :mod:`.pool`).
HANDSHAKE_FREE: Final[dict[str, Any]] = {"protocol": 2}
#: Every keyword a redis-py connection takes, along its classes (redis-py 5.x to 8.x differ).
_CONNECTION_PARAMETERS: Final = frozenset(
    name
    for cls in redis.Connection.__mro__
    if "__init__" in vars(cls)
    for name in inspect.signature(vars(cls)["__init__"]).parameters
)


def connection_options(timeout: float) -> dict[str, Any]:
    """Keyword arguments of every connection we open (single node, Sentinel, Cluster nodes).

    redis-py 5.x to 8.x: no ``CLIENT SETINFO`` round trips on a new connection (``lib_name`` /
    ``lib_version`` = ``None`` before 8.0, ``driver_info=None`` since), and from 7.0 no
    maintenance notifications.
    """
    options: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 0,
    }
    if "driver_info" in _CONNECTION_PARAMETERS:
        options["driver_info"] = None
    elif "lib_name" in _CONNECTION_PARAMETERS:
        options["lib_name"] = options["lib_version"] = None
    if "maint_notifications_config" in _CONNECTION_PARAMETERS:  # redis-py 7+
        notifications = importlib.import_module("redis.maint_notifications")
        options["maint_notifications_config"] = notifications.MaintNotificationsConfig(
            enabled=False
        )
    return options


class RedisStorage(RedisSideCalls):
    """Rate limits in one Redis (a single node, or the master a Sentinel names).

    Build it from a URL with :func:`flask_distlimit.storage.from_url`, or pass a ready client
    (e.g. ``RedisStorage(fakeredis.FakeRedis())`` in tests); a client passed in is used as is
    (its own timeouts and retries, redis-py's ``Script`` for every call) and not closed by
    :meth:`close`.
    """

    scheme = "redis"
    #: The Sentinel manager when built by :meth:`sentinel` (its clients are closed with ours).
    _sentinel: Sentinel | None = None
    #: The hot call's pool (see the module docstring); ``None`` on a client passed in.
    pool: DeadlinePool | None = None

    def __init__(
        self,
        client: redis.Redis | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        scheme: str = "redis",
        request_tokens: str = "auto",
        queue_timeout: float | None = None,
        split_slots: bool = False,
        **connection: Any,
    ) -> None:
        """``connection`` holds redis-py connection keywords (``host``, ``port``, ``db``,
        ``password``, ``connection_class``, ...) used when no ``client`` is given.
        ``request_tokens``: ``"auto"`` or ``"always"`` (``DISTLIMIT_REQUEST_TOKENS``, module
        docstring). ``queue_timeout``: the queue budget of a call (:mod:`.pool`; default
        :func:`~.pool.queue_budget`). ``split_slots``: one script call per hash slot
        (:mod:`.split_slots`)."""
        #: One script call per hash slot of a request's keys (:mod:`.split_slots`).
        self.split_slots = split_slots
        self.tokens = RequestTokens(timeout, request_tokens)
        self.scheme = scheme
        self.timeout = timeout
        own = client is None
        if client is None:
            options = {**HANDSHAKE_FREE, **connection, **connection_options(timeout)}
            admin = redis.BlockingConnectionPool(
                timeout=timeout, max_connections=max_connections, **options
            )
            client = redis.Redis(connection_pool=admin)
        self.client: redis.Redis = client
        self._scripts = SideScripts(client)
        self._script: Script = self._scripts.limit
        if own:
            self._use(options, max_connections, queue_timeout)

    @classmethod
    def sentinel(
        cls,
        sentinels: Sequence[tuple[str, int]],
        service_name: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        sentinel_options: dict[str, Any] | None = None,
        request_tokens: str = "auto",
        queue_timeout: float | None = None,
        split_slots: bool = False,
        **connection: Any,
    ) -> RedisStorage:
        """The master of ``service_name`` as the Sentinels report it; follows failovers.

        Every new connection of the hot call's pool asks the Sentinels for the current master
        (``Sentinel.discover_master``) within the request's deadline; ``READONLY`` from a
        demoted master drops every connection, and the request is made once more on the master
        the Sentinels name now. The admin client is redis-py's ``master_for``.
        """
        options = connection_options(timeout)
        manager = Sentinel(
            list(sentinels),
            sentinel_kwargs={**options, **(sentinel_options or {})},
            **{**HANDSHAKE_FREE, **connection, **options},
        )
        # The admin client: redis-py's own Sentinel pool, at most max_connections (it raises
        # rather than waits past them; admin commands are few). Its blocking variant cannot be
        # combined with the Sentinel pool before redis-py 7 (disconnect() differs).
        client = manager.master_for(service_name, max_connections=max_connections)
        storage = cls(
            client,
            timeout=timeout,
            scheme="redis+sentinel",
            request_tokens=request_tokens,
            queue_timeout=queue_timeout,
            split_slots=split_slots,
        )
        storage._sentinel = manager
        master = dict(connection)
        if master.pop("ssl", False):
            master["connection_class"] = redis.SSLConnection
        storage._use(
            {**HANDSHAKE_FREE, **master, **options},
            max_connections,
            queue_timeout,
            locate=lambda: manager.discover_master(service_name),
        )
        return storage

    def _use(
        self,
        connection: dict[str, Any],
        max_connections: int,
        queue_timeout: float | None,
        locate: Callable[[], tuple[str, int]] | None = None,
    ) -> None:
        """Make the hot call's calls on a pool of ``connection`` connections (:mod:`.pool`;
        ``locate``: where to connect, asked before each connect), batched (:mod:`.pipeline`)."""
        pool = self.pool = DeadlinePool(
            timeout=self.timeout,
            max_connections=max_connections,
            locate=locate,
            queue_timeout=queue_timeout,
            **connection,
        )
        self.pipeline = Pipeline(pool, load=script_load(SCRIPT_SOURCE), trouble=self.tokens.arm)
        self._packer = EvalshaPacker.of(self._script.sha, connection)

    @property
    def request_tokens(self) -> str:
        """``"never"`` on a client passed in (every call goes through redis-py's ``Script``)."""
        return super().request_tokens if self.pool is not None else "never"

    def evaluate(self, checks: Sequence[Check], *, now_us: int | None = None) -> Evaluation:
        if self.split_slots:
            groups = by_slot(c.key for c in checks)
            if len(groups) > 1:
                return across_slots(
                    checks, groups, lambda parts, refund: self._run_parts(parts, now_us, refund)
                )
        keys, args = script_args(checks, now_us)
        pool = self.pool
        try:
            if pool is None:  # a client passed in: redis-py's Script (SCRIPT LOAD on NOSCRIPT)
                reply = self._script(keys, args)
            else:
                # The limit script's EVALSHA in a batch of the pipeline, with a request token
                # when it needs one (:meth:`~.tokens.RequestTokens.needed`): the wait for a
                # batch by the queue budget, the reply by one Redis deadline (module docstring).
                now = time.monotonic()
                wait_until = now + pool.queue_timeout
                tokens = self.tokens
                token = tokens.key(keys[0]) if tokens.needed([checks], now=now) else None
                command = self._packer.pack(keys, args, token, tokens.first)
                call = self.pipeline.call(command, wait_until)
                if isinstance(call.error, ReadOnlyError) and self._sentinel is not None:
                    # A demoted master (a failover): it wrote nothing. Every connection goes to
                    # the master the Sentinels name now, and the request is made there once.
                    pool.disconnect()
                    call = self.pipeline.call(command, wait_until)
                if call.lost:
                    reply = self._repeat(pool, call, Made(keys, args, token), wait_until)
                elif call.error is not None:
                    raise call.error
                else:
                    reply = call.reply
        except REDIS_FAILURES as exc:
            raise self._failure(exc) from exc
        return parse_reply(reply, checks)

    def _failure(self, exc: BaseException) -> StorageError:
        """The error of a call that failed with ``exc``: a wait past the queue budget is load
        (:func:`~.pool.busy`: nothing was sent, nothing is armed); a failed connection arms the
        tokens (the next calls carry one)."""
        if isinstance(exc, NoConnectionAvailable):
            return busy(self.pool.queue_timeout if self.pool else 0.0)
        if isinstance(exc, redis.ConnectionError):
            self.tokens.arm()
        return storage_error(exc)

    def _run_parts(
        self, parts: list[list[Check]], now_us: int | None, refund: bool
    ) -> list[Evaluation | StorageError]:
        """One script call per part (a slot group, ``split_slots``): on our pool, all in one
        write on one connection (:func:`~.split_slots.send_parts`: one round trip); on a
        client passed in, one after another. Tokens as on a Cluster's groups (:mod:`.cluster`)."""
        made = self.tokens.made(parts, now_us, refund=refund)
        pool = self.pool
        if pool is None:  # redis-py's Script: no token
            replies = [outcome(self._script, m.keys, m.args) for m in made]
        else:
            wait_until = time.monotonic() + pool.queue_timeout
            send = (pool, self._packer, self.tokens, self.pipeline.load, made, wait_until)
            replies = send_parts(*send)
            if self._sentinel is not None and all(isinstance(r, ReadOnlyError) for r in replies):
                pool.disconnect()  # a demoted master wrote nothing: once more on the new one
                replies = send_parts(*send)
        return [
            self._failure(reply)
            if isinstance(reply, Exception)
            else outcome(parse_reply, reply, part)
            for part, reply in zip(parts, replies, strict=True)
        ]

    def _repeat(
        self,
        pool: DeadlinePool,
        call: Call,
        made: Made,
        wait_until: float,
    ) -> Any:
        """A call whose connection closed under it after the send (the script may have run),
        made once more on a connection of its own, marked as a repeat: the script answers the
        reply it kept under the token if it ran, and runs if it did not. A call sent without a
        token (calm, module docstring) gets one now, for its repeats."""
        assert isinstance(call.error, redis.ConnectionError)
        again = self.tokens.repeat(self._packer, made)
        # Redis's time for the repeats starts now: the batch's may be spent by this thread's
        # wait to be woken
        deadline = max(call.deadline, time.monotonic() + self.timeout)

        def read(connection: Any) -> Any:
            """The repeat's reply; after ``NOSCRIPT`` (Redis flushed, restarted or failed over)
            the script is loaded and the repeat sent once more, both in one write."""
            try:
                return pool.read(connection, deadline)
            except NoScriptError:  # the script did not run: load it, run it again
                pool.send(connection, [self.pipeline.load(connection) + again[0]])
                # the load's error reply (BUSY, an ACL without SCRIPT LOAD) is the repeat's to
                # tell, as in the pipeline: its reply is read all the same, none left unread
                with contextlib.suppress(redis.ResponseError):
                    pool.read(connection, deadline)
                return pool.read(connection, deadline)

        connection = pool.checkout(wait_until, connect=False)  # repeat_call connects it
        try:
            return repeat_call(pool, connection, again, deadline, call.error, read)
        except redis.ResponseError:
            raise  # an error reply, read whole: nothing is left unread
        except BaseException:
            pool.broken(connection)  # a reply may be left unread
            raise
        finally:
            pool.release(connection)

    def ping(self) -> float:
        started = time.perf_counter()
        translated(self.client.ping)
        return time.perf_counter() - started

    def _scanned(self) -> list[redis.Redis]:
        return [self.client]

    def _side(self) -> SideScripts:
        return self._scripts

    def _clients(self) -> list[redis.Redis]:
        """The redis-py clients: the admin client, and the Sentinel manager's (Sentinel.close()
        is redis-py 7+)."""
        return [self.client, *(self._sentinel.sentinels if self._sentinel else ())]

    def close(self) -> None:
        if self.pool is not None:  # our own clients (a client passed in is the app's)
            self.pool.disconnect()
            for client in self._clients():
                client.close()
                client.connection_pool.disconnect()

    def reset_after_fork(self) -> None:
        """Forget the connections inherited from the parent process.

        Both pools drop them (``reset()``, public in redis-py); redis-py closes a dropped
        connection's socket without ``shutdown()`` in a process other than its maker's, so the
        parent's connection stays intact. The child opens its own on first use.
        """
        for client in self._clients():
            client.connection_pool.reset()
        if self.pool is not None:
            self.pool.forget_inherited()
            self.pipeline.reset()
        self.tokens.reset()

    def node(self, refresh: bool = False) -> str:
        """Sentinel: the master's ``host:port`` as last discovered (``refresh``: ask the
        Sentinels now; a failure keeps the last one); ``"redis"`` before any, and always on a
        single node (one breaker per node: flask_distlimit/resilience/breakers.py)."""
        pool = self.pool
        if pool is None or pool.locate is None:  # not Sentinel
            return super().node(refresh)
        address = pool.located
        if refresh:
            with contextlib.suppress(*REDIS_FAILURES):  # none answers: keep the last master
                address = pool.located = pool.locate()
        return super().node() if not address else f"{address[0]}:{address[1]}"
