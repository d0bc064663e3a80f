"""The storage as the extension sees it: every call guarded against outages.

:class:`Guard` is the one seam between the request path and the storage. Each request's checks
go through :meth:`Guard.evaluate`, which

1. asks the circuit breaker (:mod:`flask_distlimit.resilience.breaker`) of the storage node the
checks go
   to whether to try the storage at all: one breaker per node
   (:mod:`flask_distlimit.resilience.breakers`), i.e. one for a single node or memory, one for the
   master a Sentinel names (a failover moves to the new master's breaker, closed, without waiting
   out the old one's reset timeout), one per primary on a Redis Cluster;
2. makes the one storage call (outside any lock: concurrent requests' calls overlap);
3. on an outage (:class:`~flask_distlimit.errors.StorageUnavailable`) counts it and applies the
   failure policy (``DISTLIMIT_FAILURE_POLICY``, or a route's own); a storage that refuses the
   limiter (:class:`~flask_distlimit.errors.StorageMisconfigured`: NOPERM, WRONGPASS, a bad
   database index, an unknown command) is such an outage, and is logged at ERROR, naming the
   cause and the fix, at most once every :data:`MISCONFIGURED_LOG_INTERVAL` seconds (of the
   injected clock) per guard, i.e. per app and process:

   - ``"open"``: allow, marked degraded;
   - ``"closed"``: refuse: the extension turns ``unavailable`` into a problem+json 503;
   - ``"local"``: decide in-process at each limit's per-instance share
     (:mod:`flask_distlimit.resilience.fallback`, divisor from
     :mod:`flask_distlimit.resilience.instances`), degraded;

   a call that queued in this process past its budget
   (:class:`~flask_distlimit.errors.StorageBusy`: this process's load, not the storage's
   health) is not an outage: its breaker is not told and no policy applies; it is answered
   503 with ``Retry-After: 1``;

4. under policy ``"local"``, when the storage answered: remembers what it said was left per key
   (:mod:`flask_distlimit.resilience.last_known`, where a key's local budget starts) and, while the
   fallback still holds some of the request's keys, counts the request against this process's share
   too, so that a storage failing every other call cannot double the limit
   (:meth:`~flask_distlimit.resilience.fallback.LocalFallback.charge`);
5. when healthy and due, refreshes this process's instance heartbeat (``DISTLIMIT_INSTANCES =
   "auto"``), and logs keys the storage found corrupt and repaired (the heartbeat's included).

On a Redis Cluster (a ``routed`` storage) the checks are grouped per slot and each group goes to
its primary's breaker: the groups whose breaker is open (or whose node fails during the call)
get the failure policy, the others are decided by Redis in the same request. All-or-nothing
then holds as on one node: a request refused by the policy, by the local fallback or by Redis
spends nothing, the units a Redis group already consumed being given back (the script's refund
mode; best effort, as between slot groups: a refund that fails leaves them consumed until the
window passes). Under ``"closed"`` a request with a check on an open breaker is answered 503
before any Redis call, so nothing is spent on the live shards. Under ``"open"`` the live groups
still count the request (their limits stay exact) and can deny it. While some primary's breaker
is open, the slot map is reloaded at most every :data:`REDISCOVER_INTERVAL` seconds, so a replica
promoted in its place gets the slots and a closed breaker of its own.

A refused write (:class:`~flask_distlimit.errors.StorageFull`: Redis out of memory under
``noeviction``, or ``MISCONF``) is an answer, not an outage: the node's breaker hears a success
(another client filling Redis must not switch the limiter to its policy for everyone), and the
request is decided at the local share whatever the policy (``"closed"``: 503). Under ``"open"``,
requests keep being counted at the local share while the fallback holds keys it decided so
(:meth:`Guard._chosen`), so nobody gets a share and then a full quota in one window. Logged at
WARNING at most once every :data:`MISCONFIGURED_LOG_INTERVAL` seconds.

An error reply (:class:`~flask_distlimit.errors.StorageResponseError`: a bug, data the limiter does
not expect, a Redis-compatible server that runs Lua otherwise) is never counted as an outage (the
store answered) and never a 500: the failure policy answers the checks it concerns, and one
ERROR line a minute names it.

:meth:`Guard.health` never raises: whatever the storage does, it reports ``ok: False`` and the
cause in ``error``.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from flask_distlimit._typing import FailurePolicy
from flask_distlimit.core.decision import Check, Decision, Evaluation
from flask_distlimit.core.policies import validate_policy
from flask_distlimit.errors import (
    ConfigurationError,
    StorageBusy,
    StorageError,
    StorageFull,
    StorageMisconfigured,
    StorageReplyLost,
    StorageResponseError,
    StorageUnavailable,
)
from flask_distlimit.forks import AfterFork
from flask_distlimit.frozen import slot_setters
from flask_distlimit.resilience.breaker import Breaker, BreakerState
from flask_distlimit.resilience.breakers import DEFAULT_NODE, Breakers, worst
from flask_distlimit.resilience.fallback import LocalFallback
from flask_distlimit.resilience.instances import Instances, InstancesSetting
from flask_distlimit.resilience.last_known import LastKnown
from flask_distlimit.storage.base import Storage
from flask_distlimit.telemetry.metrics import Metrics
from flask_distlimit.telemetry.otel import storage_outcome

__all__ = [
    "MISCONFIGURED_LOG_INTERVAL",
    "REDISCOVER_INTERVAL",
    "SIDE_FAILURE_LOG_INTERVAL",
    "FailurePolicy",
    "Guard",
    "Outcome",
    "SideReport",
]

log = logging.getLogger("flask_distlimit.guard")  # a public name (docs/failure-modes.md), kept

#: Seconds between two ERROR lines about a storage that refuses the limiter (per guard).
MISCONFIGURED_LOG_INTERVAL: Final = 60.0

#: Seconds between two WARNING lines about calls beside a request's that failed (per guard).
SIDE_FAILURE_LOG_INTERVAL: Final = 60.0

#: While the breaker of the node a storage goes to is open, the storage is asked at most this
#: often (seconds of the injected clock) whether its node moved (a Sentinel failover).
REDISCOVER_INTERVAL: Final = 1.0

#: How a call beside the request's ended, told to its node's breaker (:meth:`Guard.beside`):
#: ``None`` when the storage answered, else the exception the call raised.
SideReport = Callable[[BaseException | None], None]


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the guarded storage call decided.

    - ``evaluation``: the decisions (from the storage, or from the local fallback when degraded);
      ``None`` when the storage failed under policy ``open`` or ``closed``.
    - ``degraded``: the storage failed; the answer comes from the failure policy.
    - ``unavailable``: policy ``closed`` and the storage failed: answer 503.
    - ``busy``: (with ``unavailable``) this process's calls queued past their budget
      (:class:`~flask_distlimit.errors.StorageBusy`): answer 503, ``Retry-After: 1``.
    """

    evaluation: Evaluation | None
    degraded: bool = False
    unavailable: bool = False
    busy: bool = False

    def __init__(
        self,
        evaluation: Evaluation | None,
        degraded: bool = False,
        unavailable: bool = False,
        busy: bool = False,
    ) -> None:  # frozen, at a plain class's cost (flask_distlimit.frozen)
        _outcome_evaluation(self, evaluation)
        _outcome_degraded(self, degraded)
        _outcome_unavailable(self, unavailable)
        _outcome_busy(self, busy)


