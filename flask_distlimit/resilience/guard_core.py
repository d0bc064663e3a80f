"""The guard's state, the failure policy's answers, and the calls beside a request's.

The guard is three modules: this one, the Cluster path (:mod:`~flask_distlimit.resilience.routing`)
and :mod:`~flask_distlimit.resilience.guard`, whose :class:`~flask_distlimit.resilience.guard.Guard`
adds the single-node path and the health report to :class:`GuardCore`. :class:`GuardCore` holds
what both paths read: the storage, the per-node breakers and local fallbacks, the instance count,
the node the storage goes to now (a Sentinel master is followed: :meth:`GuardCore.follow_node`),
the paced log, and the failure policy's answer to checks the storage did not decide
(:meth:`GuardCore.answer_by_policy`). After a refused write
(:class:`~flask_distlimit.errors.StorageFull`), ``"open"`` reads as ``"local"`` until the fallbacks
let go of the keys it decided (:meth:`GuardCore.policy_for`). Calls beside a request's (the
heartbeat, lease records, give-backs, the tag key's read) are made only while their node's breaker
lets calls through, which then hears how they ended; no failure policy and no fallback answers
them: a failed one is counted, logged and skipped (:meth:`GuardCore.open_side_call`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Final, cast

from flask_distlimit._typing import FailurePolicy
from flask_distlimit.core.algorithms import MAX_LIMITS_PER_REQUEST
from flask_distlimit.core.decision import Check
from flask_distlimit.core.policies import validate_policy
from flask_distlimit.errors import (
    StorageBusy,
    StorageError,
    StorageFull,
    StorageResponseError,
)
from flask_distlimit.forks import AfterFork
from flask_distlimit.resilience.breaker import Breaker, BreakerState
from flask_distlimit.resilience.breakers import DEFAULT_NODE, Breakers, report_parts
from flask_distlimit.resilience.fallback import DEFAULT_MAX_KEYS, LocalFallback
from flask_distlimit.resilience.instances import Instances, InstancesSetting
from flask_distlimit.resilience.last_known import LastKnown
from flask_distlimit.resilience.node_fallbacks import NodeFallbacks
from flask_distlimit.resilience.outcome import (
    BUSY_OUTCOME,
    CLOSED_OUTCOME,
    OPEN_OUTCOME,
    Outcome,
)
from flask_distlimit.resilience.storage_log import StorageLog
from flask_distlimit.storage.base import Route, Storage
from flask_distlimit.telemetry.metrics import Metrics, Sinks

log = logging.getLogger("flask_distlimit.guard")  # a public name (docs/failure-modes.md), kept

#: While the breaker of the node a storage goes to is open, the storage is asked at most this
#: often (seconds of the injected clock) whether its node moved (a Sentinel failover).
REDISCOVER_INTERVAL: Final = 1.0
#: The most slot give-backs kept to send again (each is moot once its slot's lease ends; sent
#: again as many to a call as a request's limits: a script call holds Redis)
_MOST_OWED: Final = 1000

_guards: AfterFork[GuardCore] = AfterFork(lambda guard: guard._after_fork())


class GuardCore:
    """The state of one guard and the answers its paths share (see the module docstring); the
    arguments are those of :class:`~flask_distlimit.resilience.guard.Guard`."""

    def __init__(
        self,
        storage: Storage,
        *,
        policy: FailurePolicy = "open",
        fail_max: int = 5,
        reset_timeout: float = 30.0,
        instances: InstancesSetting = 1,
        instances_min: int = 1,
        key_prefix: str = "ratelimit",
        clock: Callable[[], float] = time.monotonic,
        metrics: Metrics | None = None,
        heartbeat_interval: float = 5.0,
        fallback_factory: Callable[[], Storage] | None = None,
        fallback_max_keys: int = DEFAULT_MAX_KEYS,
    ) -> None:
        self.storage = storage
        self.policy: FailurePolicy = validate_policy(policy)
        self.name = f"{storage.scheme or 'storage'}:{key_prefix}"
        #: One circuit breaker per storage node (:mod:`flask_distlimit.resilience.breakers`);
        #: each checks ``fail_max`` and ``reset_timeout`` (the first is made below).
        self.breakers = Breakers(
            name=self.name,
            fail_max=fail_max,
            reset_timeout=reset_timeout,
            clock=clock,
            on_change=self._breaker_changed,
            known=storage.nodes,
        )
        self.fail_max = self.breakers.fail_max
        self.key_prefix = key_prefix
        #: what is told of every decision: the Prometheus metrics and the sinks added beside
        #: them (OpenTelemetry's instruments), or None
        self.metrics: Metrics | None = None
        self._prometheus = metrics
        self._sinks: list[Metrics] = []
        self.clock = clock
        #: The paced log lines about the storage, and the counts ``health()`` shows.
        self.storage_log = StorageLog(
            self.name, policy=self.policy, key_prefix=key_prefix, clock=clock
        )
        #: a refused write was decided locally (until the fallbacks let go of its keys)
        self.refusing_writes = False
        #: slot give-backs the storage did not take (down, or late: their slots may have been
        #: taken after the request ended), sent again with the next call beside a request's
        self.owed: list[Check] = []
        self.instances = Instances(
            instances,
            minimum=instances_min,
            key_prefix=key_prefix,
            interval=heartbeat_interval,
            clock=clock,
        )
        #: What the storage last said was left per key (recorded under policy ``"local"``).
        self.last_known = LastKnown(clock=clock)
        #: checks spread over nodes (Redis Cluster)
        self.routed = storage.routed
        # Settling: one reset timeout, the breaker's own measure of how long a failing storage
        # stays suspect (docs/failure-modes.md, "The bound").
        self.fallbacks = NodeFallbacks(
            functools.partial(
                LocalFallback,
                fallback_factory,
                clock=clock,
                settle=self.breakers.reset_timeout,
                last_known=self.last_known,
                max_keys=fallback_max_keys,
            ),
            storage,
        )
        #: The local fallback (one per node on a Redis Cluster: :attr:`fallbacks`).
        self.fallback = self.fallbacks.default
        #: One node at a time, which may move (Sentinel): followed on failures and while open.
        self.follows = not self.routed and type(storage).node is not Storage.node
        #: The node the storage goes to now, and its breaker (but on a Cluster).
        self.node = storage.node()
        self.node_breaker = self.breakers.get(self.node)
        self._asked_at = -float("inf")  # clock() when the storage was last asked to rediscover
        self._tell_sinks()
        _guards.add(self)

    # -- the parts ---------------------------------------------------------------------------

    @property
    def fallback_active(self) -> bool:
        """Does a local fallback of this process hold counts that still matter (``health()``'s
        ``fallback_active``): while it does, this process's admissions of its keys are held to
        the local share."""
        return any(f.active for f in self.fallbacks.all())

    @property
    def breaker(self) -> Breaker:
        """The breaker of the node the storage goes to now: the only one on a single node or
        memory, the current master's on Sentinel; on a Redis Cluster, that of the primary
        serving the instance heartbeat key (each request uses its groups' own,
        :attr:`breakers`)."""
        return self.breaker_of(self.instances.key)

    def breaker_of(self, key: str) -> Breaker:
        """The breaker of the node serving ``key`` (:attr:`breaker` but on a Redis Cluster)."""
        return self.breakers.get(self._node_of(key))

    def _node_of(self, key: str) -> str:
        if not self.routed:
            return self.node
        return self.storage.route([Check(key, "fixed_window", 1, 1, 0)])[0][0]

    def renewable(self, key: str) -> bool:
        """May a lease of ``key`` be renewed: its node's breaker is closed, and no local fallback
        that counts for it (its node's, or one that counts the key: its node's before a
        failover) still has counts that matter, nor will its node's when its next success
        engages it. A renewal alone is sent as ``open``, which they do not count: after an
        outage the process would take more than its share (or Redis counts a top-up that the
        engaged fallback then refuses)."""
        node = self._node_of(key)
        mine = self.fallbacks.of(node)
        counting = (f.active for f in self.fallbacks.all() if f is mine or f.covers(key))
        return self.breakers.get(node).state == "closed" and not mine.pending and not any(counting)

    def _breaker_changed(self, breaker: str, state: BreakerState | None) -> None:
        # The fallback's counts outlive the breaker: they are handed back key by key, once they
        # no longer matter (flask_distlimit.resilience.fallback), not when the first call succeeds.
        metrics = self.metrics
        if metrics is not None:
            if state is None:  # its node left the topology
                metrics.breaker_removed(breaker)
            else:
                metrics.breaker_changed(breaker, state)

    def use_metrics(self, metrics: Metrics | None) -> None:
        """Start (or, with ``None``, stop) recording Prometheus metrics, e.g. on a guard the
        Flask extension built: ``limiter.state(app).guard.use_metrics(metrics_for())``."""
        self._prometheus = metrics
        self._tell_sinks()

    def add_sink(self, sink: Metrics) -> None:
        """Tell ``sink`` too (a metrics sink beside the Prometheus metrics: OpenTelemetry's)."""
        # one expression, no check-then-append: two threads adding it at once add it once
        self._sinks = [*(s for s in self._sinks if s is not sink), sink]
        self._tell_sinks()

    def remove_sink(self, sink: Metrics) -> None:
        """Stop telling ``sink`` (:meth:`add_sink`)."""
        self._sinks = [s for s in self._sinks if s is not sink]  # copied, as add_sink does
        self._tell_sinks()

    def _tell_sinks(self) -> None:
        sinks = [s for s in (self._prometheus, *self._sinks) if s is not None]
        for sink in sinks:
            for breaker in self.breakers.all():
                sink.breaker_changed(breaker.name, breaker.state)
        # one sink is told directly; several through a fan-out that answers the same methods
        self.metrics = cast(Metrics, Sinks(sinks)) if len(sinks) > 1 else next(iter(sinks), None)

    # -- where the storage goes --------------------------------------------------------------

    def rediscover_due(self) -> bool:
        """True at most once every :data:`REDISCOVER_INTERVAL` seconds (of the clock)."""
        now = self.clock()
        if now - self._asked_at < REDISCOVER_INTERVAL:
            return False
        self._asked_at = now
        return True

    def follow_node(self, *, refresh: bool) -> Breaker | None:
        """The breaker of the node the storage goes to now, when it moved (else ``None``).

        ``refresh`` (the current node's breaker is open) lets the storage ask its topology
        again, at most once every :data:`REDISCOVER_INTERVAL` seconds.
        """
        if refresh and not self.rediscover_due():
            return None  # asked less than a second ago: the open state stays cheap
        node = self.storage.node(refresh)
        if node == self.node:
            return None
        breaker = self.breakers.get(node)
        previous, self.node, self.node_breaker = self.node, node, breaker
        self.breakers.retain((node,))  # one node at a time: the old one's breaker goes
        log.info(
            "Rate-limit storage %s moved from %s to %s: its calls go through %r",
            self.name,
            previous,
            node,
            breaker,
        )
        return breaker

    # -- the failure policy's answers --------------------------------------------------------

    def answer_by_policy(
        self, checks: Sequence[Check], chosen: FailurePolicy, now_us: int | None
    ) -> Outcome:
        """The failure policy ``chosen``'s answer to ``checks`` the storage did not decide."""
        if chosen == "local":
            evaluation = self.fallback.evaluate(
                checks, instances=self.instances.divisor, now_us=now_us
            )
            if self.metrics is not None:
                self.metrics.degraded(checks, evaluation)
            return Outcome(evaluation, degraded=True)
        if self.metrics is not None:
            self.metrics.degraded(checks, None)
        return CLOSED_OUTCOME if chosen == "closed" else OPEN_OUTCOME

    def answer_busy(self, exc: StorageBusy) -> Outcome:
        """A call queued in this process past its budget: a 503 (``Retry-After: 1``), whatever
        the policy; one WARNING line, then at most one a minute."""
        self.storage_log.busy(exc)
        return BUSY_OUTCOME

    def policy_for(self, chosen: FailurePolicy) -> FailurePolicy:
        """The policy that answers a request whose route's (or the default) is ``chosen``, but
        ``"local"`` in place of ``"open"`` while a local fallback holds keys it decided because
        the storage refused a write (:class:`~flask_distlimit.errors.StorageFull`): Redis never
        counted those admissions, so a client must not get its local share and then Redis's
        whole quota in the same window. Asked only after a refused write
        (:attr:`refusing_writes`)."""
        if any(f.holding for f in self.fallbacks.all()):
            return "local" if chosen == "open" else chosen
        self.refusing_writes = False  # every key decided locally was handed back
        return chosen

    def policy_after_refused_write(
        self, exc: StorageFull, chosen: FailurePolicy, checks: Sequence[Check], now_us: int | None
    ) -> FailurePolicy:
        """The policy that answers ``checks`` when the storage refused their write, in place of
        ``chosen``: ``"closed"`` stays (503), any other is ``"local"`` (this process's share,
        never unlimited), where a key no fallback counts yet starts from what the storage says
        is left (read at cost 0: a full Redis answers reads; ``"open"`` kept no earlier
        figure). Logs at WARNING, at most once a minute."""
        self.storage_log.full(exc, self.instances.divisor)
        if chosen == "closed":
            return chosen
        self.refusing_writes = True
        held = self.fallbacks.all()
        unread = [replace(c, cost=0) for c in checks if not any(f.covers(c.key) for f in held)]
        unread = [c for c in unread if not (c.token or c.release or c.meta or c.debt)]
        if unread:  # (none: each key is counted here already)
            with contextlib.suppress(StorageError):  # unread: a whole share, as a new client's
                self.last_known.record(unread, self.storage.evaluate(unread, now_us=now_us))
        return "local"

    # -- what is told to the operator --------------------------------------------------------

    def count_unreadable(self, exc: StorageError, call: str | None = None) -> None:
        """Count and log an error reply (a reply the limiter cannot read) to a request's call,
        or to the side call ``call`` names (a heartbeat, a slot's give-back: skipped): every
        one is counted (``health()``, the ``unreadable_replies_total`` metric), since the
        breaker stays closed and an operator would otherwise see only ``degraded`` decisions;
        all of them log one ERROR line, then at most one a minute. A request is answered by
        the failure policy, never with a 500."""
        self.storage_log.unreadable(exc, call, self.metrics)

    def side_failed(self, what: str, cause: BaseException | str) -> None:
        """Count and log a call beside a request's that did not complete (``what`` names it:
        a concurrency slot's give-back, a refund, a lease's give-back, an after-response
        charge; ``cause`` the error or why it was not made). Such a call ends with its own
        failure: its node's breaker has heard of an outage already (:meth:`Guard.open_side_call
        <flask_distlimit.resilience.guard.Guard.open_side_call>`), and nothing else changes, no
        failure policy answers it and the local fallback is not engaged, so no other request's
        decision moves. Every one is counted (``health()``'s ``side_call_failures``, the
        ``side_call_failures_total`` metric); the first logs one WARNING line, then at most one
        every :data:`~flask_distlimit.resilience.storage_log.SIDE_FAILURE_LOG_INTERVAL`
        seconds, which says how many failed since the previous line."""
        self.storage_log.side_failed(what, cause, self.metrics)

    # -- calls beside the request's ----------------------------------------------------------

    def open_side_call(self, key: str, what: str) -> Callable[[BaseException | None], None] | None:
        """Open a call beside the request's own on ``key`` (``what`` names it in the log): the
        function to tell how it ended, or ``None`` when the breaker of ``key``'s node lets no
        call through now (open, or half-open with its one trial out): skip the call then.

        The function must be called exactly once, with ``None`` when the storage answered,
        else with the exception the call raised. The breaker of the node hears it as it hears
        a request's call (:meth:`Guard.evaluate
        <flask_distlimit.resilience.guard.Guard.evaluate>`), because it is the same evidence:
        the same node, reached the same way within the same timeout.

        - an outage (:class:`~flask_distlimit.errors.StorageUnavailable`: refused, reset,
          timed out, or :class:`~flask_distlimit.errors.StorageMisconfigured`) is a failure
          of that node, counted toward its breaker's ``fail_max``: a dead shard found by a
          slot's give-back or the tag key's read opens its breaker as a request would, and
          only that node's;
        - an answer is a success: it resets the node's count of consecutive failures, and it
          closes a half-open breaker when the side call was its trial (granted by
          :meth:`Breaker.allow <flask_distlimit.resilience.breaker.Breaker.allow>`, so a side call
          never answers for a trial another call holds);
        - an error reply (:class:`~flask_distlimit.errors.StorageResponseError`) is an answer
          too (the node is up: never a failure, so a side call cannot open the breaker of a
          healthy node), counted and logged as :meth:`count_unreadable` says; so is a lost reply
          (:class:`~flask_distlimit.errors.StorageReplyLost`: a fresh connection answered);
        - any other exception frees a trial it held and decides nothing.

        The report takes the breaker's lock at most (no I/O): it never delays the request.
        """
        breaker = self.breaker_of(key)
        if not breaker.allow():
            return None
        return functools.partial(self._heard, breaker, what)

    def _heard(self, breaker: Breaker, what: str, error: BaseException | None) -> None:
        for refused in report_parts({DEFAULT_NODE: breaker}, [DEFAULT_NODE], [error]):
            self.storage_log.refused(refused)
        if isinstance(error, StorageResponseError):
            self.count_unreadable(error, what)

    def side_call(
        self, key: str, call: Callable[[Storage], Sequence[str]], what: str = "a side call"
    ) -> None:
        """One separate, cheap storage call beside the request's own, on ``key`` (the instance
        heartbeat, the lease records), ``what`` naming it in the log: made only while the
        breaker of ``key``'s node lets calls through, which hears how it ended
        (:meth:`open_side_call`); the keys it answers (found holding garbage and replaced) are
        logged. An error reply is an answer (the breaker hears a success) that the request it
        rides on, decided already, never sees: counted and logged as :meth:`count_unreadable`
        says."""
        heard = self.open_side_call(key, what)
        if heard is None:
            return
        try:
            repaired = call(self.storage)
        except StorageError as exc:
            heard(exc)
            if not isinstance(exc, StorageResponseError):  # those are counted as unreadable
                self.side_failed(what, exc)
            return
        except BaseException as exc:
            heard(exc)
            raise
        heard(None)
        if repaired:
            self.storage_log.repaired(repaired)

    def heartbeat_if_due(self) -> None:
        """Refresh this process's instance heartbeat when ``DISTLIMIT_INSTANCES = "auto"`` and
        it is due (after a request the storage answered)."""
        if self.instances.auto and self.instances.due():
            self.side_call(self.instances.key, self.instances.beat, "the instance heartbeat")

    def evaluate_beside(
        self, checks: Sequence[Check], what: str, *, now_us: int | None = None
    ) -> None:
        """Evaluate ``checks`` in a call beside the request's that no failure policy answers
        and whose answer nobody reads (a concurrency slot's give-back), ``what`` naming it in
        the log. It never raises an :class:`Exception` (one the storage should not raise is
        logged at ERROR): it runs after the response is made, at teardown or when a streamed
        response closes, where it would turn a decided request into a 500.

        The checks go in the parts the storage evaluates on their own (:meth:`Storage.route
        <flask_distlimit.storage.base.Storage.route>`'s slot groups on a Redis Cluster, one
        part elsewhere), each node's breaker asked once (:meth:`Breaker.allow
        <flask_distlimit.resilience.breaker.Breaker.allow>`): the parts of a node that lets no call
        through are not sent (no wait on a node known to be down; a slot's lease gives it
        back), the others are, together (one deadline on a Cluster), and each node's breaker
        then hears once how its parts ended, as :meth:`open_side_call` says: an outage if any of
        them met one, else an answer."""
        owed, self.owed = self.owed[-_MOST_OWED:], []
        self.owed, checks = owed[MAX_LIMITS_PER_REQUEST:], [*owed[:MAX_LIMITS_PER_REQUEST], *checks]
        routes = [Route(self.node, list(range(len(checks))))]  # one node: the guard's
        if self.routed:
            routes = self.storage.route(checks)
        trying, _ = self.breakers.admit(node for node, _ in routes)
        live = [(n, [checks[i] for i in indexes]) for n, indexes in routes if n in trying]
        for n, indexes in routes:
            if n not in trying:
                self.owed += [checks[i] for i in indexes if checks[i].release]
        if not live:
            return
        try:
            results = self.storage.evaluate_parts([part for _, part in live], now_us=now_us)
        except BaseException as exc:
            for breaker in trying.values():
                breaker.release()
            if not isinstance(exc, Exception):  # interrupted (a gevent timeout): sent again later
                self.owed += [c for _, part in live for c in part if c.release]
                raise
            log.error("%s failed unexpectedly; it is skipped", what.capitalize(), exc_info=True)
            return
        for refused in report_parts(trying, [node for node, _ in live], results):
            self.storage_log.refused(refused)
        for (_, part), result in zip(live, results, strict=True):
            if isinstance(result, StorageResponseError):
                self.count_unreadable(result, what)
            elif isinstance(result, StorageError):
                self.side_failed(what, result)
                self.owed += [c for c in part if c.release]

    def _after_fork(self) -> None:
        self.storage_log.after_fork()  # every process says it once
        self.breakers._after_fork()
        self.instances._after_fork()
        self.last_known._after_fork()
        self.fallbacks.after_fork()
