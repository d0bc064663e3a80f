"""The storage as the extension sees it: every call guarded against outages.

:meth:`Guard.evaluate` asks the node's breaker, makes the one storage call outside any lock and,
on an outage, answers by the failure policy. Promises: never a 500 from the storage; this
process's own queueing (``StorageBusy``) is a 503, not an outage; an error reply is never an
outage; :meth:`Guard.health` never raises. Design: docs/design-notes.md, "The guard".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from flask_distlimit._typing import FailurePolicy
from flask_distlimit.core.decision import Check
from flask_distlimit.errors import (
    StorageBusy,
    StorageFull,
    StorageMisconfigured,
    StorageReplyLost,
    StorageResponseError,
    StorageUnavailable,
)
from flask_distlimit.resilience.breakers import DEFAULT_NODE
from flask_distlimit.resilience.guard_core import GuardCore
from flask_distlimit.resilience.guard_health import health
from flask_distlimit.resilience.outcome import OPEN_OUTCOME, Outcome
from flask_distlimit.resilience.routing import evaluate_routed
from flask_distlimit.resilience.side_calls import (
    SideReport,
    evaluate_beside,
    heartbeat_if_due,
    open_side_call,
    side_call,
)
from flask_distlimit.storage.base import Storage
from flask_distlimit.telemetry.otel import storage_outcome

__all__ = ["FailurePolicy", "Guard"]


class Guard(GuardCore):
    """Calls the storage through a circuit breaker and applies the failure policy on outages.

    ``clock`` (monotonic seconds) drives the breaker's reset timeout, the heartbeat interval, the
    fallback's settling and the pace of the misconfiguration log; tests inject a fake one.
    ``instances_min`` (``DISTLIMIT_INSTANCES_MIN``) is the smallest fallback divisor. ``metrics``
    (:func:`flask_distlimit.telemetry.metrics.metrics_for`) is optional.
    ``fallback_factory`` builds the in-process store of the ``local`` policy (default: memory),
    ``fallback_max_keys`` caps the keys it counts (``DISTLIMIT_FALLBACK_MAX_KEYS``).
    ``policy``, ``fail_max``, ``reset_timeout`` (the breakers' settings, checked by
    :mod:`flask_distlimit.resilience.breaker`), ``instances`` and ``key_prefix`` are the
    ``DISTLIMIT_*`` settings of those names; ``heartbeat_interval`` paces the instance heartbeat.
    The constructor is :class:`~flask_distlimit.resilience.guard_core.GuardCore`'s.
    """

    # -- the request path --------------------------------------------------------------------

    def evaluate(
        self,
        checks: Sequence[Check],
        *,
        policy: FailurePolicy | None = None,
        now_us: int | None = None,
    ) -> Outcome:
        """Evaluate ``checks``; ``policy`` overrides the default for one route."""
        if self.refusing_writes:
            policy = self.policy_for(policy)
        if self.routed:
            return evaluate_routed(self, checks, policy, now_us)
        breaker = self.node_breaker
        fallback = self.fallback
        if (policy or self.policy) == "local" and fallback.holding and breaker.state == "closed":
            refusal = fallback.refusal(checks, instances=self.instances.divisor, now_us=now_us)
            if refusal is not None:  # over this process's share while failures go on
                if self.metrics is not None:
                    self.metrics.degraded(checks, refusal)
                return Outcome(refusal, degraded=True)
        if not breaker.allow():
            moved = self.follow_node(refresh=True) if self.follows else None
            if moved is None or not moved.allow():
                return self.answer_by_policy(checks, policy, now_us)
            breaker = moved
        metrics = self.metrics
        started = time.perf_counter() if metrics is not None else 0.0
        try:
            evaluation = self.storage.evaluate(checks, now_us=now_us)
        except StorageFull as exc:
            breaker.success()  # the node answered: not an outage
            if metrics is not None:
                metrics.storage_call(time.perf_counter() - started)
            return self.answer_by_policy(
                checks, self.policy_after_refused_write(exc, policy), now_us
            )
        except StorageUnavailable as exc:
            if metrics is not None:
                metrics.storage_call(time.perf_counter() - started, storage_outcome(exc))
            if self.follows and self.node == DEFAULT_NODE:
                # The storage had not named its node yet (a Sentinel master before the first
                # connection): the outage is that of the node it names now.
                breaker = self.follow_node(refresh=False) or breaker
            if isinstance(exc, StorageReplyLost):
                breaker.success()  # a fresh connection answered: not an outage
                if not fallback.holding and (policy or self.policy) == "local":
                    # Redis is up: this one request is admitted, and the local shares do not
                    # take over every key for a reset timeout (docs/failure-modes.md).
                    if metrics is not None:
                        metrics.degraded(checks, None)
                    return OPEN_OUTCOME
            else:
                breaker.failure(exc)
            if isinstance(exc, StorageMisconfigured):
                self.storage_log.refused(exc)
            if self.follows:
                self.follow_node(refresh=False)  # the failed call may have found a new master
            return self.answer_by_policy(checks, policy, now_us)
        except StorageResponseError as exc:
            breaker.success()  # the store answered: not an outage
            if metrics is not None:
                metrics.storage_call(time.perf_counter() - started, "error")
            self.count_unreadable(exc)
            return self.answer_by_policy(checks, policy, now_us)
        except StorageBusy as exc:  # this process's load: the breaker hears nothing
            breaker.release()
            return self.answer_busy(exc)
        except BaseException:
            breaker.release()
            raise
        breaker.success()
        outcome: Outcome | None = None
        if (policy or self.policy) == "local":
            self.last_known.record(checks, evaluation)
            if evaluation.allowed:
                refused = fallback.charge(
                    checks, evaluation, instances=self.instances.divisor, now_us=now_us
                )
                if refused is not None:  # over this process's share while failures go on
                    outcome = Outcome(refused, degraded=True)
        if metrics is not None:
            metrics.storage_call(time.perf_counter() - started)
            if outcome is None:
                metrics.evaluated(checks, evaluation)
            else:
                metrics.degraded(checks, outcome.evaluation)
        if evaluation.repaired_keys:
            self.storage_log.repaired(evaluation.repaired_keys)
        if self.instances.auto:  # DISTLIMIT_INSTANCES = "auto": a heartbeat may be due
            heartbeat_if_due(self)
        return Outcome(evaluation) if outcome is None else outcome

    # -- calls beside the request's ----------------------------------------------------------

    def open_side_call(self, key: str, what: str) -> SideReport | None:
        """Open a call beside the request's own on ``key`` (``what`` names it in the log): the
        function to tell how it ended, or ``None`` when the breaker of ``key``'s node lets no
        call through now (open, or half-open with its one trial out): skip the call then.

        The function must be called exactly once, with ``None`` when the storage answered,
        else with the exception the call raised. The breaker of the node hears it as it hears
        a request's call (:meth:`evaluate`), because it is the same evidence: the same node,
        reached the same way within the same timeout.

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
        return open_side_call(self, key, what)

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
        side_call(self, key, call, what)

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
        evaluate_beside(self, checks, what, now_us)

    # -- inspection --------------------------------------------------------------------------

    def health(self) -> dict[str, object]:
        """Storage ping latency, breaker states, scripts loaded, instances seen; never raises
        (:mod:`flask_distlimit.resilience.guard_health` says what each entry means)."""
        return health(self)