_outcome_evaluation, _outcome_degraded, _outcome_unavailable, _outcome_busy = slot_setters(
    Outcome, "evaluation", "degraded", "unavailable", "busy"
)

_OPEN_OUTCOME: Final = Outcome(None, degraded=True)
_CLOSED_OUTCOME: Final = Outcome(None, degraded=True, unavailable=True)
#: This process's load, whatever the policy (never unlimited admission): a 503 to retry soon.
_BUSY_OUTCOME: Final = Outcome(None, degraded=True, unavailable=True, busy=True)

_guards: AfterFork[Guard] = AfterFork(lambda guard: guard._after_fork())


class Guard:
    """Calls the storage through a circuit breaker and applies the failure policy on outages.

    ``clock`` (monotonic seconds) drives the breaker's reset timeout, the heartbeat interval, the
    fallback's settling and the pace of the misconfiguration log; tests inject a fake one.
    ``instances_min`` (``DISTLIMIT_INSTANCES_MIN``) is the smallest fallback divisor. ``metrics``
    (:func:`flask_distlimit.telemetry.metrics.metrics_for`) is optional.
    ``fallback_factory`` builds the in-process store of the ``local`` policy (default: memory).
    """

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
    ) -> None:
        self.storage = storage
        self.policy: FailurePolicy = validate_policy(policy)
        if not isinstance(fail_max, int) or isinstance(fail_max, bool) or fail_max < 1:
            raise ConfigurationError(
                f"DISTLIMIT_BREAKER_FAIL_MAX={fail_max!r}: use a positive integer (consecutive "
                "storage outages that open the circuit breaker; default 5)."
            )
        if not isinstance(reset_timeout, int | float) or reset_timeout < 0:
            raise ConfigurationError(
                f"DISTLIMIT_BREAKER_RESET_TIMEOUT={reset_timeout!r}: use a number of seconds >= 0 "
                "(how long the breaker stays open before a trial call; default 30)."
            )
        self.fail_max = fail_max
        self.reset_timeout = float(reset_timeout)
        self.key_prefix = key_prefix
        self.metrics = metrics
        #: given what use_metrics is handed, answers the sink to keep
        #: (flask_distlimit.telemetry.otel keeps its instruments beside the Prometheus metrics with
        #: it)
        self.compose_metrics: Callable[[Metrics | None], Metrics | None] | None = None
        #: the quota leases this process holds through this guard, by key: set by the app's
        #: :class:`~flask_distlimit.resilience.leases.Leases` when it has some
        self.held_leases: Callable[[], dict[str, dict[str, object]]] = dict
        self._clock = clock
        self._log_lock = threading.Lock()
        self._refusal_logged_at: float | None = None  # clock() of the last ERROR line
        self._busy_logged_at: float | None = None  # the same, for StorageBusy's WARNING
        self._unreadable_logged_at: float | None = None  # the same, for error replies
        self._full_logged_at: float | None = None  # the same, for refused writes
        self._full = False  # a refused write was decided locally (until the fallback lets go)
        self._unreadable_count = 0  # error replies answered by the policy (health())
        self._unreadable_last: str | None = None  # the last one, in one line
        self._side_failures = 0  # calls beside a request's that failed (side_failed)
        self._side_unlogged = 0  # ... since the last WARNING line about them
        self._side_logged_at: float | None = None  # clock() of that line
        self._side_last: str | None = None  # the last one, in one line
        # What health() evaluates: cost 0 consumes nothing and writes no key, but needs what a
        # request needs (EVALSHA, the script's commands, access to keys under the prefix).
        self._probe = Check(f"{key_prefix}:{{health}}:probe:fixed_window", "fixed_window", 1, 1, 0)
        self.name = f"{storage.scheme or 'storage'}:{key_prefix}"
        self.instances = Instances(
            instances,
            minimum=instances_min,
            key_prefix=key_prefix,
            interval=heartbeat_interval,
            clock=clock,
        )
        #: What the storage last said was left per key (recorded under policy ``"local"``).
        self.last_known = LastKnown(clock=clock)
        # Settling: one reset timeout, the breaker's own measure of how long a failing storage
        # stays suspect (docs/failure-modes.md, "The bound").
        self._fallback_factory = fallback_factory
        #: The local fallback (one per node on a Redis Cluster: :meth:`fallback_of`).
        self.fallback = self._new_fallback()
        # Copied on write (under _fallbacks_lock): request threads iterate it without a lock.
        self._fallbacks: dict[str, LocalFallback] = {}
        self._fallbacks_lock = threading.Lock()
        #: One circuit breaker per storage node (:mod:`flask_distlimit.resilience.breakers`).
        self.breakers = Breakers(
            name=self.name,
            fail_max=fail_max,
            reset_timeout=self.reset_timeout,
            clock=clock,
            on_change=self._breaker_changed,
            known=storage.nodes,
        )
        self._routed = storage.routed  # checks spread over nodes (Redis Cluster)
        # One node at a time, which may move (Sentinel): followed on failures and while open.
        self._follows = not self._routed and type(storage).node is not Storage.node
        self._node = storage.node()
        self._breaker = self.breakers.get(self._node)
        self._asked_at = -float("inf")  # clock() when the storage was last asked to rediscover
        self._heartbeat_check = Check(self.instances.key, "fixed_window", 1, 1, 0)
        self.use_metrics(metrics)
        _guards.add(self)

    def _new_fallback(self) -> LocalFallback:
        return LocalFallback(
            self._fallback_factory,
            clock=self._clock,
            settle=self.reset_timeout,
            last_known=self.last_known,
        )

    def fallback_of(self, node: str) -> LocalFallback:
        """The local fallback of the checks that go to ``node``: on a storage whose checks are
        routed to nodes of their own (Redis Cluster), each node fails, engages its fallback and
        settles on its own, so the keys of a healthy shard are never counted locally because
        another shard failed; elsewhere, :attr:`fallback`."""
        if not self._routed:
            return self.fallback
        fallback = self._fallbacks.get(node)
        if fallback is None:
            with self._fallbacks_lock:
                fallback = self._fallbacks.get(node)
                if fallback is None:
                    fallback = self._new_fallback()
                    self._fallbacks = {**self._fallbacks, node: fallback}
        return fallback

    def fallbacks_for(self, checks: Sequence[Check]) -> list[tuple[LocalFallback, list[Check]]]:
        """``checks`` split by the fallback that decides them (one part but on a Cluster)."""
        if not self._routed:
            return [(self.fallback, list(checks))]
        return [
            (self.fallback_of(node), [checks[i] for i in indexes])
            for node, indexes in self.storage.route(checks)
        ]

    def _fallback_for(self, key: str, node: str) -> LocalFallback:
        """The fallback that counts ``key``: one that counts it already (its slot may have
        moved since: a replica promoted in place of the dead primary knows nothing of the
        admissions decided locally), else ``node``'s."""
        for fallback in self._fallbacks.values():
            if fallback.holding and fallback.covers(key):
                return fallback
        return self.fallback_of(node)

    def _fallbacks_all(self) -> list[LocalFallback]:
        return [self.fallback, *self._fallbacks.values()]

    @property
    def fallback_active(self) -> bool:
        """Does a local fallback of this process hold counts that still matter (``health()``'s
        ``fallback_active``): while it does, this process's admissions of its keys are held to
        the local share."""
        return any(f.active for f in self._fallbacks_all())

    # -- the request path --------------------------------------------------------------------

    def evaluate(
        self,
        checks: Sequence[Check],
        *,
        policy: FailurePolicy | None = None,
        now_us: int | None = None,
    ) -> Outcome:
        """Evaluate ``checks``; ``policy`` overrides the default for one route."""
        if self._full:
            policy = self._chosen(policy)
        if self._routed:
            return self._evaluate_routed(checks, policy, now_us)
        breaker = self._breaker
        fallback = self.fallback
        if fallback.holding and breaker.state == "closed" and (policy or self.policy) == "local":
            refusal = fallback.refusal(checks, instances=self.instances.divisor, now_us=now_us)
            if refusal is not None:  # over this process's share while failures go on
                if self.metrics is not None:
                    self.metrics.degraded(checks, refusal)
                return Outcome(refusal, degraded=True)
        if not breaker.allow():
            moved = self._follow(refresh=True) if self._follows else None
            if moved is None or not moved.allow():
                return self._degraded(checks, policy, now_us)
            breaker = moved
        metrics = self.metrics
        started = time.perf_counter() if metrics is not None else 0.0
        try:
            evaluation = self.storage.evaluate(checks, now_us=now_us)
        except StorageFull as exc:
            breaker.success()  # the node answered: not an outage
            if metrics is not None:
                metrics.storage_call(time.perf_counter() - started)
            return self._degraded(checks, self._refused_write(exc, policy), now_us)
        except StorageUnavailable as exc:
            if metrics is not None:
                metrics.storage_call(time.perf_counter() - started, storage_outcome(exc))
            if self._follows and self._node == DEFAULT_NODE:
                # The storage had not named its node yet (a Sentinel master before the first
                # connection): the outage is that of the node it names now.
                breaker = self._follow(refresh=False) or breaker
            if isinstance(exc, StorageReplyLost):
                breaker.success()  # a fresh connection answered: not an outage
                if not fallback.holding and (policy or self.policy) == "local":
                    # Redis is up: this one request is admitted, and the local shares do not
                    # take over every key for a reset timeout (docs/failure-modes.md).
                    if metrics is not None:
                        metrics.degraded(checks, None)
                    return _OPEN_OUTCOME
            else:
                breaker.failure(exc)
            if isinstance(exc, StorageMisconfigured):
                self._refused(exc)
            if self._follows:
                self._follow(refresh=False)  # the failed call may have found a new master
            return self._degraded(checks, policy, now_us)
        except StorageResponseError as exc:
            breaker.success()  # the store answered: not an outage
            if metrics is not None:
                metrics.storage_call(time.perf_counter() - started, "error")
            self.unreadable(exc)
            return self._degraded(checks, policy, now_us)
        except StorageBusy as exc:  # this process's load: the breaker hears nothing
            breaker.release()
            return self._busy(exc)
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
            self._repaired(evaluation.repaired_keys)
        if self.instances.auto and self.instances.due():
            self._heartbeat()
        return Outcome(evaluation) if outcome is None else outcome

    def _evaluate_routed(
        self, checks: Sequence[Check], policy: FailurePolicy | None, now_us: int | None
    ) -> Outcome:
        """:meth:`evaluate` on a storage whose groups of checks go to nodes of their own."""
        chosen: FailurePolicy = policy or self.policy
        storage = self.storage
        routes = storage.route(checks)
        trying, blocked = self._gate(routes)
        if blocked and self._rediscover_due():
            # A replica may have been promoted in place of a dead primary: refresh the slot map
            # (at most once a second) so that its slots go to the new primary's breaker.
            for breaker in trying.values():
                breaker.release()
            storage.node(refresh=True)
            routes = storage.route(checks)
            trying, blocked = self._gate(routes)
        if blocked and chosen == "closed":  # answered 503 whatever the live nodes say
            for breaker in trying.values():
                breaker.release()
            return self._degraded(checks, policy, now_us)
        node_of = {i: node for node, indexes in routes for i in indexes}
        live = [(node, indexes) for node, indexes in routes if node in trying]
        parts = [[checks[i] for i in indexes] for _, indexes in live]
        failed = [i for node, indexes in routes if node in blocked for i in indexes]
        metrics = self.metrics
        results: list[Evaluation | StorageError] = []
        if parts:
            started = time.perf_counter()
            try:
                results = storage.evaluate_parts(parts, now_us=now_us)
            except BaseException:
                for breaker in trying.values():
                    breaker.release()
                raise
            if metrics is not None:
                failed_parts = [r for r in results if isinstance(r, StorageError)]
                metrics.storage_call(
                    time.perf_counter() - started,
                    storage_outcome(failed_parts[0] if failed_parts else None),
                )
        # Each node's breaker hears once: an outage if any of its groups met one.
        self._tell(trying, [node for node, _ in live], results)
        full = next((r for r in results if isinstance(r, StorageFull)), None)
        if full is not None:  # decided at the local share ("closed": 503), never "open"
            chosen = self._refused_write(full, chosen)
        decisions: list[Decision | None] = [None] * len(checks)
        repaired: list[str] = []
        spent: list[int] = []  # indexes of checks a group admitted and consumed
        answered: list[int] = []
        denied = False
        busy: StorageBusy | None = None
        for (_, indexes), part, result in zip(live, parts, results, strict=True):
            if isinstance(result, StorageUnavailable):
                failed.extend(indexes)
            elif isinstance(result, StorageBusy):  # load: the whole request is refused
                busy = result
            elif isinstance(result, StorageError):  # an error reply: the policy decides these
                self.unreadable(result)
                failed.extend(indexes)
            else:
                decisions_of_part = result.decisions
                for i, decision in zip(indexes, decisions_of_part, strict=True):
                    decisions[i] = decision
                repaired.extend(result.repaired_keys)
                answered.extend(indexes)
                if not result.allowed:
                    denied = True
                elif any(c.cost for c in part):
                    # a shadow check that would deny was not charged: nothing to give back
                    spent.extend(
                        i
                        for i, d in zip(indexes, decisions_of_part, strict=True)
                        if not d.shadow_denied
                    )
        if repaired:
            self._repaired(repaired)
        if busy is not None:
            self._give_back(checks, spent, decisions, now_us)
            return self._busy(busy)
        if not failed:
            # one group: its node's clock (the window a leased unit was taken in)
            node_now = results[0].now_us if len(results) == 1 else 0  # type: ignore[union-attr]
            evaluation = Evaluation(
                tuple(d for d in decisions if d is not None), tuple(repaired), node_now
            )
            if denied:
                self._give_back(checks, spent, decisions, now_us)
                evaluation = Evaluation(tuple(d for d in decisions if d is not None))
            return self._routed_answer(checks, live, evaluation, chosen, now_us)
        # Some groups' nodes are down: the failure policy decides those checks only.
        failed.sort()
        lost = [checks[i] for i in failed]
        if chosen == "closed":  # a node failed during this call
            self._give_back(checks, spent, decisions, now_us)
            return self._degraded(lost, policy, now_us)
        local: Evaluation | None = None
        if chosen == "local" and not denied:
            local = self._local_by_node(checks, failed, node_of, now_us)
            for i, decision in zip(failed, local.decisions, strict=True):
                decisions[i] = decision
            if not local.allowed:
                denied = True
                self._give_back(checks, spent, decisions, now_us)
        elif chosen not in ("open", "local"):
            validate_policy(chosen)
        if denied and local is None:
            self._give_back(checks, spent, decisions, now_us)
        by_redis = [checks[i] for i in answered]
        redis_said = Evaluation(tuple(d for i in answered if (d := decisions[i]) is not None))
        if metrics is not None:
            metrics.degraded(lost, local)
            if answered:
                metrics.evaluated(by_redis, redis_said)
        if not answered and local is None:
            return _OPEN_OUTCOME  # nothing is known about any check: as for one node
        for i in failed:
            if decisions[i] is None:  # not decided (policy open, or Redis denied first)
                # Nothing known: the least restrictive, so it never drives the headers.
                c = checks[i]
                decisions[i] = Decision(True, c.limit, c.limit, 0.0, 0.0)
        evaluation = Evaluation(tuple(d for d in decisions if d is not None))
        if chosen == "local" and answered:
            self.last_known.record(by_redis, redis_said)
        return Outcome(evaluation, degraded=True)

    def _local_by_node(
        self,
        checks: Sequence[Check],
        failed: list[int],
        node_of: dict[int, str],
        now_us: int | None,
    ) -> Evaluation:
        """The checks ``failed`` (indexes, sorted) decided by their nodes' fallbacks, all or
        nothing: when one node's fallback refuses, the others give back what they admitted."""
        by_fallback: dict[LocalFallback, list[int]] = {}
        for i in failed:
            fallback = self._fallback_for(checks[i].key, node_of[i])
            by_fallback.setdefault(fallback, []).append(i)
        instances = self.instances.divisor
        decided: dict[int, Decision] = {}
        admitted: list[tuple[LocalFallback, list[Check]]] = []
        allowed = True
        for fallback, indexes in by_fallback.items():
            part = [checks[i] for i in indexes]
            evaluation = fallback.evaluate(part, instances=instances, now_us=now_us)
            decided.update(zip(indexes, evaluation.decisions, strict=True))
            if evaluation.allowed:
                pairs = zip(part, evaluation.decisions, strict=True)
                admitted.append((fallback, [c for c, d in pairs if not d.shadow_denied]))
            else:
                allowed = False
        if not allowed:
            for fallback, spent in admitted:
                fallback.give_back(spent, instances=instances, now_us=now_us)
        return Evaluation(tuple(decided[i] for i in failed))

    def _gate(self, routes: list[tuple[str, list[int]]]) -> tuple[dict[str, Breaker], set[str]]:
        """Ask each node's breaker once: the nodes to try (with their breakers), the others."""
        breakers = self.breakers
        trying: dict[str, Breaker] = {}
        blocked: set[str] = set()
        for node, _ in routes:
            if node in trying or node in blocked:
                continue  # one allow() per node and request: it may hand out the one trial
            breaker = breakers.get(node)
            if breaker.allow():
                trying[node] = breaker
            else:
                blocked.add(node)
        return trying, blocked

    def _rediscover_due(self) -> bool:
        """True at most once every :data:`REDISCOVER_INTERVAL` seconds (of the clock)."""
        now = self._clock()
        if now - self._asked_at < REDISCOVER_INTERVAL:
            return False
        self._asked_at = now
        return True

    def _routed_answer(
        self,
        checks: Sequence[Check],
        live: list[tuple[str, list[int]]],
        evaluation: Evaluation,
        chosen: FailurePolicy,
        now_us: int | None,
    ) -> Outcome:
        """What the single-node path does after Redis answered every check (``live``: the
        nodes that answered and the indexes of their checks); each node's fallback counts the
        checks of its node only."""
        outcome: Outcome | None = None
        if chosen == "local":
            self.last_known.record(checks, evaluation)
            if evaluation.allowed:
                outcome = self._charge_by_node(checks, live, evaluation, now_us)
        metrics = self.metrics
        if metrics is not None:
            if outcome is None:
                metrics.evaluated(checks, evaluation)
            else:
                metrics.degraded(checks, outcome.evaluation)
        if self.instances.auto and self.instances.due():
            self._heartbeat()
        return Outcome(evaluation) if outcome is None else outcome

    def _charge_by_node(
        self,
        checks: Sequence[Check],
        live: list[tuple[str, list[int]]],
        evaluation: Evaluation,
        now_us: int | None,
    ) -> Outcome | None:
        """:meth:`LocalFallback.charge` of each check by the fallback that counts its key, else
        by its node's, when that holds counts; the local refusal of any refuses the request."""
        if not any(f.holding for f in self._fallbacks.values()):
            return None  # the path of every healthy cluster
        by_fallback: dict[LocalFallback, list[int]] = {}
        for node, indexes in live:
            for i in indexes:
                fallback = self._fallback_for(checks[i].key, node)
                if fallback.holding:
                    by_fallback.setdefault(fallback, []).append(i)
        decisions = list(evaluation.decisions)
        refused = False
        for fallback, indexes in by_fallback.items():
            part = [checks[i] for i in indexes]
            said = Evaluation(tuple(decisions[i] for i in indexes))
            local = fallback.charge(part, said, instances=self.instances.divisor, now_us=now_us)
            if local is not None:  # over this process's share while failures go on
                refused = True
                for i, decision in zip(indexes, local.decisions, strict=True):
                    decisions[i] = decision
        return Outcome(Evaluation(tuple(decisions)), degraded=True) if refused else None

    def _give_back(
        self,
        checks: Sequence[Check],
        spent: list[int],
        decisions: list[Decision | None],
        now_us: int | None,
    ) -> None:
        """Give back what the groups that admitted a refused request consumed (best effort)."""
        if not spent:
            return
        given = [checks[i] for i in spent]
        try:
            refunded = self.storage.refund(given, now_us=now_us)
        except StorageError as exc:  # the node died in between: consumed until the window ends
            self.side_failed(f"the refund of {len(given)} rate-limit check(s)", exc)
        else:
            for i, decision in zip(spent, refunded.decisions, strict=True):
                decisions[i] = decision
        spent.clear()

    def _follow(self, refresh: bool) -> Breaker | None:
        """The breaker of the node the storage goes to now, when it moved (else ``None``).

        ``refresh`` (the current node's breaker is open) lets the storage ask its topology
        again, at most once every :data:`REDISCOVER_INTERVAL` seconds.
        """
        if refresh and not self._rediscover_due():
            return None  # asked less than a second ago: the open state stays cheap
        node = self.storage.node(refresh)
        if node == self._node:
            return None
        breaker = self.breakers.get(node)
        previous, self._node, self._breaker = self._node, node, breaker
        self.breakers.retain((node,))  # one node at a time: the old one's breaker goes
        log.info(
            "Rate-limit storage %s moved from %s to %s: its calls go through %r",
            self.name,
            previous,
            node,
            breaker,
        )
        return breaker

    def _degraded(
        self, checks: Sequence[Check], policy: FailurePolicy | None, now_us: int | None
    ) -> Outcome:
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
        if chosen == "closed":
            return _CLOSED_OUTCOME
        if chosen != "open":
            validate_policy(chosen)  # raises ConfigurationError naming the bad value
        return _OPEN_OUTCOME

    def _heartbeat(self) -> None:
        self.side_call(self._heartbeat_check.key, self.instances.beat, "the instance heartbeat")

    def beside(self, key: str, what: str) -> SideReport | None:
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
          healthy node), counted and logged as :meth:`unreadable` says; so is a lost reply
          (:class:`~flask_distlimit.errors.StorageReplyLost`: a fresh connection answered);
        - any other exception frees a trial it held and decides nothing.

        The report takes the breaker's lock at most (no I/O): it never delays the request.
        """
        breaker = self.breaker_of(key)
        if not breaker.allow():
            return None
        return functools.partial(self._heard, breaker, what)

    def _heard(self, breaker: Breaker, what: str, error: BaseException | None) -> None:
        """Tell ``breaker`` how a call beside the request's ended (:meth:`beside`)."""
        if error is None or isinstance(error, StorageReplyLost | StorageFull):
            breaker.success()  # the node answered
        elif isinstance(error, StorageUnavailable):
            breaker.failure(error)
            if isinstance(error, StorageMisconfigured):
                self._refused(error)
        elif isinstance(error, StorageResponseError):
            breaker.success()  # the store answered: not an outage
            self.unreadable(error, what)
        else:
            breaker.release()

    def side_call(
        self, key: str, call: Callable[[Storage], Sequence[str]], what: str = "a side call"
    ) -> None:
        """One separate, cheap storage call beside the request's own, on ``key`` (the instance
        heartbeat, the lease records), ``what`` naming it in the log: made only while the
        breaker of ``key``'s node lets calls through, which hears how it ended
        (:meth:`beside`); the keys it answers (found holding garbage and replaced) are
        logged. An error reply is an answer (the breaker hears a success) that the request it
        rides on, decided already, never sees: counted and logged as :meth:`unreadable` says."""
        heard = self.beside(key, what)
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
            self._repaired(repaired)

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
        then hears once how its parts ended, as :meth:`beside` says: an outage if any of them
        met one, else an answer."""
        if self._routed:
            routes = self.storage.route(checks)
            trying, _ = self._gate(routes)
            live = [(n, [checks[i] for i in indexes]) for n, indexes in routes if n in trying]
        else:
            if not self._breaker.allow():
                return
            trying = {self._node: self._breaker}
            live = [(self._node, list(checks))]
        if not live:
            return
        try:
            results = self.storage.evaluate_parts([part for _, part in live], now_us=now_us)
        except BaseException as exc:
            for breaker in trying.values():
                breaker.release()
            if not isinstance(exc, Exception):
                raise
            log.error("%s failed unexpectedly; it is skipped", what.capitalize(), exc_info=True)
            return
        self._tell(trying, [node for node, _ in live], results)
        for result in results:
            if isinstance(result, StorageResponseError):
                self.unreadable(result, what)
            elif isinstance(result, StorageError):
                self.side_failed(what, result)

    def _tell(
        self,
        trying: dict[str, Breaker],
        nodes: Sequence[str],
        results: Sequence[Evaluation | StorageError],
    ) -> None:
        """Each node's breaker of ``trying`` hears once how the parts sent to it (``nodes``,
        one per result) ended: an outage if any of them met one, else an answer (an error
        reply and a lost reply are answers: the node is up)."""
        heard: dict[str, StorageUnavailable | None] = {}
        for node, result in zip(nodes, results, strict=True):
            if isinstance(result, StorageUnavailable) and not isinstance(
                result, StorageReplyLost | StorageFull
            ):  # a lost reply and a refused write are answers: the node is up
                heard[node] = result
            elif not isinstance(result, StorageBusy):  # this process's load: no evidence
                heard.setdefault(node, None)
        for node, breaker in trying.items():
            if node not in heard:
                breaker.release()
        for node, error in heard.items():
            if error is None:
                trying[node].success()
            else:
                trying[node].failure(error)
                if isinstance(error, StorageMisconfigured):
                    self._refused(error)

    def _repaired(self, keys: Sequence[str]) -> None:
        for key in keys:
            log.warning(
                "Rate-limit key %s held data of the wrong type or shape; it was reset to a "
                "fresh state (something else writes under the key prefix %r?)",
                key,
                self.key_prefix,
            )

    def unreadable(self, exc: StorageError, call: str | None = None) -> None:
        """Count and log an error reply (a reply the limiter cannot read) to a request's call,
        or to the side call ``call`` names (a heartbeat, a slot's give-back: skipped): every
        one is counted (``health()``, the ``unreadable_replies_total`` metric), since the
        breaker stays closed and an operator would otherwise see only ``degraded`` decisions;
        all of them log one ERROR line, then at most one a minute. A request is answered by
        the failure policy, never with a 500."""
        now = self._clock()
        if self.metrics is not None:
            self.metrics.unreadable()
        with self._log_lock:
            self._unreadable_count += 1
            self._unreadable_last = _one_line(str(exc) or type(exc).__name__)
            last = self._unreadable_logged_at
            if last is not None and now - last < MISCONFIGURED_LOG_INTERVAL:
                return
            self._unreadable_logged_at = now
        if call is not None:
            log.error(
                "Rate-limit storage %s answered %s with what the limiter cannot read (a bug, "
                "data it does not expect, or a Redis-compatible server that runs Lua "
                "otherwise); it is skipped; logged at most once a minute: %s",
                self.name,
                call,
                exc,
            )
            return
        log.error(
            "Rate-limit storage %s answered what the limiter cannot read (a bug, data it does not "
            "expect, or a Redis-compatible server that runs Lua otherwise), so such requests are "
            "answered by the failure policy (%r unless their route sets one); logged at most "
            "once a minute: %s",
            self.name,
            self.policy,
            exc,
        )

    def _chosen(self, policy: FailurePolicy | None) -> FailurePolicy:
        """The policy that answers a request: its route's or the default, but ``"local"`` in
        place of ``"open"`` while a local fallback holds keys it decided because the storage
        refused a write (:class:`~flask_distlimit.errors.StorageFull`): Redis never counted
        those admissions, so a client must not get its local share and then Redis's whole
        quota in the same window."""
        chosen: FailurePolicy = policy or self.policy
        if any(f.holding for f in self._fallbacks_all()):
            return "local" if chosen == "open" else chosen
        self._full = False  # every key decided locally was handed back
        return chosen

    def _refused_write(self, exc: StorageFull, policy: FailurePolicy | None) -> FailurePolicy:
        """The policy that answers a request whose write the storage refused: ``"closed"``
        stays (503), any other is ``"local"`` (this process's share, never unlimited). Logs
        at WARNING, at most once every :data:`MISCONFIGURED_LOG_INTERVAL` seconds."""
        chosen: FailurePolicy = policy or self.policy
        if chosen != "closed":
            self._full = True
        now = self._clock()
        with self._log_lock:
            last = self._full_logged_at
            logging_now = last is None or now - last >= MISCONFIGURED_LOG_INTERVAL
            if logging_now:
                self._full_logged_at = now
        if logging_now:
            log.warning(
                "Rate-limit storage %s refuses writes, so requests are decided at each "
                "process's local share of their limits (limit / %d, DISTLIMIT_INSTANCES; 503 "
                "under policy \"closed\") until it has room; its breaker stays closed (logged at "
                "most once a minute): %s",
                self.name,
                self.instances.divisor,
                exc,
            )
        return "closed" if chosen == "closed" else "local"

    def side_failed(self, what: str, cause: BaseException | str) -> None:
        """Count and log a call beside a request's that did not complete (``what`` names it:
        a concurrency slot's give-back, a refund, a lease's give-back, an after-response
        charge; ``cause`` the error or why it was not made). Such a call ends with its own
        failure: its node's breaker has heard of an outage already (:meth:`beside`), and
        nothing else changes, no failure policy answers it and the local fallback is not
        engaged, so no other request's decision moves. Every one is counted (``health()``'s
        ``side_call_failures``, the ``side_call_failures_total`` metric); the first logs one
        WARNING line, then at most one every :data:`SIDE_FAILURE_LOG_INTERVAL` seconds, which
        says how many failed since the previous line."""
        now = self._clock()
        if self.metrics is not None:
            self.metrics.side_call_failed()
        text = _one_line(str(cause) or type(cause).__name__)
        with self._log_lock:
            self._side_failures += 1
            self._side_unlogged += 1
            self._side_last = f"{what}: {text}"
            last = self._side_logged_at
            if last is not None and now - last < SIDE_FAILURE_LOG_INTERVAL:
                return
            self._side_logged_at = now
            count, self._side_unlogged = self._side_unlogged, 0
        log.warning(
            "Rate-limit storage %s: %s failed and is skipped (%s); %d call(s) beside requests "
            "failed since the last such line (logged at most once a minute; every request "
            "is still decided as usual)",
            self.name,
            what,
            text,
            count,
        )

    def _busy(self, exc: StorageBusy) -> Outcome:
        """A call queued in this process past its budget: a 503 (``Retry-After: 1``), whatever
        the policy; one WARNING line, then at most one a minute."""
        now = self._clock()
        with self._log_lock:
            last = self._busy_logged_at
            if last is None or now - last >= MISCONFIGURED_LOG_INTERVAL:
                self._busy_logged_at = now
                log.warning(
                    "Rate-limit storage %s: this process's calls queue past their budget, so "
                    "such requests are answered 503 (Retry-After: 1); the breaker is not told "
                    "(logged at most once a minute): %s",
                    self.name,
                    exc,
                )
        return _BUSY_OUTCOME

    def _refused(self, exc: StorageMisconfigured) -> None:
        """Log that the storage refuses the limiter: once, then at most once a minute."""
        now = self._clock()
        with self._log_lock:
            last = self._refusal_logged_at
            if last is not None and now - last < MISCONFIGURED_LOG_INTERVAL:
                return
            self._refusal_logged_at = now
        log.error(
            "Rate-limit storage %s refuses the limiter, so every request is answered by the "
            "failure policy (%r unless its route sets one) until the configuration is fixed "
            "(logged at most once a minute): %s",
            self.name,
            self.policy,
            exc,
        )

    @property
    def breaker(self) -> Breaker:
        """The breaker of the node the storage goes to now: the only one on a single node or
        memory, the current master's on Sentinel; on a Redis Cluster, that of the primary
        serving the instance heartbeat key (each request uses its groups' own,
        :attr:`breakers`)."""
        if self._routed:
            return self.breakers.get(self.storage.route([self._heartbeat_check])[0][0])
        return self._breaker

    def breaker_of(self, key: str) -> Breaker:
        """The breaker of the node serving ``key`` (:attr:`breaker` but on a Redis Cluster)."""
        if self._routed:
            check = Check(key, "fixed_window", 1, 1, 0)
            return self.breakers.get(self.storage.route([check])[0][0])
        return self._breaker

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
        if self.compose_metrics is not None:
            metrics = self.compose_metrics(metrics)
        if metrics is not None:
            for breaker in self.breakers.all():
                metrics.breaker_changed(breaker.name, breaker.state)
        self.metrics = metrics

    # -- inspection --------------------------------------------------------------------------

    def health(self) -> dict[str, object]:
        """Storage ping latency, breaker states, scripts loaded, instances seen; never raises.

        ``breakers`` maps each storage node (``"redis"`` for a single node or memory, the
        master's ``host:port`` on Sentinel, each primary's on a Cluster) to its breaker's state;
        ``breaker_nodes`` maps each to its breaker's figures: ``state``, ``failures`` (the
        consecutive outages counted, which stays at the count that opened it while it is not
        closed) and ``open_seconds`` (since it opened; ``None`` while closed). ``breaker``,
        ``breaker_failures`` and ``breaker_open_seconds`` are those of the worst node's breaker
        (:func:`~flask_distlimit.resilience.breakers.worst`: open, then half-open, then closed;
        among equals the one open longest, then the one with the most failures). With one node they
        are that node's, as they always were; on a Cluster they describe one primary, the one
        that degrades requests, whichever serves the instance heartbeat key (they used to be
        that primary's, and read ``0`` and ``None`` while another primary's breaker was open).

        Checks the storage even while the breaker is open (it is an explicit check, not a
        request), but the answer does not move the breaker: a PING, whether the scripts are
        loaded, then one evaluation of cost 0 (it consumes nothing and leaves no key, but it
        runs the script, so a server that refuses the limiter's commands, keys or credentials
        shows here; it loads the script when the server has none). Any failure, expected
        (:class:`~flask_distlimit.errors.StorageError`) or not, gives ``ok: False``, its cause
        in one line in ``error`` and its class name in ``error_type`` (``StorageUnavailable``,
        ``StorageMisconfigured``, ``StorageResponseError``, or any other).

        ``unreadable_replies`` counts the replies to requests this process could not read (an
        error reply or one of the wrong shape: the failure policy answered them, the breaker
        stayed closed), ``unreadable_last`` quotes the last in one line (``None``: none yet).
        ``side_call_failures`` counts the calls beside requests that failed and were skipped
        (:meth:`side_failed`), ``side_call_last`` names the last with its cause.
        """
        error: str | None = None
        error_type: str | None = None
        latency: float | None = None
        loaded: bool | None = None
        try:
            latency = self.storage.ping()
            loaded = self.storage.scripts_loaded()
            self.storage.evaluate([self._probe])
        except StorageError as exc:
            error, error_type = _one_line(str(exc) or type(exc).__name__), type(exc).__name__
        except Exception as exc:  # a broken storage must not break the health check
            log.debug("Health check of %s failed", self.name, exc_info=True)
            error = _one_line(f"unexpected {type(exc).__name__} from the storage: {exc}")
            error_type = type(exc).__name__
        if self._follows:
            self._follow(refresh=False)  # name the master the storage found, if it connected
        self.breakers.prune()
        current = self.breaker  # made if new: the heartbeat key's node is always shown
        by_node = self.breakers.by_node()
        figures = {node: _figures(b) for node, b in by_node.items()}
        shown = worst(list(by_node.values())) or current
        aggregate = shown.state
        opened_for = shown.opened_for()
        return {
            "ok": error is None and aggregate == "closed",
            "storage": self.storage.scheme,
            "latency_ms": None if latency is None else round(latency * 1000, 3),
            "error": error,
            "error_type": error_type,
            "scripts_loaded": loaded,
            "breaker": aggregate,
            "breakers": {node: f["state"] for node, f in figures.items()},
            "breaker_nodes": figures,
            "breaker_failures": shown.failures,
            "breaker_open_seconds": None if opened_for is None else round(opened_for, 3),
            "policy": self.policy,
            "instances": self.instances.setting,
            "instances_min": self.instances.minimum,
            "instances_seen": self.instances.seen,
            "fallback_divisor": self.instances.divisor,
            "fallback_active": self.fallback_active,
            "fallback_held_keys": sum(f.held() for f in self._fallbacks_all()),
            "unreadable_replies": self._unreadable_count,
            "unreadable_last": self._unreadable_last,
            "side_call_failures": self._side_failures,
            "side_call_last": self._side_last,
            "leases": self.held_leases(),
        }

    def _after_fork(self) -> None:
        self._log_lock = threading.Lock()
        self._fallbacks_lock = threading.Lock()
        self._refusal_logged_at = self._busy_logged_at = None  # every process says it once
        self._unreadable_logged_at = None
        self._full_logged_at = None
        self._unreadable_count, self._unreadable_last = 0, None
        self._side_failures = self._side_unlogged = 0
        self._side_logged_at = self._side_last = None
        self.breakers._after_fork()
        self.instances._after_fork()
        self.last_known._after_fork()
        for fallback in self._fallbacks_all():
            fallback._after_fork()


def _figures(breaker: Breaker) -> dict[str, object]:
    """One node's line of ``health()["breaker_nodes"]``."""
    opened_for = breaker.opened_for()
    return {
        "state": breaker.state,
        "failures": breaker.failures,
        "open_seconds": None if opened_for is None else round(opened_for, 3),
    }


def _one_line(text: str) -> str:
    return " ".join(text.split())
