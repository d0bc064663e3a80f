"""A request's checks on a Redis Cluster: grouped per node, each group through its own breaker.

Groups on an open or failing node get the failure policy, the others Redis's answer, in the same
request. Promises: a refused request spends nothing (best effort: consumed units are given back);
the slot map is reloaded at most every :data:`~.guard_core.REDISCOVER_INTERVAL` while a breaker
is open. Each policy's answer: docs/design-notes.md, "Routing on a Cluster".
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

from flask_distlimit import errors
from flask_distlimit._typing import FailurePolicy
from flask_distlimit.core.decision import Check, Decision, Evaluation
from flask_distlimit.errors import StorageBusy, StorageError, StorageFull, StorageUnavailable
from flask_distlimit.resilience.breakers import report_parts
from flask_distlimit.resilience.fallback import LocalFallback
from flask_distlimit.resilience.guard_core import GuardCore
from flask_distlimit.resilience.outcome import OPEN_OUTCOME, Outcome
from flask_distlimit.telemetry.metrics import storage_outcome


def evaluate_routed(
    core: GuardCore, checks: Sequence[Check], chosen: FailurePolicy, now_us: int | None
) -> Outcome:
    """:meth:`Guard.evaluate <flask_distlimit.resilience.guard.Guard.evaluate>` on a storage whose
    groups of checks go to nodes of their own (``core``: the guard's shared state), under the
    failure policy ``chosen``."""
    storage = core.storage
    routes = storage.route(checks)
    trying, blocked = core.breakers.admit(node for node, _ in routes)
    if blocked and core.rediscover_due():
        # A replica may have been promoted in place of a dead primary: refresh the slot map
        # (at most once a second) so that its slots go to the new primary's breaker.
        for breaker in trying.values():
            breaker.release()
        storage.node(refresh=True)
        routes = storage.route(checks)
        trying, blocked = core.breakers.admit(node for node, _ in routes)
    if blocked and chosen == "closed":  # answered 503 whatever the live nodes say
        for breaker in trying.values():
            breaker.release()
        return core.answer_by_policy(checks, chosen, now_us)
    node_of = {i: node for node, indexes in routes for i in indexes}
    live = [(node, indexes) for node, indexes in routes if node in trying]
    parts = [[checks[i] for i in indexes] for _, indexes in live]
    failed = [i for node, indexes in routes if node in blocked for i in indexes]
    metrics = core.metrics
    results: list[Evaluation | StorageError] = []
    seconds = 0.0  # the call's, when one was made
    if parts:
        started = time.perf_counter()
        try:
            results = storage.evaluate_parts(parts, now_us=now_us)
        except BaseException:
            for breaker in trying.values():
                breaker.release()
            raise
        seconds = time.perf_counter() - started
    # Each node's breaker hears once: an outage if any of its groups met one.
    for refused in report_parts(trying, [node for node, _ in live], results):
        core.storage_log.refused(refused)
    full = next((r for r in results if isinstance(r, StorageFull)), None)
    if full is not None:  # decided at the local share ("closed": 503), never "open"
        chosen = core.policy_after_refused_write(full, chosen, checks, now_us)
    decisions: list[Decision | None] = [None] * len(checks)
    repaired: list[str] = []
    spent: list[int] = []  # indexes of checks a group admitted and consumed
    answered: list[int] = []
    up: set[int] = set()  # a lost reply's: that node is up (no fallback of its own takes over)
    denied = False
    busy: StorageBusy | None = None
    for (node, indexes), part, result in zip(live, parts, results, strict=True):
        if isinstance(result, StorageUnavailable):
            failed.extend(indexes)
            if isinstance(result, errors.StorageReplyLost) and not core.fallbacks.of(node).holding:
                up.update(indexes)
        elif isinstance(result, StorageBusy):  # load: the whole request is refused
            busy = result
        elif isinstance(result, StorageError):  # an error reply: the policy decides these
            core.count_unreadable(result)
            failed.extend(indexes)
        else:
            charged = result.allowed and any(c.cost for c in part)
            for i, decision in zip(indexes, result.decisions, strict=True):
                decisions[i] = decision
                # a shadow check that would deny was not charged: nothing to give back
                if charged and not decision.shadow_denied:
                    spent.append(i)
            repaired.extend(result.repaired_keys)
            answered.extend(indexes)
            denied = denied or not result.allowed
    if repaired:
        core.storage_log.repaired(repaired)
    if metrics is not None and parts and (failed or busy is not None):
        # (every group answered: told with the decisions, by _answered) a refused write is an
        # answer, as on one node
        raised = (r for r in results if not isinstance(r, Evaluation | StorageFull))
        metrics.storage_call(seconds, storage_outcome(next(raised, None)))
    if busy is not None:
        _give_back(core, checks, spent, decisions, now_us, breach=False)
        return core.answer_busy(busy)
    if not failed:
        # one group: its node's clock (the window a leased unit was taken in)
        node_now = results[0].now_us if len(results) == 1 else 0  # type: ignore[union-attr]
        evaluation = Evaluation(
            tuple(d for d in decisions if d is not None), tuple(repaired), node_now
        )
        if denied:
            _give_back(core, checks, spent, decisions, now_us, breach=True)
            evaluation = Evaluation(tuple(d for d in decisions if d is not None))
        return _answered(core, checks, node_of, evaluation, chosen, now_us, seconds=seconds)
    # Some groups' nodes are down: the failure policy decides those checks only.
    failed.sort()
    lost = [checks[i] for i in failed]
    if chosen == "closed":  # a node failed during this call
        _give_back(core, checks, spent, decisions, now_us, breach=False)  # a 503
        return core.answer_by_policy(lost, chosen, now_us)
    local: Evaluation | None = None
    if chosen == "local" and not denied:  # a lost reply's checks are admitted, as on one node
        counted = [i for i in failed if i not in up]
        local = _local_by_node(core, checks, counted, node_of, now_us)
        for i, decision in zip(counted, local.decisions, strict=True):
            decisions[i] = decision
        denied = not local.allowed
    if denied:
        _give_back(core, checks, spent, decisions, now_us, breach=True)
    by_redis = [checks[i] for i in answered]
    redis_said = Evaluation(tuple(d for i in answered if (d := decisions[i]) is not None))
    if metrics is not None:
        metrics.degraded(lost, local)
        if answered:
            metrics.evaluated(by_redis, redis_said)
    if not answered and local is None:
        return OPEN_OUTCOME  # nothing is known about any check: as for one node
    for i in failed:
        if decisions[i] is None:  # not decided (policy open, or Redis denied first)
            # Nothing known: the least restrictive, so it never drives the headers.
            c = checks[i]
            decisions[i] = Decision(True, c.limit, c.limit, 0.0, 0.0)
    evaluation = Evaluation(tuple(d for d in decisions if d is not None))
    if chosen == "local" and answered:
        core.last_known.record(by_redis, redis_said)
    return Outcome(evaluation, degraded=True)


def _local_by_node(
    core: GuardCore,
    checks: Sequence[Check],
    failed: list[int],
    node_of: dict[int, str],
    now_us: int | None,
) -> Evaluation:
    """The checks ``failed`` (indexes, sorted) decided by their nodes' fallbacks, all or
    nothing: when one node's fallback refuses, the others give back what they admitted."""
    instances = core.instances.divisor
    decided: dict[int, Decision] = {}
    admitted: list[tuple[LocalFallback, list[Check]]] = []
    for fallback, indexes in core.fallbacks.split(checks, {i: node_of[i] for i in failed}).items():
        part = [checks[i] for i in indexes]
        evaluation = fallback.evaluate(part, instances=instances, now_us=now_us)
        decided.update(zip(indexes, evaluation.decisions, strict=True))
        if evaluation.allowed:
            pairs = zip(part, evaluation.decisions, strict=True)
            admitted.append((fallback, [c for c, d in pairs if not d.shadow_denied]))
    local = Evaluation(tuple(decided[i] for i in failed))  # allowed: every fallback admitted
    if not local.allowed:
        for fallback, spent in admitted:
            fallback.release(spent, instances=instances, now_us=now_us, refund=True)
    return local


def _answered(
    core: GuardCore,
    checks: Sequence[Check],
    node_of: dict[int, str],
    evaluation: Evaluation,
    chosen: FailurePolicy,
    now_us: int | None,
    *,
    seconds: float,
) -> Outcome:
    """What the single-node path does after Redis answered every check in ``seconds``
    (``node_of``: each check's node), each node's fallback counting the checks of its node
    only: under ``"local"``, :meth:`LocalFallback.charge` of each check by the fallback that
    counts its key, else by its node's, when that holds counts; the local refusal of any
    refuses the request."""
    refused = False
    if chosen == "local":
        core.last_known.record(checks, evaluation)
    # never on the path of a healthy cluster: no node's fallback holds counts
    if chosen == "local" and evaluation.allowed and core.fallbacks.per_node_holding():
        decisions = list(evaluation.decisions)
        divisor = core.instances.divisor
        for fallback, indexes in core.fallbacks.split(checks, node_of).items():
            if not fallback.holding:
                continue
            part = [checks[i] for i in indexes]
            said = Evaluation(tuple(decisions[i] for i in indexes))
            local = fallback.charge(part, said, instances=divisor, now_us=now_us)
            if local is not None:  # over this process's share while failures go on
                refused = True
                for i, decision in zip(indexes, local.decisions, strict=True):
                    decisions[i] = decision
        if refused:
            evaluation = Evaluation(tuple(decisions))
    metrics = core.metrics
    if metrics is not None:
        if refused:
            metrics.storage_call(seconds)
            metrics.degraded(checks, evaluation)
        else:
            metrics.evaluated(checks, evaluation, seconds=seconds)
    core.heartbeat_if_due()
    return Outcome(evaluation, degraded=refused)


def _give_back(
    core: GuardCore,
    checks: Sequence[Check],
    spent: list[int],
    decisions: list[Decision | None],
    now_us: int | None,
    *,
    breach: bool,
) -> None:
    """Give back what the groups that admitted a refused request consumed (best effort).
    ``breach``: a limit refused it, so the meta checks among them count it (in the same
    atomic call as their group's refund); else they are sent at cost 0 and count nothing."""
    if not spent:
        return
    given = [
        checks[i] if breach or not checks[i].meta else replace(checks[i], cost=0) for i in spent
    ]
    try:
        refunded = core.storage.refund(given, now_us=now_us)
    except StorageError as exc:  # the node died in between: consumed until the window ends
        core.side_failed(f"the refund of {len(given)} rate-limit check(s)", exc)
    else:
        for i, decision in zip(spent, refunded.decisions, strict=True):
            decisions[i] = decision
