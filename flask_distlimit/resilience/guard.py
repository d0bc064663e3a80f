"""The storage as the extension sees it: every call guarded against outages.

:meth:`Guard.evaluate` asks the node's breaker, makes the one storage call outside any lock and,
on an outage, answers by the failure policy. Promises: never a 500 from the storage; this
process's own queueing (``StorageBusy``) is a 503, not an outage; an error reply is never an
outage; :meth:`Guard.health` never raises. This module holds the single-node path and the health
report; the state, the failure policy's answers and the calls beside a request's are
:class:`~flask_distlimit.resilience.guard_core.GuardCore`'s, the Cluster path is
:mod:`~flask_distlimit.resilience.routing`. Design: docs/design-notes.md, "The guard".
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from flask_distlimit._typing import FailurePolicy
from flask_distlimit.core.decision import Check
from flask_distlimit.errors import (
    StorageBusy,
    StorageError,
    StorageFull,
    StorageMisconfigured,
    StorageReplyLost,
    StorageResponseError,
    StorageUnavailable,
)
from flask_distlimit.resilience.breaker import Breaker
from flask_distlimit.resilience.breakers import DEFAULT_NODE, worst
from flask_distlimit.resilience.guard_core import GuardCore, log
from flask_distlimit.resilience.outcome import Outcome
from flask_distlimit.resilience.routing import evaluate_routed
from flask_distlimit.resilience.storage_log import one_line
from flask_distlimit.telemetry.metrics import storage_outcome


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
        chosen = policy or self.policy
        if self.refusing_writes:
            chosen = self.policy_for(chosen)
        if self.routed:
            return evaluate_routed(self, checks, chosen, now_us)
        breaker = self.node_breaker
        fallback = self.fallback
        if chosen == "local" and fallback.holding and breaker.state == "closed":
            refusal = fallback.refusal(checks, instances=self.instances.divisor, now_us=now_us)
            if refusal is not None:  # over this process's share while failures go on
                if self.metrics is not None:
                    self.metrics.degraded(checks, refusal)
                return Outcome(refusal, degraded=True)
        if not (breaker.calm or breaker.allow()):
            moved = self.follow_node(refresh=True) if self.follows else None
            if moved is None or not moved.allow():
                return self.answer_by_policy(checks, chosen, now_us)
            breaker = moved
        metrics = self.metrics
        started = time.perf_counter() if metrics is not None else 0.0
        try:
            evaluation = self.storage.evaluate(checks, now_us=now_us)
        except StorageFull as exc:
            breaker.success()  # the node answered: not an outage
            if metrics is not None:
                metrics.storage_call(time.perf_counter() - started)
            chosen = self.policy_after_refused_write(exc, chosen, checks, now_us)
            return self.answer_by_policy(checks, chosen, now_us)
        except StorageUnavailable as exc:
            if metrics is not None:
                metrics.storage_call(time.perf_counter() - started, storage_outcome(exc))
            if self.follows and self.node == DEFAULT_NODE:
                # The storage had not named its node yet (a Sentinel master before the first
                # connection): the outage is that of the node it names now.
                breaker = self.follow_node(refresh=False) or breaker
            if isinstance(exc, StorageReplyLost):
                breaker.success()  # a fresh connection answered: not an outage
                if not fallback.holding and chosen == "local":
                    # Redis is up: this one request is admitted, and the local shares do not
                    # take over every key for a reset timeout (docs/failure-modes.md).
                    return self.answer_by_policy(checks, "open", now_us)
            else:
                breaker.failure(exc)
            if isinstance(exc, StorageMisconfigured):
                self.storage_log.refused(exc)
            if self.follows:
                self.follow_node(refresh=False)  # the failed call may have found a new master
            return self.answer_by_policy(checks, chosen, now_us)
        except StorageResponseError as exc:
            breaker.success()  # the store answered: not an outage
            if metrics is not None:
                metrics.storage_call(time.perf_counter() - started, "error")
            self.count_unreadable(exc)
            return self.answer_by_policy(checks, chosen, now_us)
        except StorageBusy as exc:  # this process's load: the breaker hears nothing
            breaker.release()
            return self.answer_busy(exc)
        except BaseException:
            breaker.release()
            raise
        if not breaker.calm:
            breaker.success()
        outcome: Outcome | None = None
        if chosen == "local":
            self.last_known.record(checks, evaluation)
            if evaluation.allowed:
                refused = fallback.charge(
                    checks, evaluation, instances=self.instances.divisor, now_us=now_us
                )
                if refused is not None:  # over this process's share while failures go on
                    outcome = Outcome(refused, degraded=True)
        if metrics is not None:
            if outcome is None:
                metrics.evaluated(checks, evaluation, seconds=time.perf_counter() - started)
            else:
                metrics.storage_call(time.perf_counter() - started)
                metrics.degraded(checks, outcome.evaluation)
        if evaluation.repaired_keys:
            self.storage_log.repaired(evaluation.repaired_keys)
        if self.instances.auto:  # DISTLIMIT_INSTANCES = "auto": a heartbeat may be due
            self.heartbeat_if_due()
        return Outcome(evaluation) if outcome is None else outcome

    # -- inspection --------------------------------------------------------------------------

    def health(self) -> dict[str, object]:
        """Storage ping latency, breaker states, scripts loaded, instances seen; never raises.

        The storage is checked even while a breaker is open, without moving it: a PING, whether
        the scripts are loaded, one evaluation of cost 0 (consumes nothing, writes no key). Any
        failure gives ``ok: False``, its cause in one line in ``error`` and its class name in
        ``error_type``. ``breaker``, ``breaker_failures`` and ``breaker_open_seconds`` are the
        worst node's (:func:`~flask_distlimit.resilience.breakers.worst`). Every entry is
        documented in docs/failure-modes.md, "Observability".
        """
        storage = self.storage
        # What is evaluated: cost 0 consumes nothing and writes no key, but needs what a request
        # needs (EVALSHA, the script's commands, access to keys under the prefix).
        probe = Check(f"{self.key_prefix}:{{health}}:probe:fixed_window", "fixed_window", 1, 1, 0)
        error: str | None = None
        error_type: str | None = None
        latency: float | None = None
        loaded: bool | None = None
        try:
            latency = storage.ping()
            loaded = storage.scripts_loaded()
            storage.evaluate([probe])
        except StorageError as exc:
            error, error_type = one_line(str(exc) or type(exc).__name__), type(exc).__name__
        except Exception as exc:  # a broken storage must not break the health check
            log.debug("Health check of %s failed", self.name, exc_info=True)
            error = one_line(f"unexpected {type(exc).__name__} from the storage: {exc}")
            error_type = type(exc).__name__
        if self.follows:
            self.follow_node(refresh=False)  # name the master the storage found, if it connected
        self.breakers.prune()
        current = self.breaker  # made if new: the heartbeat key's node is always shown
        by_node = self.breakers.by_node()
        figures = {node: _figures(b) for node, b in by_node.items()}
        shown = _figures(worst(list(by_node.values())) or current)
        return {
            "ok": error is None and shown["state"] == "closed",
            "storage": storage.scheme,
            "latency_ms": None if latency is None else round(latency * 1000, 3),
            "error": error,
            "error_type": error_type,
            "scripts_loaded": loaded,
            "breaker": shown["state"],
            "breakers": {node: f["state"] for node, f in figures.items()},
            "breaker_nodes": figures,
            "breaker_failures": shown["failures"],
            "breaker_open_seconds": shown["open_seconds"],
            "policy": self.policy,
            "instances": self.instances.setting,
            "instances_min": self.instances.minimum,
            "instances_seen": self.instances.seen,
            "fallback_divisor": self.instances.divisor,
            "fallback_active": self.fallback_active,
            "fallback_held_keys": sum(f.held() for f in self.fallbacks.all()),
            "unreadable_replies": self.storage_log.unreadable_count,
            "unreadable_last": self.storage_log.unreadable_last,
            "side_call_failures": self.storage_log.side_failures,
            "side_call_last": self.storage_log.side_last,
        }


def _figures(breaker: Breaker) -> dict[str, object]:
    """One node's line of ``health()["breaker_nodes"]``: its state, consecutive failures, and
    how long it has been open, to the millisecond (``None``: closed)."""
    opened_for = breaker.opened_for()
    open_seconds = None if opened_for is None else round(opened_for, 3)
    return {"state": breaker.state, "failures": breaker.failures, "open_seconds": open_seconds}
