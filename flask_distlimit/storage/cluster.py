"""Redis Cluster: the checks of one request grouped per hash slot, the groups sent concurrently.

Promises: the limits of one identity share a hash tag, so they are decided in one atomic call, as
on a single node; a request of several slot groups sends every group before reading any reply,
within the request's deadline; when one group denies, the groups that consumed are given back
(refund mode), best effort; a call left unsent by this process's load is
:class:`~flask_distlimit.errors.StorageBusy`; a group lost every time while its node answers is
:class:`~flask_distlimit.errors.StorageReplyLost`, not counted against the node's breaker; a
reply in :data:`NOT_RUN` means the script did not run there, so the call is made again. The
nodes, pools and breakers are :mod:`.cluster_nodes`'s. Design: docs/design-notes.md, "Redis
Cluster".
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Sequence
from typing import Any, Final

from redis import exceptions as rx
from redis.cluster import ClusterNode, RedisCluster

from flask_distlimit.core.decision import Check, Evaluation
from flask_distlimit.engine.scripts import parse_reply, script_args, with_token
from flask_distlimit.errors import StorageError, StorageMisconfigured, StorageUnavailable
from flask_distlimit.storage.cluster_nodes import ClusterNodes
from flask_distlimit.storage.pool import DeadlinePool, NoConnectionAvailable, busy
from flask_distlimit.storage.slot_keys import across_slots, merged
from flask_distlimit.storage.split_slots import outcome, read_or_repeat, send_whole
from flask_distlimit.storage.tokens import Made
from flask_distlimit.storage.translate import REDIS_FAILURES, storage_error

#: Replies that mean the script did not run on that node (safe to send again).
NOT_RUN: Final = (rx.NoScriptError, rx.AskError, rx.TryAgainError)


def rounds(
    client: RedisCluster, parts: list[list[Check]], results: list[Any]
) -> list[list[tuple[int, ClusterNode]]]:
    """The parts (their indexes, with their primaries) in rounds of at most one part per
    primary, each round's primaries in the order of their names; a part whose primary is not
    known gets its error in ``results``."""
    by_node: dict[str, list[tuple[int, ClusterNode]]] = {}
    for n, part in enumerate(parts):
        try:
            node = client.get_node_from_key(part[0].key)
        except REDIS_FAILURES as exc:
            results[n] = failed(exc)
            continue
        by_node.setdefault(str(node.name), []).append((n, node))
    queues = [by_node[name] for name in sorted(by_node)]
    return [[p for p in round_ if p is not None] for round_ in itertools.zip_longest(*queues)]


class LostNode(StorageUnavailable):
    """A connection error or timeout on a node: the topology may have changed. A timeout is a
    slow node, and arms nothing."""


class ClosedNode(LostNode):
    """A connection to the node failed: it arms the request tokens."""


def failed(
    exc: Exception, pool: DeadlinePool | None = None, connection: Any = None
) -> StorageError:
    """Close a failed ``connection``, give it back to ``pool``, and translate the error."""
    if pool is not None and connection is not None:
        pool.broken(connection)
        pool.release(connection)
    if isinstance(exc, NoConnectionAvailable):  # load (StorageBusy): not the node's failure
        return busy(pool.queue_timeout if pool is not None else 0.0)
    error = storage_error(exc)
    # A refusal (e.g. WRONGPASS, an AuthenticationError) stays StorageMisconfigured: the node
    # answered, so the topology need not be refreshed, and the log must name the cause.
    if isinstance(exc, rx.ConnectionError | rx.TimeoutError) and not isinstance(
        error, StorageMisconfigured
    ):
        return (ClosedNode if isinstance(exc, rx.ConnectionError) else LostNode)(str(error))
    return error


class ClusterStorage(ClusterNodes):
    """Rate limits in a Redis Cluster (``redis+cluster://host:port[,host:port]``): the script
    calls of each request's slot groups (module docstring), on the client, nodes and pools of
    :class:`~.cluster_nodes.ClusterNodes`."""

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
        script = self._side().limit  # connects and registers the script on first use
        keys, args = script_args(checks, now_us, refund=refund)
        tokens = self.tokens
        again = token is not None
        if token is None and tokens.needed([checks], now=time.monotonic(), refund=refund):
            token = tokens.key(keys[0])

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

    def evaluate(self, checks: Sequence[Check], *, now_us: int | None = None) -> Evaluation:
        groups = self.groups(checks)
        if len(groups) <= 1:
            return self._call(checks, now_us)
        return across_slots(
            checks, groups, lambda parts, refund: self._run_all(parts, now_us, refund)
        )

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
        parts = [[checks[i] for i in g] for g in groups]
        return merged(checks, groups, self._run_all(parts, now_us, refund=True))

    def _run_all(
        self,
        parts: list[list[Check]],
        now_us: int | None,
        refund: bool = False,
    ) -> list[Evaluation | StorageError]:
        """One script call per part, all in flight at once, from the caller's thread.

        One part (the usual request) goes in a batch of its primary's pipeline (:meth:`_one`).
        Several: every part's ``EVALSHA`` is written to the connection of its slot's primary
        before any reply is read, so the calls overlap on the network and in the servers (the
        way redis-py's cluster pipeline sends to several nodes); parts that one primary serves
        go in :func:`rounds`, so a call holds one connection of a pool at a
        time (a request never waits for a connection it holds itself, and two requests never
        each hold one that the other waits for). The waits for connections end by one queue
        budget from now, each reply by its group's Redis deadline. A part lost on a node that
        the refreshed topology no longer names is made once more on the new primary.
        """
        client = self.client  # built on first use, before the deadline starts
        wait_until = time.monotonic() + self.queue_timeout
        packer, tokens = self._packer, self.tokens
        made = tokens.made(parts, now_us, refund=refund)
        results: list[Evaluation | StorageError | None] = [None] * len(parts)
        if len(parts) == 1:  # the usual request: one slot group, batched with others
            results[0] = self._one(client, parts[0], made[0], now_us, refund, wait_until)
        # (part, its pool, the connection, its Redis deadline)
        in_flight: list[tuple[int, DeadlinePool, Any, float]] = []
        try:
            for round_ in rounds(client, parts, results) if len(parts) > 1 else []:
                for n, node in round_:
                    m = made[n]
                    pool: DeadlinePool | None = None
                    connection: Any = None
                    try:
                        pool = self._pipeline_of(client, node).pool
                        command = [packer.pack(m.keys, m.args, m.token, tokens.first)]
                        # not probed: a closed connection fails the send or loses the reply,
                        # and both are made again, as in RedisStorage
                        connection = pool.checkout(wait_until, probe=False)
                        # in flight from here: on an unexpected exception (a signal handler's),
                        # the finally below closes it, so no reply is left unread in the pool
                        in_flight.append((n, pool, connection, 0.0))
                        deadline = send_whole(pool, connection, command, tokens)
                        in_flight[-1] = (n, pool, connection, deadline)
                    except REDIS_FAILURES as exc:
                        if connection is not None:
                            in_flight.pop()
                        results[n] = failed(exc, pool, connection)
                while in_flight:
                    n, pool, connection, deadline = in_flight[0]
                    reply = outcome(
                        read_or_repeat, pool, connection, packer, tokens, made[n], deadline
                    )
                    in_flight.pop(0)  # (an unexpected exception leaves it for the finally)
                    results[n] = self._ended(
                        parts[n], made[n], reply, now_us, refund, pool, connection
                    )
        finally:
            for _, pool, connection, _ in in_flight:  # only after an unexpected exception
                pool.broken(connection)
                pool.release(connection)
        lost = [n for n, r in enumerate(results) if isinstance(r, LostNode)]
        if lost:
            if any(isinstance(r, ClosedNode) for r in results):
                tokens.arm()  # connections fail: the next calls carry tokens (not a timeout)
            # Like redis-py after a connection error: refresh the topology (once every reply
            # is in), so the next call finds a promoted replica.
            before = {n: self._primary_of(parts[n][0].key) for n in lost}
            with contextlib.suppress(*REDIS_FAILURES):  # still down: the next call tries again
                client.nodes_manager.initialize()
            for n in lost:
                # A part whose slot has a new primary now (a promoted replica) is made there
                # once, as in _call, as a repeat of its token when it carried one: the first
                # try may have run and reached the replica (a refund given back twice would
                # let its limits admit that much more)
                if self._primary_of(parts[n][0].key) not in (before[n], None):
                    results[n] = self._call_or_error(parts[n], now_us, refund, made[n].token)
        return [r if r is not None else StorageUnavailable("no reply") for r in results]

    def _one(
        self,
        client: RedisCluster,
        part: list[Check],
        made: Made,
        now_us: int | None,
        refund: bool,
        wait_until: float,
    ) -> Evaluation | StorageError:
        """One slot group's call in a batch of its primary's pipeline (:mod:`.pipeline`, as on
        a single node); a reply lost is made again as a repeat of its token on a connection of
        its own."""
        try:
            pipeline = self._pipeline_of(client, client.get_node_from_key(made.keys[0]))
            command = self._packer.pack(made.keys, made.args, made.token, self.tokens.first)
            call = pipeline.call(command, wait_until)
        except REDIS_FAILURES as exc:
            return failed(exc)
        if not call.lost:
            if call.error is not None and not isinstance(call.error, Exception):
                raise call.error  # not an Exception: an interrupt of this call's own
            reply = call.reply if call.error is None else call.error
            return self._ended(part, made, reply, now_us, refund, pipeline.pool)
        assert isinstance(call.error, rx.ConnectionError)
        pool = pipeline.pool
        # Redis's time for the repeats starts now: the batch's may be spent by the wait to be woken
        deadline = max(call.deadline, time.monotonic() + self.timeout)
        try:
            connection = pool.checkout(wait_until, connect=False)  # the repeat connects it
        except REDIS_FAILURES as exc:
            return failed(exc, pool)
        try:
            packer, tokens, lost = self._packer, self.tokens, call.error
            reply = outcome(read_or_repeat, pool, connection, packer, tokens, made, deadline, lost)
        except BaseException:
            pool.broken(connection)  # a reply may be left unread
            pool.release(connection)
            raise
        return self._ended(part, made, reply, now_us, refund, pool, connection)

    def _ended(
        self,
        part: list[Check],
        made: Made,
        reply: Any,
        now_us: int | None,
        refund: bool,
        pool: DeadlinePool | None = None,
        connection: Any = None,
    ) -> Evaluation | StorageError:
        """The result of ``part``'s call from its ``reply`` or the failure that ended it
        (:func:`~.split_slots.outcome`), the ``connection`` it was read on given back to
        ``pool`` (closed after a failure, kept after an error reply, read whole). A call that
        did not run (:data:`NOT_RUN`: ``NOSCRIPT``, ``ASK``, ``TRYAGAIN``) is
        made again through redis-py's cluster path, which loads the script and follows the
        redirection."""
        if isinstance(reply, REDIS_FAILURES) and not isinstance(reply, rx.ResponseError):
            return failed(reply, pool, connection)
        if pool is not None and connection is not None:
            pool.release(connection)
        if isinstance(reply, NOT_RUN):
            return self._call_or_error(part, now_us, refund, made.token)
        if isinstance(reply, Exception):  # StorageReplyLost, or an error reply
            return reply if isinstance(reply, StorageError) else failed(reply)
        try:
            return parse_reply(reply, part)
        except StorageError as exc:
            return exc

    def _call_or_error(
        self, part: list[Check], now_us: int | None, refund: bool, token: str | None = None
    ) -> Evaluation | StorageError:
        try:
            return self._call(part, now_us, refund, token)
        except StorageError as exc:
            return exc
