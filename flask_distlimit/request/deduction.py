"""Conditional charges: limits declared with ``deduct_when=callable(response) -> bool``.

::

    @app.post("/login")
    @limiter.limit("5/minute", deduct_when=lambda response: response.status_code == 401)
    def login(): ...

1. Before the view, in the request's one storage call, such a limit is *reserved*: charged like
   any other limit of the request, all-or-nothing with them, and refused (429) when it does not
   fit. So N concurrent requests can never take more than the limit to the view: exact, as
   sequential requests are.
2. After the response, the callable is asked. When it answers false, the reservation is given
   back in a second storage call (a *release* check,
   :attr:`Check.release <flask_distlimit.core.decision.Check.release>`: each algorithm's refund,
   the one a concurrency slot's give-back uses). A callable that raises is logged and the request
   stays charged (the safe side for a login limit).
3. Flask-Limiter's order for a callable ``cost``: with ``deduct_when`` it is called after the
   response (it may read what the view set, ``cost=lambda: g.batch``). The reservation is then
   1 unit, and after the response the difference to the real cost is charged, or given back.
   A charge that no longer fits whole charges the units left (a counter never exceeds its
   limit), so a request that went over the quota leaves it spent. A conditional ``GET`` under
   ``DISTLIMIT_CONDITIONAL_COST=0`` likewise reserves 1 and gets it back when it is a 304.

The second call goes through the route's own failure policy (its ``on_failure``, else
``DISTLIMIT_FAILURE_POLICY``), as the reservation did: under ``local`` a storage outage settles
in the local fallback; under ``open`` and ``closed`` it is dropped (the response is already made)
and counted and logged as a failed side call
(:meth:`Guard.side_failed <flask_distlimit.resilience.guard.Guard.side_failed>`). A dropped
give-back leaves the reservation charged, as does a process that dies before it: a request is
never counted less than it used. A reservation that charged nothing (a refused request, a storage
down under ``open``, a shadow limit that would have refused) is never given back.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flask_distlimit.core.decision import Check, Decision, Evaluation

if TYPE_CHECKING:
    from werkzeug.wrappers import Response

    from flask_distlimit._typing import FailurePolicy
    from flask_distlimit.declare.route_limits import BoundLimit
    from flask_distlimit.defences.concurrency import SideCalls
    from flask_distlimit.resilience.guard import Guard

__all__ = ["Deferred", "charge", "reserved"]

log = logging.getLogger("flask_distlimit")


@dataclass(frozen=True, slots=True)
class Deferred:
    """One limit of a request reserved before the view, settled after the response: ``check``
    is the reservation charged with the request.

    ``free_if_not_modified``: a conditional request under ``DISTLIMIT_CONDITIONAL_COST=0``,
    free only when its response is a 304 (the header alone is the client's claim).
    ``cost_after``: the limit's callable ``cost`` is called after the response (Flask-Limiter's
    order with ``deduct_when``), the reservation being 1.
    ``policy``: the failure policy of the route (``None``: the app's)."""

    check: Check
    bound: BoundLimit
    free_if_not_modified: bool = False
    policy: FailurePolicy | None = None
    cost_after: bool = False


def reserved(bound: BoundLimit, *, unproved: bool) -> bool:
    """Whether ``bound`` is reserved before the view and settled after (module docstring):
    a ``deduct_when`` limit, or a conditional request that is free only on a 304."""
    return bound.deduct_when is not None or bound.settle is not None or unproved


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


def _real_cost(later: Deferred, response: Response) -> int:
    """What the request really cost: ``settle(response)``, or the ``cost_after`` limit's
    callable called now, or the reservation (also when the callable fails: logged)."""
    bound = later.bound
    call: Callable[[], object]
    if bound.settle is not None:
        name, call = "settle", functools.partial(bound.settle, response)
    elif later.cost_after and callable(bound.cost):
        name, call = "cost", bound.cost
    else:
        return later.check.cost
    try:
        value = call()
    except Exception:
        log.exception(
            "The %s callable of the rate limit %s raised after the response; the request "
            "is charged its reservation.",
            name,
            bound.name,
        )
        return later.check.cost
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        log.error(
            "The %s callable of the rate limit %s returned %r after the response; it must "
            "return an int >= 0. The request is charged its reservation.",
            name,
            bound.name,
            value,
        )
        return later.check.cost
    return value


def _difference(later: Deferred, response: Response) -> Check | None:
    """The check that settles ``later``: a charge of what it cost beyond its reservation, a
    release of what it did not use, or ``None`` when the reservation was its cost."""
    check = later.check
    real = 0
    if _wants_charge(later, response):
        real = min(_real_cost(later, response), check.limit)  # more can never fit
    if real == check.cost:
        return None
    if real > check.cost:
        return dataclasses.replace(check, cost=real - check.cost)
    return dataclasses.replace(check, cost=check.cost - real, release=True)


def charge(
    calls: SideCalls, deferred: dict[str, Deferred], response: Response
) -> list[tuple[Deferred, Decision]]:
    """Settle the reservations of ``deferred`` for ``response`` (module docstring), through
    ``calls.guard`` at ``calls.storage_now()``; answer each settled limit with the storage's
    decision (what is left after it: the response's headers tell that)."""
    due = [(d, c) for d in deferred.values() if (c := _difference(d, response)) is not None]
    deferred.clear()
    by_policy: dict[FailurePolicy | None, list[tuple[Deferred, Check]]] = {}
    for item in due:  # one call per failure policy (a request's limits have one, almost always)
        by_policy.setdefault(item[0].policy, []).append(item)
    charged: list[tuple[Deferred, Decision]] = []
    for policy, group in by_policy.items():
        # Releases and charges in calls of their own: a release is made even in a call that a
        # charge denies, and on a Redis Cluster such a call's admitted parts are refunded.
        for part in ([x for x in group if x[1].release], [x for x in group if not x[1].release]):
            if part:
                charged += _charge_group(calls.guard, calls.storage_now, part, policy)
    return charged


def _charge_group(
    guard: Guard,
    now: Callable[[], int | None],
    due: list[tuple[Deferred, Check]],
    policy: FailurePolicy | None,
) -> list[tuple[Deferred, Decision]]:
    try:
        evaluation = _charge(guard, now, [c for _, c in due], policy)
        if evaluation is None:
            return []
        if evaluation.allowed:
            return [(d, e) for (d, _), e in zip(due, evaluation.decisions, strict=True)]
        # Some limit filled up meanwhile: charge what still fits, in one more call (the units
        # left of a limit that no longer has room for the whole difference).
        fits = [
            (d, c if e.allowed else dataclasses.replace(c, cost=e.remaining))
            for (d, c), e in zip(due, evaluation.decisions, strict=True)
            if e.allowed or e.remaining > 0
        ]
        again = _charge(guard, now, [c for _, c in fits], policy) if fits else None
        return (
            []
            if again is None
            else [(d, e) for (d, _), e in zip(fits, again.decisions, strict=True)]
        )
    except Exception:  # the response is made: a failed charge must not turn it into a 500
        log.exception("A rate-limit settlement failed; %d settlement(s) dropped.", len(due))
        return []


def _charge(
    guard: Guard, now: Callable[[], int | None], checks: list[Check], policy: FailurePolicy | None
) -> Evaluation | None:
    outcome = guard.evaluate(checks, policy=policy, now_us=now())
    if outcome.evaluation is None or outcome.unavailable:
        guard.side_failed(
            f"an after-response charge or give-back of {len(checks)} rate limit(s)",
            "the storage did not decide (an outage, or a reply the limiter cannot read) and "
            f"the failure policy {policy or guard.policy!r} drops it",
        )
        return None
    return outcome.evaluation
