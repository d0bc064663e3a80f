"""Redis Cluster: the checks of one request grouped per hash slot, the groups sent concurrently.

Every key of one client shares a hash tag (:mod:`flask_distlimit.declare.keys`), so the limits of
one identity always land in one slot and are decided in one atomic script call. A request whose
limits belong to several identities (say a per-IP limit and a per-tenant limit) spans several
slots: one script call per slot group, all groups in flight at once: every group's ``EVALSHA``
is written to its primary's connection before any reply is read (no threads: nothing to
serialize on the GIL, nothing to lose in a fork), and the replies are read within one deadline.

All-or-nothing across groups is best effort: each group is atomic on its own, and when one group
denies while others already consumed, those are called again in refund mode and give their units
back (:func:`flask_distlimit.engine.scripts.script_args` with ``refund=True``). Between the
consumption and the refund (one round trip) a concurrent request of the same client may see the
units taken; if the refund itself fails (the node died in between), the units stay consumed until
the window passes. A single-slot request is exactly atomic, as on a single node.

The client has the same policy as :mod:`flask_distlimit.storage.redis`: connect/read timeouts and
pool wait = ``timeout``, no retries (neither the nodes' nor the cluster client's own), no health
check PING. It is built on first use, so a configured but unreachable cluster fails requests
(``StorageUnavailable``, the breaker's business), not the app's start-up.

**Nodes and breakers.** The storage is ``routed``: :meth:`ClusterStorage.route` names the primary
(``host:port``, from the cached topology, no I/O) of each slot group, so that the guard keeps one
circuit breaker per primary and sends only the groups of live primaries
(:meth:`ClusterStorage.evaluate_parts`); it gives back what they consumed when the request is
refused elsewhere (:meth:`ClusterStorage.refund`). :meth:`ClusterStorage.nodes` lists the
primaries the topology knows, so the breakers of nodes gone from it are dropped.

**What one request may wait** (:meth:`ClusterStorage._run_all`, the path of every guarded
request): as on a single node (:mod:`.pool`), a wait for a primary's pooled connection is this
process's load, bounded by the queue budget (then
:class:`~flask_distlimit.errors.StorageBusy`, which says nothing of the node); a connect and
its handshake get a ``timeout`` of their own, and each group's Redis deadline, ``timeout``,
starts when its command is sent and bounds its read. The hot path runs on a
:class:`~.pool.DeadlinePool` per primary (the single node's pool, on redis-py's public
connection API), whose connections are
made as redis-py makes that node's (its pool's public ``connection_class`` and
``connection_kwargs``). Bounded by ``timeout`` per operation rather than by the deadline: a group
answered ``NOSCRIPT``/``MOVED``/``ASK`` is sent again through redis-py's cluster path, and after
a lost node the topology is refreshed (``nodes_manager.initialize()``, each startup node tried
with the timeout). Giving back what some groups consumed when the request is refused (a
refund) is one more such call, with a deadline of its own.

**Batches.** A request whose checks are one slot group (every key of one identity shares a
hash tag: the usual request) goes in a batch of its primary's pipeline (:mod:`.pipeline`, as
on a single node): the script calls of the requests in flight to one primary share one write
on a few connections. A request of several groups sends each on a connection of its own, all
in flight at once, as below.

**One retry**, as on a single node (:mod:`flask_distlimit.storage.redis`): a connect or a
send that fails is made once more within the deadline (Redis never had the whole command), and
a group whose connection is closed under it after the send (or was closed while idle in the
pool: it is not probed at checkout) is made once more, marked as a repeat of its request token
(up to three times within the deadline): the script answers the reply it kept if the first try
ran. Calls carry a token while the storage's connections have lately failed, and refunds
always (:mod:`.tokens`: the first reply lost in a calm period may be counted twice;
``request_tokens="always"``: never). Lost every time while the node answers a fresh connection:
that group is :class:`~flask_distlimit.errors.StorageReplyLost` (the guard does not count it
against the node's breaker).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any, Final

import redis
from redis import exceptions as rx
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.commands.core import Script
from redis.crc import key_slot
from redis.retry import Retry

from flask_distlimit.core.decision import Check, Decision, Evaluation
from flask_distlimit.engine.scripts import SCRIPT_SOURCE, parse_reply, script_args, with_token
from flask_distlimit.errors import (
    StorageError,
    StorageMisconfigured,
    StorageReplyLost,
    StorageUnavailable,
)
from flask_distlimit.storage.base import Storage
from flask_distlimit.storage.evalsha import EvalshaPacker
from flask_distlimit.storage.give_back import (
    GIVE_BACK_SOURCE,
    give_back_args,
    give_back_keys,
    given_back,
)
from flask_distlimit.storage.heartbeat import HEARTBEAT_SOURCE, Fleet, fleet_from_reply, peak_key
from flask_distlimit.storage.lease_records import (
    LEASE_RECORDS_SOURCE,
    Record,
    records_from_reply,
    records_key,
    repaired_from_reply,
)
from flask_distlimit.storage.pipeline import Call, Pipeline, script_load
from flask_distlimit.storage.pool import (
    LAST_LOOK,
    DeadlinePool,
    NoConnectionAvailable,
    busy,
    queue_budget,
)
from flask_distlimit.storage.redis import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_TIMEOUT,
    HANDSHAKE_FREE,
    _pool_connections,
    connection_options,
)
from flask_distlimit.storage.shared_value import SHARED_VALUE_SOURCE
from flask_distlimit.storage.tokens import RequestTokens, repeat_call
from flask_distlimit.storage.translate import REDIS_FAILURES, storage_error

__all__ = ["ClusterStorage", "slot_of"]

#: Replies that mean the script did not run on that node (safe to send again).
_NOT_RUN: Final = (rx.NoScriptError, rx.AskError, rx.TryAgainError)


def _read_or_repeat(
    pool: DeadlinePool,
    connection: Any,
    packer: EvalshaPacker,
    keys: list[str],
    args: list[str | int],
    token: str | None,
    tokens: RequestTokens,
    deadline: float,
) -> Any:
    """The reply to the call just sent on ``connection``; when the connection is closed under
    it, the call is made again, marked as a repeat (its reply, kept under ``token``, is answered
    if it ran; a call sent without one gets one now), within the same deadline
    (:func:`~.tokens.repeat_call`), and ``tokens`` are armed."""
    try:
        # At least a moment for each reply: the replies of the other groups may be waiting in
        # their sockets when one slow group has spent the deadline.
        return pool.read(connection, max(deadline, time.monotonic() + LAST_LOOK))
    except rx.ConnectionError as exc:
        lost = exc
    tokens.arm()
    if token is None:
        token = tokens.key(keys[0])
    again = [packer.pack(keys, args, token, tokens.again)]
    return repeat_call(pool, connection, again, deadline, lost, lambda c: pool.read(c, deadline))


def _rounds(
    client: RedisCluster, parts: list[list[Check]], results: list[Any]
) -> list[list[tuple[int, ClusterNode]]]:
    """The parts (their indexes, with their primaries) in rounds of at most one part per
    primary, each round's primaries in the order of their names; a part whose primary is not
    known gets its error in ``results``."""
    by_node: dict[str, list[tuple[int, ClusterNode]]] = {}
    for n, part in enumerate(parts):
        try:
            node = client.get_node_from_key(part[0].key)  # type: ignore[no-untyped-call]
        except REDIS_FAILURES as exc:
            results[n] = _failed(exc, None, None)
            continue
        by_node.setdefault(str(node.name), []).append((n, node))
    queues = [by_node[name] for name in sorted(by_node)]
    return [
        [queue[depth] for queue in queues if depth < len(queue)]
        for depth in range(max(map(len, queues), default=0))
    ]


class _LostNode(StorageUnavailable):
    """A connection error or timeout on a node: the topology may have changed. ``closed``: a
    connection failed (arms the request tokens); a timeout is a slow node, and arms nothing."""

    def __init__(self, message: str, *, closed: bool) -> None:
        super().__init__(message)
        self.closed = closed


def _failed(exc: Exception, pool: DeadlinePool | None, connection: Any) -> StorageError:
    """Close a failed connection, give it back, and translate the error."""
    if pool is not None and connection is not None:
        pool.broken(connection)
        pool.release(connection)
    if isinstance(exc, NoConnectionAvailable):  # load (StorageBusy): not the node's failure
        return busy(pool.queue_timeout if pool is not None else 0.0)
    error = storage_error(exc)
    # A refusal (e.g. WRONGPASS, an AuthenticationError) stays StorageMisconfigured: the node
    # answered, so the topology need not be refreshed, and the log must name the cause.
    # Every connection of the primary's pool busy (NoConnectionAvailable) is load: the node
    # is not lost, and the tokens are not armed.
    if (
        isinstance(exc, rx.ConnectionError | rx.TimeoutError)
        and not isinstance(exc, NoConnectionAvailable)
        and not isinstance(error, StorageMisconfigured)
    ):
        return _LostNode(str(error), closed=isinstance(exc, rx.ConnectionError))
    return error


def _bounded_wait_pool(timeout: float) -> type[redis.BlockingConnectionPool]:
    """redis-py's :class:`~redis.BlockingConnectionPool` whose wait for a free connection lasts
    ``timeout`` by default: redis-py before 8.0 drops ``RedisCluster(timeout=)`` on its way to
    the nodes' pools, which then wait 20 s (the calls off the hot path use them: topology,
    ``PING``, heartbeats, admin)."""

    class BoundedWaitPool(redis.BlockingConnectionPool):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("timeout", timeout)
            super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]

    return BoundedWaitPool


def slot_of(key: str) -> int:
    """The Redis Cluster hash slot of a key (honours ``{hash tags}``)."""
    return key_slot(key.encode("utf-8"))


class ClusterStorage(Storage):
    """Rate limits in a Redis Cluster (``redis+cluster://host:port[,host:port]``)."""

    scheme = "redis+cluster"
    routed = True

    def __init__(
        self,
        nodes: Sequence[tuple[str, int]] = (),
        *,
        client: RedisCluster | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        request_tokens: str = "auto",
        queue_timeout: float | None = None,
        **connection: Any,
    ) -> None:
        """``nodes``: startup nodes (any reachable node finds the others). ``connection``:
        redis-py connection keywords (``password``, ``ssl``, ...). ``client`` replaces all of
        them with a ready :class:`~redis.cluster.RedisCluster` (not closed by :meth:`close`).
        ``request_tokens``: ``"auto"`` or ``"always"`` (``DISTLIMIT_REQUEST_TOKENS``, module
        docstring). ``queue_timeout``: how long a call may wait for a pooled connection
        (:mod:`.pool`; default :func:`~.pool.queue_budget`)."""
        if client is None and not nodes:
            raise ValueError("ClusterStorage needs startup nodes or a RedisCluster client")
        self.timeout = timeout
        self.queue_timeout = queue_budget(timeout) if queue_timeout is None else queue_timeout
        self._nodes = [(str(h), int(p)) for h, p in nodes]
        self._max_connections = max_connections
        self._connection = connection
        self._owns_client = client is None
        #: The client passed in, ``None`` when built from ``nodes`` (init_app warns when it
        #: retries: :mod:`~flask_distlimit.storage.client_retries`).
        self.given_client = client
        self._lock = threading.Lock()
        self._client: RedisCluster | None = None
        self._script: Script | None = None
        self._heartbeat: Script | None = None
        self._shared_value: Script | None = None
        self._lease_records: Script | None = None
        self._give_back: Script | None = None
        #: The hot path's pool of each primary (``host:port``), built on first use.
        self._pools: dict[str, DeadlinePool] = {}
        #: The batches of each primary's pool (:mod:`.pipeline`), for one-group calls.
        self._pipelines: dict[str, Pipeline] = {}
        #: The request tokens of the hot path (module docstring, "One retry").
        self.tokens = RequestTokens(timeout, request_tokens)
        if client is not None:
            self._attach(client)

    # -- the client, built lazily (start-up must not need the cluster) ----------------------

    def _attach(self, client: RedisCluster) -> None:
        self._script = client.register_script(SCRIPT_SOURCE)
        self._packer = EvalshaPacker(
            self._script.sha,
            encoding=self._connection.get("encoding", "utf-8"),
            errors=self._connection.get("encoding_errors", "strict"),
        )
        self._heartbeat = client.register_script(HEARTBEAT_SOURCE)
        self._shared_value = client.register_script(SHARED_VALUE_SOURCE)
        self._lease_records = client.register_script(LEASE_RECORDS_SOURCE)
        self._give_back = client.register_script(GIVE_BACK_SOURCE)
        self._client = client

    def _connect(self) -> RedisCluster:
        options = connection_options(self.timeout)
        options.pop("retry")  # RedisCluster sets its nodes' retries to 0 itself
        if not hasattr(Retry, "get_retries"):
            # redis-py < 6 retries the whole command this many times (3 by default), whatever
            # retry= says; from 6 it is retry's count, and this argument is deprecated
            options["cluster_error_retry_attempts"] = 0
        (first_host, first_port), *others = self._nodes
        if ":" in first_host:  # IPv6
            first_host = f"[{first_host}]"
        # A URL (not host=) makes RedisCluster build each node's pool from
        # connection_pool_class, so the pool wait is bounded by the timeout too.
        return RedisCluster(
            url=f"redis://{first_host}:{first_port}",
            startup_nodes=[ClusterNode(h, p) for h, p in others],  # type: ignore[no-untyped-call]
            retry=Retry(NoBackoff(), 0),
            connection_pool_class=_bounded_wait_pool(self.timeout),
            max_connections=self._max_connections,
            **{**HANDSHAKE_FREE, **self._connection, **options, "timeout": self.timeout},
        )

    @property
    def client(self) -> RedisCluster:
        """The :class:`~redis.cluster.RedisCluster` (connects on first use)."""
        client = self._client
        if client is None:
            with self._lock:
                if self._client is None:
                    try:
                        self._attach(self._connect())
                    except REDIS_FAILURES as exc:
                        raise storage_error(exc) from exc
                client = self._client
                assert client is not None
        return client

    # -- the hot path ----------------------------------------------------------------------

    def _call(
        self,
        checks: Sequence[Check],
        now_us: int | None,
        refund: bool = False,
        token: str | None = None,
    ) -> Evaluation:
        """One script call on the slot of ``checks`` (all in one slot), through redis-py's
        cluster path. ``token``: the request token a call made earlier on the hot path carried
        (this call is made again, marked as a repeat of it: a promoted replica that received
        the first try's writes answers its kept reply); else one is drawn for a refund or while
        the tokens are armed, for this call's own second try below."""
        self.client  # noqa: B018 - connects and registers the script on first use
        script = self._script
        assert script is not None
        keys, args = script_args(checks, now_us, refund=refund)
        tokens = self.tokens
        again = token is not None
        if token is None:
            token = (
                tokens.key(keys[0]) if refund else tokens.key_if_armed(keys[0], time.monotonic())
            )

        def run(repeat: bool) -> Any:
            if token is None:
                return script(keys, args)
            return script(*with_token(keys, args, token, tokens.ttl_ms, again=repeat))

        primary = self._primary_of(keys[0])
        try:
            try:
                reply = run(again)
            except rx.ConnectionError:
                # redis-py refreshed the topology after the error. If it now names another
                # primary (a replica was promoted while the breaker was open), try that one
                # once: otherwise the breaker's half-open trial would go to the dead node and
                # keep the breaker open for another reset timeout. The first try may have run
                # and reached the replica: a call with a token is made as its repeat.
                tokens.arm()
                if self._primary_of(keys[0]) in (primary, None):
                    raise
                reply = run(True)
        except REDIS_FAILURES as exc:
            raise storage_error(exc) from exc
        return parse_reply(reply, checks)

    def _primary_of(self, key: str) -> str | None:
        """The name (``host:port``) of the primary that serves ``key`` in the cached topology."""
        try:
            node = self.client.get_node_from_key(key)  # type: ignore[no-untyped-call]
        except REDIS_FAILURES:
            return None
        except (StorageError, LookupError):
            return None
        return str(node.name) if node is not None else None

    def groups(self, checks: Sequence[Check]) -> list[list[int]]:
        """Indexes of ``checks`` grouped by hash slot, in order of first appearance."""
        by_slot: dict[int, list[int]] = {}
        for index, check in enumerate(checks):
            by_slot.setdefault(slot_of(check.key), []).append(index)
        return list(by_slot.values())

    # -- nodes, for one breaker per primary (flask_distlimit.resilience.breakers)
    # ----------------------

    def _node_name(self, key: str) -> str:
        """The primary serving ``key`` in the cached topology (no I/O); before the client knows
        the topology, or when it does not cover the slot, the first startup node."""
        client = self._client
        if client is not None:
            try:
                node = client.get_node_from_key(key)  # type: ignore[no-untyped-call]
            except REDIS_FAILURES:  # e.g. SlotNotCoveredError
                node = None
            if node is not None:
                return str(node.name)
        if not self._nodes:
            return "cluster"
        host, port = self._nodes[0]
        return f"{host}:{port}"

    def node(self, refresh: bool = False) -> str:
        """The primary of slot 0 (the first startup node before the topology is known).

        ``refresh`` first reloads the slot map from the cluster (the guard asks for it, at most
        once a second, while a primary's breaker is open: a promoted replica then gets the
        slots, and a breaker of its own); a failure keeps the map it had."""
        client = self._client
        if refresh and client is not None:
            with contextlib.suppress(*REDIS_FAILURES):
                client.nodes_manager.initialize()
        return self._node_name("")

    def nodes(self) -> frozenset[str] | None:
        """The primaries of the cached topology (``None`` before the client connected)."""
        client = self._client
        if client is None:
            return None
        try:
            return frozenset(str(n.name) for n in client.get_primaries())  # type: ignore[no-untyped-call]
        except REDIS_FAILURES:
            return None

    def route(self, checks: Sequence[Check]) -> list[tuple[str, list[int]]]:
        """The slot groups (:meth:`groups`), each with the name of its primary."""
        return [(self._node_name(checks[g[0]].key), g) for g in self.groups(checks)]

    def evaluate_parts(
        self, parts: Sequence[Sequence[Check]], *, now_us: int | None = None
    ) -> list[Evaluation | StorageError]:
        """Every part (one slot group each) through :meth:`_run_all`, under one deadline."""
        try:
            return self._run_all([list(p) for p in parts], now_us)
        except StorageError as exc:  # the client could not be built: every node is unknown
            return [exc] * len(parts)

    def refund(self, checks: Sequence[Check], *, now_us: int | None = None) -> Evaluation:
        """Give back the costs of ``checks`` (slot groups in flight at once); raises the first
        group's error, if any."""
        groups = self.groups(checks)
        results = self._run_all([[checks[i] for i in g] for g in groups], now_us, refund=True)
        decisions: list[Decision | None] = [None] * len(checks)
        for group, result in zip(groups, results, strict=True):
            if isinstance(result, StorageError):
                raise result
            for index, decision in zip(group, result.decisions, strict=True):
                decisions[index] = decision
        return Evaluation(tuple(d for d in decisions if d is not None))

    def _run_all(
        self,
        parts: list[list[Check]],
        now_us: int | None,
        refund: bool = False,
    ) -> list[Evaluation | StorageError]:
        """One script call per part, all in flight at once, from the caller's thread.

        Every part's ``EVALSHA`` is written to the connection of its slot's primary before any
        reply is read, so the calls overlap on the network and in the servers (the way
        redis-py's cluster pipeline sends to several nodes); parts that one primary serves go
        in rounds, one per round, so a call holds one connection of a pool at a time (taken
        in the order of the primaries' names: two calls never wait on each other), and the
        replies are read each within its group's Redis deadline; the waits for connections end
        by one queue budget from now (the module docstring says what each bounds, and when a
        failed send is made once more). A part
        answered ``NOSCRIPT``, ``MOVED``, ``ASK`` or ``TRYAGAIN`` did not run: it is sent again
        through redis-py's own cluster path, which loads the script and follows the redirection.
        """
        client = self.client  # built on first use, before the deadline starts
        now = time.monotonic()
        wait_until = now + self.queue_timeout
        packer, tokens = self._packer, self.tokens
        # a refund always carries a token: repeated twice, it would give back twice
        armed = refund or now < tokens.armed_until
        results: list[Evaluation | StorageError | None] = [None] * len(parts)
        #: part -> the request token its first try carried (None: none)
        sent: dict[int, str | None] = {}
        if len(parts) == 1:  # the usual request: one slot group, batched with others
            results[0] = self._one(client, parts[0], now_us, refund, armed, wait_until, sent)
            parts_rounds: list[list[tuple[int, ClusterNode]]] = []
        else:
            parts_rounds = _rounds(client, parts, results)
        # (part, its pool, the connection, keys, args, token, its Redis deadline)
        in_flight: list[
            tuple[int, DeadlinePool, Any, list[str], list[str | int], str | None, float]
        ] = []
        try:
            # At most one connection of a primary's pool at a time, the primaries taken in one
            # order: a request never waits for a connection it holds itself, and two requests
            # never each hold one that the other waits for (slot groups a primary serves go in
            # rounds, one per round).
            for round_ in parts_rounds:
                for n, node in round_:
                    keys, args = script_args(parts[n], now_us, refund=refund)
                    token = sent[n] = tokens.key(keys[0]) if armed else None
                    pool: DeadlinePool | None = None
                    connection: Any = None
                    try:
                        pool = self._pool_of(client, node)
                        # not probed: a closed connection fails the send or loses the reply,
                        # and both are made again below, as in RedisStorage
                        command = [packer.pack(keys, args, token, tokens.first)]
                        # the wait by the queue budget, a connect by a timeout of its own
                        connection = pool.checkout(wait_until, probe=False)
                        # in flight from here: on an unexpected exception (not a Redis failure:
                        # a signal handler's, a timeout's), the finally below closes it, so no
                        # reply is left unread in the pool, and gives it back
                        in_flight.append((n, pool, connection, keys, args, token, 0.0))
                        try:
                            pool.send(connection, command)
                        except rx.ConnectionError:
                            # The send failed, so Redis never had the whole command: the script did
                            # not run. Once more on a fresh connection.
                            tokens.arm()
                            pool.renew(connection, time.monotonic() + self.timeout)
                            pool.send(connection, command)
                        # the group's Redis deadline: from when Redis has its command
                        deadline = time.monotonic() + self.timeout
                        in_flight[-1] = (n, pool, connection, keys, args, token, deadline)
                    except REDIS_FAILURES as exc:
                        if connection is not None:
                            in_flight.pop()
                        results[n] = _failed(exc, pool, connection)
                        continue
                while in_flight:
                    n, pool, connection, keys, args, token, deadline = in_flight[0]
                    try:
                        reply = _read_or_repeat(
                            pool, connection, packer, keys, args, token, tokens, deadline
                        )
                    except _NOT_RUN:
                        in_flight.pop(0)
                        pool.release(connection)
                        results[n] = self._call_or_error(parts[n], now_us, refund, token)
                        continue
                    except StorageReplyLost as exc:
                        in_flight.pop(0)
                        pool.release(connection)
                        results[n] = exc
                        continue
                    except REDIS_FAILURES as exc:
                        in_flight.pop(0)
                        results[n] = _failed(exc, pool, connection)
                        continue
                    # (an unexpected exception leaves it in flight, for the finally below)
                    in_flight.pop(0)
                    pool.release(connection)
                    try:
                        results[n] = parse_reply(reply, parts[n])
                    except StorageError as exc:
                        results[n] = exc
        finally:
            for _, pool, connection, *_ in in_flight:  # only after an unexpected exception
                pool.broken(connection)
                pool.release(connection)
        lost = [n for n, r in enumerate(results) if isinstance(r, _LostNode)]
        if lost:
            if any(r.closed for r in results if isinstance(r, _LostNode)):
                tokens.arm()  # connections fail: the next calls carry tokens (not a timeout)
            # Like redis-py after a connection error: refresh the topology (once every reply
            # is in), so the next call finds a promoted replica.
            before = {n: self._primary_of(parts[n][0].key) for n in lost}
            with contextlib.suppress(*REDIS_FAILURES):  # still down: the next call tries again
                client.nodes_manager.initialize()
            for n in lost:
                # A part whose slot has a new primary now (a promoted replica) is tried there
                # once, as in _call.
                if self._primary_of(parts[n][0].key) not in (before[n], None):
                    # made again there, as a repeat of its token when it carried one: the
                    # first try may have run and reached the replica (a refund given back
                    # twice would let its limits admit that much more)
                    results[n] = self._call_or_error(parts[n], now_us, refund, sent.get(n))
        return [r if r is not None else StorageUnavailable("no reply") for r in results]

    def _one(
        self,
        client: RedisCluster,
        part: list[Check],
        now_us: int | None,
        refund: bool,
        armed: bool,
        wait_until: float,
        sent: dict[int, str | None],
    ) -> Evaluation | StorageError:
        """One slot group's call in a batch of its primary's pipeline (:mod:`.pipeline`, as on
        a single node); what :meth:`_run_all` does for a group, otherwise: a reply lost is made
        again as a repeat of its token on a connection of its own, a ``NOSCRIPT`` the batch
        did not mend, ``MOVED``, ``ASK`` or ``TRYAGAIN`` through redis-py's cluster path."""
        found: list[Any] = [None]
        rounds = _rounds(client, [part], found)
        if not rounds:
            return found[0]  # type: ignore[no-any-return]
        node = rounds[0][0][1]
        keys, args = script_args(part, now_us, refund=refund)
        tokens = self.tokens
        token = sent[0] = tokens.key(keys[0]) if armed else None
        pool: DeadlinePool | None = None
        try:
            pool = self._pool_of(client, node)
            command = self._packer.pack(keys, args, token, tokens.first)
            call = self._pipeline_of(str(node.name), pool).call(command, wait_until)
        except REDIS_FAILURES as exc:
            return _failed(exc, None, None)
        error = call.error
        if call.lost:
            assert isinstance(error, rx.ConnectionError)
            return self._repeat(pool, part, keys, args, token, call, wait_until)
        if isinstance(error, _NOT_RUN):
            return self._call_or_error(part, now_us, refund, token)
        if isinstance(error, Exception):
            return _failed(error, None, None)
        if error is not None:
            raise error  # not an Exception: an interrupt of this call's own
        try:
            return parse_reply(call.reply, part)
        except StorageError as exc:
            return exc

    def _repeat(
        self,
        pool: DeadlinePool,
        part: list[Check],
        keys: list[str],
        args: list[str | int],
        token: str | None,
        call: Call,
        wait_until: float,
    ) -> Evaluation | StorageError:
        """A batched call whose connection closed after the send, made again as a repeat of
        its token (one drawn now when it carried none) on a connection of its own."""
        tokens = self.tokens
        tokens.arm()
        if token is None:
            token = tokens.key(keys[0])
        again = [self._packer.pack(keys, args, token, tokens.again)]
        deadline = max(call.deadline, time.monotonic() + self.timeout)
        lost = call.error
        assert isinstance(lost, rx.ConnectionError)
        try:
            connection = pool.checkout(wait_until, connect=False)  # repeat_call connects it
        except REDIS_FAILURES as exc:
            return _failed(exc, None, None)
        try:
            reply = repeat_call(
                pool, connection, again, deadline, lost, lambda c: pool.read(c, deadline)
            )
        except StorageReplyLost as exc:
            pool.release(connection)
            return exc
        except rx.ResponseError as exc:
            pool.release(connection)  # read whole
            return _failed(exc, None, None)
        except REDIS_FAILURES as exc:
            return _failed(exc, pool, connection)
        except BaseException:
            pool.broken(connection)
            pool.release(connection)
            raise
        pool.release(connection)
        try:
            return parse_reply(reply, part)
        except StorageError as exc:
            return exc

    def _pipeline_of(self, name: str, pool: DeadlinePool) -> Pipeline:
        """The batches of primary ``name``'s pool, built on first use."""
        pipeline = self._pipelines.get(name)
        if pipeline is None or pipeline.pool is not pool:
            with self._lock:
                pipeline = self._pipelines.get(name)
                if pipeline is None or pipeline.pool is not pool:
                    pipeline = self._pipelines[name] = Pipeline(
                        pool, load=script_load(SCRIPT_SOURCE), trouble=self.tokens.arm
                    )
        return pipeline

    def _pool_of(self, client: RedisCluster, node: ClusterNode) -> DeadlinePool:
        """The hot path's pool of ``node``: a :class:`~.pool.DeadlinePool` of connections
        made as redis-py makes that node's (its pool's public ``connection_class`` and
        ``connection_kwargs``), so every wait of a call ends by the call's deadline."""
        name = str(node.name)
        pool = self._pools.get(name)
        if pool is None:
            stock = client.get_redis_connection(node).connection_pool
            with self._lock:
                pool = self._pools.get(name)
                if pool is None:
                    pool = self._pools[name] = DeadlinePool(
                        timeout=self.timeout,
                        queue_timeout=self.queue_timeout,
                        max_connections=self._max_connections,
                        connection_class=stock.connection_class,
                        **stock.connection_kwargs,
                    )
        return pool

    def _call_or_error(
        self, part: list[Check], now_us: int | None, refund: bool, token: str | None = None
    ) -> Evaluation | StorageError:
        try:
            return self._call(part, now_us, refund, token)
        except StorageError as exc:
            return exc

    @property
    def request_tokens(self) -> str:
        """When a hot call carries a request token (module docstring, "One retry")."""
        return self.tokens.mode

    def evaluate(self, checks: Sequence[Check], *, now_us: int | None = None) -> Evaluation:
        groups = self.groups(checks)
        if len(groups) <= 1:
            return self._call(checks, now_us)
        parts = [[checks[i] for i in group] for group in groups]
        results = self._run_all(parts, now_us)
        failure = next((r for r in results if isinstance(r, StorageError)), None)
        denied = any(isinstance(r, Evaluation) and not r.allowed for r in results)
        if failure is not None or denied:
            # Give back what the groups that admitted the request consumed.
            consumed = [
                n
                for n, r in enumerate(results)
                if isinstance(r, Evaluation) and r.allowed and any(c.cost for c in parts[n])
            ]
            if consumed:
                # a shadow check that would deny was not charged: give it nothing back
                given = [
                    [
                        replace(c, cost=0) if d.shadow_denied else c
                        for c, d in zip(parts[n], results[n].decisions, strict=True)  # type: ignore[union-attr]
                    ]
                    for n in consumed
                ]
                refunds = self._run_all(given, now_us, refund=True)
                for n, refunded in zip(consumed, refunds, strict=True):
                    if isinstance(refunded, Evaluation):
                        results[n] = refunded
            if failure is not None:
                raise failure
        decisions: list[Decision | None] = [None] * len(checks)
        repaired: list[str] = []
        for group, result in zip(groups, results, strict=True):
            assert isinstance(result, Evaluation)
            for index, decision in zip(group, result.decisions, strict=True):
                decisions[index] = decision
            repaired.extend(result.repaired_keys)
        node_now = results[0].now_us if len(results) == 1 else 0  # type: ignore[union-attr]
        return Evaluation(tuple(d for d in decisions if d is not None), tuple(repaired), node_now)

    # -- the rest of the storage interface -------------------------------------------------

    def ping(self) -> float:
        client = self.client
        started = time.perf_counter()
        try:
            client.ping(target_nodes=RedisCluster.PRIMARIES)
        except REDIS_FAILURES as exc:
            raise storage_error(exc) from exc
        return time.perf_counter() - started

    def scan(self, match: str) -> Iterator[str]:
        client = self.client
        try:
            for node in client.get_primaries():  # type: ignore[no-untyped-call]
                node_client = client.get_redis_connection(node)
                for key in node_client.scan_iter(match=match, count=1000):
                    yield key.decode() if isinstance(key, bytes) else str(key)
        except REDIS_FAILURES as exc:
            raise storage_error(exc) from exc

    def delete(self, keys: Iterable[str]) -> int:
        client = self.client
        by_slot: dict[int, list[str]] = {}
        for key in keys:
            by_slot.setdefault(slot_of(key), []).append(key)
        deleted = 0
        try:
            for same_slot in by_slot.values():
                for start in range(0, len(same_slot), 500):
                    deleted += int(client.delete(*same_slot[start : start + 500]))
        except REDIS_FAILURES as exc:
            raise storage_error(exc) from exc
        return deleted

    def heartbeat(self, key: str, member: str, ttl: float) -> int:
        return self.heartbeat_fleet(key, member, ttl).live

    def heartbeat_fleet(self, key: str, member: str, ttl: float, known: int = 0) -> Fleet:
        self.client  # noqa: B018 - connects and registers the scripts
        assert self._heartbeat is not None
        try:  # both keys in the heartbeat key's slot (peak_key)
            reply = self._heartbeat(
                [key, peak_key(key)], [member, max(1, round(ttl * 1000)), max(0, int(known))]
            )
        except REDIS_FAILURES as exc:
            raise storage_error(exc) from exc
        return fleet_from_reply(reply, key)

    def publish_leases(self, key: str, process: str, record: str, hold: float) -> tuple[str, ...]:
        self.client  # noqa: B018 - connects and registers the scripts
        assert self._lease_records is not None
        try:  # both keys in one slot (records_key)
            reply = self._lease_records(
                [key, records_key(key)], [process, record, max(1, round(hold * 1000))]
            )
        except REDIS_FAILURES as exc:
            raise storage_error(exc) from exc
        return repaired_from_reply(reply, key)

    def give_back(
        self,
        key: str,
        algorithm: str,
        period: int,
        window: int,
        units: int,
        *,
        now_us: int | None = None,
    ) -> int:
        self.client  # noqa: B018 - connects and registers the scripts
        assert self._give_back is not None
        args = give_back_args(algorithm, period, window, units, now_us)
        try:
            reply = self._give_back(give_back_keys(key), args)
        except REDIS_FAILURES as exc:
            raise storage_error(exc) from exc
        return given_back(reply)

    def lease_records(self, key: str) -> list[Record]:
        self.client  # noqa: B018 - connects and registers the scripts
        assert self._lease_records is not None
        try:
            reply = self._lease_records([key, records_key(key)], ["", "", 0])
        except REDIS_FAILURES as exc:
            raise storage_error(exc) from exc
        return records_from_reply(reply)

    def shared_value(self, key: str, candidate: str, ttl: int) -> str:
        self.client  # noqa: B018 - connects and registers the scripts
        assert self._shared_value is not None
        try:
            value = self._shared_value([key], [candidate, int(ttl)])
        except REDIS_FAILURES as exc:
            raise storage_error(exc) from exc
        return value.decode() if isinstance(value, bytes) else str(value)

    def scripts_loaded(self) -> bool:
        client = self.client
        assert self._script is not None
        try:
            found = client.script_exists(self._script.sha)
        except REDIS_FAILURES as exc:
            raise storage_error(exc) from exc
        return bool(found) and all(found)

    def close(self) -> None:
        if self._owns_client and self._client is not None:
            self._client.close()
            self._client = None
        for pool in list(self._pools.values()):
            pool.disconnect()

    def reset_after_fork(self) -> None:
        """Forget the connections inherited from the parent (call in a forked child)."""
        self.tokens.reset()
        for deadline_pool in list(self._pools.values()):
            deadline_pool.forget_inherited()
        for pipeline in list(self._pipelines.values()):
            pipeline.reset()
        client = self._client
        if client is None:
            return
        for node in client.get_nodes():  # type: ignore[no-untyped-call]
            node_client = node.redis_connection
            if node_client is None:
                continue
            pool = node_client.connection_pool
            for conn in _pool_connections(pool):
                conn.disconnect()
            pool.reset()
