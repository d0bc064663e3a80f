"""Redis Cluster: the checks of one request grouped per hash slot, the groups sent concurrently.

Promises: the limits of one identity share a hash tag, so they are decided in one atomic call, as
on a single node; a request of several slot groups sends every group before reading any reply,
within the request's deadline; when one group denies, the groups that consumed are given back
(refund mode), best effort; a call left unsent by this process's load is
:class:`~flask_distlimit.errors.StorageBusy`; a group lost every time while its node answers is
:class:`~flask_distlimit.errors.StorageReplyLost`, not counted against the node's breaker. The
nodes, pools and breakers are :mod:`.cluster_nodes`'s. Design: docs/design-notes.md, "Redis
Cluster".
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

from redis import exceptions as rx
from redis.cluster import ClusterNode, RedisCluster

from flask_distlimit.core.decision import Check, Decision, Evaluation
from flask_distlimit.engine.scripts import parse_reply, script_args, with_token
from flask_distlimit.errors import StorageError, StorageReplyLost, StorageUnavailable
from flask_distlimit.storage.cluster_nodes import (
    NOT_RUN,
    ClusterNodes,
    LostNode,
    failed,
    read_or_repeat,
    rounds,
)
from flask_distlimit.storage.pipeline import Call
from flask_distlimit.storage.pool import DeadlinePool
from flask_distlimit.storage.slot_keys import across_slots
from flask_distlimit.storage.tokens import repeat_call, settles
from flask_distlimit.storage.translate import REDIS_FAILURES, storage_error


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
        if token is None:
            token = (
                tokens.key(keys[0])
                if refund or settles(checks)
                else tokens.key_if_armed(keys[0], time.monotonic())
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
        armed = refund or now < tokens.armed_until or any(settles(p) for p in parts)
        results: list[Evaluation | StorageError | None] = [None] * len(parts)
        #: part -> the request token its first try carried (None: none)
        sent: dict[int, str | None] = {}
        if len(parts) == 1:  # the usual request: one slot group, batched with others
            results[0] = self._one(client, parts[0], now_us, refund, armed, wait_until, sent)
            parts_rounds: list[list[tuple[int, ClusterNode]]] = []
        else:
            parts_rounds = rounds(client, parts, results)
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
                        results[n] = failed(exc, pool, connection)
                        continue
                while in_flight:
                    n, pool, connection, keys, args, token, deadline = in_flight[0]
                    try:
                        reply = read_or_repeat(
                            pool, connection, packer, keys, args, token, tokens, deadline
                        )
                    except NOT_RUN:
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
                        results[n] = failed(exc, pool, connection)
                        continue
                    # (an unexpected exception leaves it in flight, for the finally below)
                    in_flight.pop(0)
                    pool.release(connection)
                    results[n] = _parsed(reply, parts[n])
        finally:
            for _, pool, connection, *_ in in_flight:  # only after an unexpected exception
                pool.broken(connection)
                pool.release(connection)
        lost = [n for n, r in enumerate(results) if isinstance(r, LostNode)]
        if lost:
            if any(r.closed for r in results if isinstance(r, LostNode)):
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
        keys, args = script_args(part, now_us, refund=refund)
        tokens = self.tokens
        token = sent[0] = tokens.key(keys[0]) if armed else None
        try:
            node = client.get_node_from_key(keys[0])
            pool = self._pool_of(client, node)
            command = self._packer.pack(keys, args, token, tokens.first)
            call = self._pipeline_of(str(node.name), pool).call(command, wait_until)
        except REDIS_FAILURES as exc:
            return failed(exc, None, None)
        error = call.error
        if call.lost:
            assert isinstance(error, rx.ConnectionError)
            return self._repeat(pool, part, keys, args, token, call, wait_until)
        if isinstance(error, NOT_RUN):
            return self._call_or_error(part, now_us, refund, token)
        if isinstance(error, Exception):
            return failed(error, None, None)
        if error is not None:
            raise error  # not an Exception: an interrupt of this call's own
        return _parsed(call.reply, part)

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
        again = self.tokens.repeat(self._packer, keys, args, token)
        deadline = max(call.deadline, time.monotonic() + self.timeout)
        lost = call.error
        assert isinstance(lost, rx.ConnectionError)
        try:
            connection = pool.checkout(wait_until, connect=False)  # repeat_call connects it
        except REDIS_FAILURES as exc:
            return failed(exc, None, None)
        try:
            reply = repeat_call(
                pool, connection, again, deadline, lost, lambda c: pool.read(c, deadline)
            )
        except StorageReplyLost as exc:
            pool.release(connection)
            return exc
        except rx.ResponseError as exc:
            pool.release(connection)  # read whole
            return failed(exc, None, None)
        except REDIS_FAILURES as exc:
            return failed(exc, pool, connection)
        except BaseException:
            pool.broken(connection)
            pool.release(connection)
            raise
        pool.release(connection)
        return _parsed(reply, part)

    def _call_or_error(
        self, part: list[Check], now_us: int | None, refund: bool, token: str | None = None
    ) -> Evaluation | StorageError:
        try:
            return self._call(part, now_us, refund, token)
        except StorageError as exc:
            return exc

    def evaluate(self, checks: Sequence[Check], *, now_us: int | None = None) -> Evaluation:
        groups = self.groups(checks)
        if len(groups) <= 1:
            return self._call(checks, now_us)
        return across_slots(
            checks, groups, lambda parts, refund: self._run_all(parts, now_us, refund)
        )


def _parsed(reply: Any, part: list[Check]) -> Evaluation | StorageError:
    """The evaluation of ``part`` a script's reply holds, or the error a bad reply is."""
    try:
        return parse_reply(reply, part)
    except StorageError as exc:
        return exc
