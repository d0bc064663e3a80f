"""Charging after the response: limits declared with ``deduct_when=callable(response) -> bool``.

::

    @app.post("/login")
    @limiter.limit("5/minute", deduct_when=lambda response: response.status_code == 401)
    def login(): ...

1. Before the view, in the request's one storage call, such a limit is a *peek* (cost 0: it
   reads the counter and consumes nothing). When fewer units are left than the request would
   cost, the request is refused (429) and nothing is charged to that limit (its
   ``Retry-After`` is the time until the quota is whole again: a peek does not tell when one
   unit frees, so it is an upper bound). The request's other
   limits in that same call are ordinary checks: they were charged already (the peek is not
   a denial inside the all-or-nothing script call). A shadow limit's peek never refuses: it is
   logged as a would-be refusal (:mod:`flask_distlimit.defences.shadow`).
2. After the response, the callable is asked; when it answers true, the limit is charged in a
   second storage call (only requests of routes with such a limit make it). The charge is
   all-or-nothing like every call: a charge that no longer fits (other requests filled the
   quota meanwhile) is not made, so a counter never exceeds its limit. A callable that raises
   is logged and the request is charged (the safe side for a login limit). The charge goes
   through the route's own failure policy (its ``on_failure``, else
   ``DISTLIMIT_FAILURE_POLICY``), as the peek did: under ``local`` a storage outage charges
   the local fallback (at this process's share), so the next peek there sees it; under
   ``open`` and ``closed`` it drops the charge (the response is already made). A dropped
   charge ends there: it is counted and logged as a failed side call
   (:meth:`Guard.side_failed <flask_distlimit.resilience.guard.Guard.side_failed>`: ``health()``'s
   ``side_call_failures``, one WARNING line a minute at most).

Exactness under concurrency: N requests in flight at once can all pass the peek before any of
them is charged, so up to ``limit + N - 1`` of them may reach the view in one window (with
``limit`` already counted, the next peek refuses). Sequential requests are exact: the
``limit + 1``-th counted request is refused. ``tests/request/test_deduction.py`` measures the bound
with N concurrent failed logins held at a barrier inside the view, on a real redis-server.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flask_distlimit.core.decision import Check, Decision, Evaluation

if TYPE_CHECKING:
    from werkzeug.wrappers import Response

    from flask_distlimit._typing import FailurePolicy
    from flask_distlimit.declare.route_limits import BoundLimit
    from flask_distlimit.defences.concurrency import SideCalls
    from flask_distlimit.resilience.guard import Guard

__all__ = ["Deferred", "charge", "spent"]

log = logging.getLogger("flask_distlimit")


@dataclass(frozen=True, slots=True)
class Deferred:
    """One limit of a request to charge after the response: ``check`` has the request's cost.

    ``free_if_not_modified``: a conditional request under ``DISTLIMIT_CONDITIONAL_COST=0``,
    free only when its response is a 304 (the header alone is the client's claim).
    ``policy``: the failure policy of the route whose peek it follows (``None``: the app's)."""

    check: Check
    bound: BoundLimit
    free_if_not_modified: bool = False
    policy: FailurePolicy | None = None


def spent(
    checks: Sequence[Check],
    decisions: Sequence[Decision],
    deferred: dict[str, Deferred],
    *,
    shadow: bool = False,
) -> list[int]:
    """Indexes of the peeks whose limit has fewer units left than the request would cost: the
    enforced limits' (they refuse the request), or with ``shadow`` the shadow limits' (they
    never refuse: they are only logged as would-be refusals)."""
    found: list[int] = []
    for i, (c, d) in enumerate(zip(checks, decisions, strict=True)):
        later = deferred.get(c.key)
        if (
            later is not None
            and c.cost == 0
            and c.shadow is shadow
            and d.remaining < later.check.cost
        ):
            found.append(i)
    return found


def _wants_charge(later: Deferred, response: Response) -> bool:
    if later.free_if_not_modified and response.status_code == 304:
        return False
    when = later.bound.deduct_when
    if when is None:
        return True
    try:
        return bool(when(response))
    except Exception:  # the app's code: charge, the safe side for a login limit
        log.exception(
            "The deduct_when callable of the rate limit %s raised; the request is charged.",
            later.bound.name,
        )
        return True


def charge(
    calls: SideCalls, deferred: dict[str, Deferred], response: Response
) -> list[tuple[Deferred, Decision]]:
    """Charge the limits whose ``deduct_when`` answers true for ``response``, through
    ``calls.guard`` at ``calls.storage_now()``; answer each charged limit with the storage's
    decision of its charge (what is left after it: the response's headers tell that, not the
    peek's count from before)."""
    due = [d for d in deferred.values() if d.check.cost > 0 and _wants_charge(d, response)]
    deferred.clear()
    by_policy: dict[FailurePolicy | None, list[Deferred]] = {}
    for d in due:  # one call per failure policy (a request's limits have one, almost always)
        by_policy.setdefault(d.policy, []).append(d)
    charged: list[tuple[Deferred, Decision]] = []
    for policy, group in by_policy.items():
        charged += _charge_group(calls.guard, calls.storage_now, group, policy)
    return charged


def _charge_group(
    guard: Guard, now: Callable[[], int | None], due: list[Deferred], policy: FailurePolicy | None
) -> list[tuple[Deferred, Decision]]:
    try:
        evaluation = _charge(guard, now, [d.check for d in due], policy)
        if evaluation is None:
            return []
        if evaluation.allowed:
            return list(zip(due, evaluation.decisions, strict=True))
        # Some limit filled up meanwhile: charge the ones that still fit, in one more call.
        fits = [d for d, e in zip(due, evaluation.decisions, strict=True) if e.allowed]
        again = _charge(guard, now, [d.check for d in fits], policy) if fits else None
        return [] if again is None else list(zip(fits, again.decisions, strict=True))
    except Exception:  # the response is made: a failed charge must not turn it into a 500
        log.exception("A deferred rate-limit charge failed; %d charge(s) dropped.", len(due))
        return []


def _charge(
    guard: Guard, now: Callable[[], int | None], checks: list[Check], policy: FailurePolicy | None
) -> Evaluation | None:
    outcome = guard.evaluate(checks, policy=policy, now_us=now())
    if outcome.evaluation is None or outcome.unavailable:
        guard.side_failed(
            f"an after-response charge of {len(checks)} rate limit(s)",
            "the storage did not decide (an outage, or a reply the limiter cannot read) and "
            f"the failure policy {policy or guard.policy!r} drops it",
        )
        return None
    return outcome.evaluation
