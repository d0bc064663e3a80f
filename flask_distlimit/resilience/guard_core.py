"""What every path of a guard shares: its settings and parts, and the failure policy's answers.

:class:`GuardCore` is the part of :class:`~flask_distlimit.resilience.guard.Guard` that the
single-node path, the Cluster path (:mod:`flask_distlimit.resilience.routing`) and the calls beside
a request's (:mod:`flask_distlimit.resilience.side_calls`) read: the storage, the per-node breakers
and local fallbacks, the instance count, the node the storage goes to now (a Sentinel master is
followed: :meth:`GuardCore.follow_node`), the paced log, and the failure policy's answer to checks
the storage did not decide (:meth:`GuardCore.answer_by_policy`). After a refused write
(:class:`~flask_distlimit.errors.StorageFull`), ``"open"`` reads as ``"local"`` until the fallbacks
let go of the keys it decided (:meth:`GuardCore.policy_for`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Final, cast

from flask_distlimit._typing import FailurePolicy
from flask_distlimit.core.decision import Check
from flask_distlimit.core.policies import validate_policy
from flask_distlimit.errors import StorageBusy, StorageError, StorageFull
from flask_distlimit.forks import AfterFork
from flask_distlimit.resilience.breaker import Breaker, BreakerState
from flask_distlimit.resilience.breakers import Breakers
from flask_distlimit.resilience.fallback import DEFAULT_MAX_KEYS
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
from flask_distlimit.storage.base import Storage
from flask_distlimit.telemetry.metrics import Metrics, Sinks

log = logging.getLogger("flask_distlimit.guard")  # a public name (docs/failure-modes.md), kept

#: While the breaker of the node a storage goes to is open, the storage is asked at most this
#: often (seconds of the injected clock) whether its node moved (a Sentinel failover).
REDISCOVER_INTERVAL: Final = 1.0

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
        #: One circuit breaker per storage node (:mod:`flask_distlimit.resilience.breakers`),
        #: which checks ``fail_max`` and ``reset_timeout``.
        self.breakers = Breakers(
            name=self.name,
            fail_max=fail_max,
            reset_timeout=reset_timeout,
            clock=clock,
            on_change=self._breaker_changed,
            known=storage.nodes,
        )
        self.fail_max = self.breakers.fail_max
        self.reset_timeout = self.breakers.reset_timeout
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
            fallback_factory,
            clock=clock,
            settle=self.reset_timeout,
            last_known=self.last_known,
            routed=self.routed,
            route=storage.route,
            max_keys=fallback_max_keys,
        )
        #: The local fallback (one per node on a Redis Cluster: :attr:`fallbacks`).
        self.fallback = self.fallbacks.default
        #: One node at a time, which may move (Sentinel): followed on failures and while open.
        self.follows = not self.routed and type(storage).node is not Storage.node
        #: The node the storage goes to now, and its breaker (but on a Cluster).
        self.node = storage.node()
        self.node_breaker = self.breakers.get(self.node)
        self._asked_at = -float("inf")  # clock() when the storage was last asked to rediscover
        self.heartbeat_check = Check(self.instances.key, "fixed_window", 1, 1, 0)
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
        return self.breaker_of(self.heartbeat_check.key)

    def breaker_of(self, key: str) -> Breaker:
        """The breaker of the node serving ``key`` (:attr:`breaker` but on a Redis Cluster)."""
        if self.routed:
            check = Check(key, "fixed_window", 1, 1, 0)
            return self.breakers.get(self.storage.route([check])[0][0])
        return self.node_breaker

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
        if sink not in self._sinks:
            self._sinks.append(sink)
        self._tell_sinks()

    def remove_sink(self, sink: Metrics) -> None:
        """Stop telling ``sink`` (:meth:`add_sink`)."""
        if sink in self._sinks:
            self._sinks.remove(sink)
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
        self, checks: Sequence[Check], policy: FailurePolicy | None, now_us: int | None
    ) -> Outcome:
        """The failure policy's answer to ``checks`` the storage did not decide."""
        chosen = policy or self.policy
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

    def policy_for(self, policy: FailurePolicy | None) -> FailurePolicy:
        """The policy that answers a request: its route's or the default, but ``"local"`` in
        place of ``"open"`` while a local fallback holds keys it decided because the storage
        refused a write (:class:`~flask_distlimit.errors.StorageFull`): Redis never counted
        those admissions, so a client must not get its local share and then Redis's whole
        quota in the same window. Asked only after a refused write."""
        chosen: FailurePolicy = policy or self.policy
        if not self.refusing_writes:
            return chosen
        if any(f.holding for f in self.fallbacks.all()):
            return "local" if chosen == "open" else chosen
        self.refusing_writes = False  # every key decided locally was handed back
        return chosen

    def policy_after_refused_write(
        self, exc: StorageFull, policy: FailurePolicy | None
    ) -> FailurePolicy:
        """The policy that answers a request whose write the storage refused: ``"closed"``
        stays (503), any other is ``"local"`` (this process's share, never unlimited). Logs
        at WARNING, at most once a minute."""
        chosen: FailurePolicy = policy or self.policy
        if chosen != "closed":
            self.refusing_writes = True
        self.storage_log.full(exc, self.instances.divisor)
        return "closed" if chosen == "closed" else "local"

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

    def _after_fork(self) -> None:
        self.storage_log.after_fork()  # every process says it once
        self.breakers._after_fork()
        self.instances._after_fork()
        self.last_known._after_fork()
        self.fallbacks.after_fork()
