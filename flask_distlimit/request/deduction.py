"""Reservations settled after the response: ``deduct_when`` and ``settle`` limits.

Such a limit is *reserved* in the request's one storage call, all-or-nothing with its other
limits, so concurrent requests never take more than the limit to the view. After the response
the difference from its real cost is given back or charged as a debt in one more call, through
the route's failure policy; a dropped settlement leaves the reservation charged (docs/limits.md,
"Counting only some responses"; the rules: docs/design-notes.md, "Reserve, then settle").
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from flask import request
from werkzeug.wsgi import ClosingIterator

from flask_distlimit.core.decision import Check, Decision
from flask_distlimit.core.pacing import paced
from flask_distlimit.declare.dynamic_limits import LOG_INTERVAL, log_text
from flask_distlimit.engine.registry import REGISTRY
from flask_distlimit.request.headers import Report, report_of

if TYPE_CHECKING:
    from werkzeug.wrappers import Response

    from flask_distlimit._typing import FailurePolicy
    from flask_distlimit.declare.route_limits import BoundLimit
    from flask_distlimit.defences.concurrency import SideCalls
    from flask_distlimit.defences.lifecycle import Holding

log = logging.getLogger("flask_distlimit")

#: A long body's bytes are charged at least this often while it is sent (microseconds).
SETTLE_EVERY_US: Final = 5_000_000
#: How long before its window ends a reservation is no longer given back: the give-back's own
#: call could reach the storage in the next window (microseconds).
_LATE_US: Final = 250_000


@dataclass(frozen=True, slots=True, kw_only=True)
class Deferred:
    """One limit of a request reserved before the view, settled after the response: ``check``
    is the reservation charged with the request (its limit: ``check.bound``).

    ``free_if_not_modified``: a conditional request under ``DISTLIMIT_CONDITIONAL_COST=0``,
    free only when its response is a 304 (the header alone is the client's claim).
    ``cost_after``: the limit's callable ``cost`` is called after the response (Flask-Limiter's
    order with ``deduct_when``), the reservation being 1.
    ``policy``: the failure policy of the route (``None``: the app's)."""

    check: Check
    free_if_not_modified: bool = False
    policy: FailurePolicy | None = None
    cost_after: bool = False
    #: the local clock's time (us) from which the reservation is not given back: a window's
    #: may be over (a give-back would be taken off the next one), the log's entry expired
    until_us: float = math.inf
    #: a bucket's (token bucket, GCRA): the units time gives back per us since ``taken_us``,
    #: the local clock's time of the reservation; and the units the limit lacked to be whole
    #: then (unknown: no fewer than any give-back): what a bucket refilled beyond those, it would
    #: have refilled anyway, and a give-back does not give them again
    refill_per_us: float = 0.0
    taken_us: int = 0
    missing: int = 2**53
    #: a storage call that admitted the request wrote it (a later call's refusal keeps it)
    written: bool = False


def note_windows(
    deferred: dict[str, Deferred],
    checks: Iterable[Check],
    decisions: Iterable[Decision],
    now_us: int,
    local_us: int,
) -> None:
    """Note how time gives back each reservation of ``deferred`` among ``checks`` (decided as
    ``decisions``), taken at the storage's time ``now_us`` (the local clock's ``local_us``): all
    at once when its window ends or its log entry expires, or a bucket's at its rate."""
    for c, decision in zip(checks, decisions, strict=True):
        d = deferred.get(c.key)
        if d is None:
            continue
        entry, period = REGISTRY[c.algorithm], c.period * 1_000_000
        left = period  # the log's entry leaves the window a period after it
        if entry.counted is not None:  # a window's count: until its window ends
            left = (now_us // period + 1) * period - now_us
        deferred[c.key] = dataclasses.replace(
            d,
            until_us=local_us + left - _LATE_US,
            refill_per_us=c.limit / period if entry.refills else 0.0,
            taken_us=local_us,
            missing=c.limit - decision.remaining,
        )


def reserved(bound: BoundLimit, *, unproved: bool) -> bool:
    """Whether ``bound`` is reserved before the view and settled after (module docstring): a
    ``deduct_when``, ``settle`` or bytes limit, or a conditional request free only on a 304."""
    spec = bound.spec
    return (
        spec.deduct_when is not None
        or spec.settle is not None
        or spec.unit != "requests"
        or unproved
    )


def _wants_charge(calls: SideCalls, later: Deferred, response: Response) -> bool:
    if later.free_if_not_modified and response.status_code == 304:
        return False
    when = later.check.bound.spec.deduct_when
    if when is None:
        return True
    try:
        return bool(when(response))
    except Exception as exc:  # the app's code: charge, the safe side for a login limit
        _failed(calls, later, "deduct_when", exc)
        return True


def _real_cost(calls: SideCalls, later: Deferred, response: Response, sent: int | None) -> int:
    """What the request really cost: for a bytes limit the body's bytes ``sent`` (``None``: the
    whole body, made; never read for a limit of requests, whose file or stream it would read
    here), else ``settle(response)``, else the ``cost_after`` limit's callable called now, else
    the reservation (also when the callable fails: logged)."""
    spec = later.check.bound.spec
    if spec.unit != "requests":
        return len(response.get_data()) if sent is None else sent
    call: Callable[[], object]
    if spec.settle is not None:
        name, call = "settle", functools.partial(spec.settle, response)
    elif later.cost_after and callable(spec.cost):
        name, call = "cost", spec.cost
    else:
        return later.check.cost
    try:
        value = call()
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TypeError(f"it returned {value!r}; it must return an int >= 0")
        return value
    except Exception as exc:
        _failed(calls, later, name, exc)
        return later.check.cost


def _failed(calls: SideCalls, later: Deferred, name: str, exc: Exception) -> None:
    """Log at ERROR that the ``name`` callable of ``later``'s limit failed after the response,
    at most once a minute per limit: a client may make it fail every time."""
    if paced(calls.paces, later.check.bound.name, calls.local_clock(), LOG_INTERVAL * 1e6):
        log.error(
            "The %s callable of the rate limit %s failed after the response (%s: %s); the "
            "request is charged its reservation. (Logged at most once a minute per limit.)",
            name, later.check.bound.name, type(exc).__name__, log_text(exc), exc_info=exc,
        )  # fmt: skip


def _difference(check: Check, charged: int, real: int) -> Check | None:
    """The check that settles the reservation ``check``, ``charged`` so far, to ``real``: a debt
    of what it cost beyond, a release of what it did not use, or ``None`` when it was charged
    its cost."""
    if real == charged:
        return None
    if real > charged:  # a debt of at most one whole limit per request
        return dataclasses.replace(check, cost=min(real - charged, check.limit), debt=True)
    return dataclasses.replace(check, cost=charged - real, release=True)


def charge(
    calls: SideCalls,
    deferred: dict[str, Deferred],
    response: Response,
    hold: Callable[[Holding], None],
) -> list[Report]:
    """Settle the reservations of ``deferred`` for ``response`` (module docstring), through
    ``calls.guard`` at ``calls.storage_now()``, in one call per failure policy (a request's
    limits have one, almost always); answer the report of each limit settled, but a shadow one
    (what is left after it: the response's headers tell that). Those settled when a streamed
    or file body ends go to ``hold`` (the request's ledger) as one holding."""
    head = request.method == "HEAD"  # no body is sent
    streamed = response.is_streamed or response.direct_passthrough  # a body not made yet
    due: list[tuple[Deferred, Check]] = []
    later: list[Deferred] = []
    for d in deferred.values():
        spec = d.check.bound.spec
        if not _wants_charge(calls, d, response):
            real = 0
        elif streamed and (spec.unit != "requests" or spec.settle is not None):
            later.append(d)  # settled when the body ends: its bytes, or what settle reads then
            continue
        else:
            real = _real_cost(calls, d, response, 0 if head else None)
        _count(calls, d, real)
        settlement = _difference(d.check, d.check.cost, real)
        if settlement is not None:
            due.append((d, settlement))
    deferred.clear()
    if later:
        hold(BodySettlement(calls, later, response, head=head))
    return _settle(calls, due)


def _count(calls: SideCalls, later: Deferred, units: int) -> None:
    """Tell the metrics (when set) that a request really cost ``units`` more on ``later``."""
    metrics = calls.guard.metrics
    if metrics is not None and units > 0:
        metrics.settled(later.check.key, later.check.bound.spec.unit, units)


def _settle(calls: SideCalls, due: list[tuple[Deferred, Check]]) -> list[Report]:
    by_policy: dict[FailurePolicy | None, list[Check]] = {}
    now = calls.local_clock()
    for later, settlement in due:
        if settlement.release:  # less what time gave back already (never twice: note_windows)
            refilled = math.floor((now - later.taken_us) * later.refill_per_us)  # a bucket's
            back = min(settlement.cost, later.missing - refilled)
            if back <= 0 or now >= later.until_us:
                continue
            settlement = dataclasses.replace(settlement, cost=back)
        by_policy.setdefault(later.policy, []).append(settlement)
    reports: list[Report] = []
    for policy, checks in by_policy.items():
        try:  # releases and debts never deny: the call is all or nothing only on an outage
            outcome = calls.guard.evaluate(checks, policy=policy, now_us=calls.storage_now())
        except Exception:  # the response is made: a failed settlement must not make a 500
            log.exception("A rate-limit settlement failed; %d settlement(s) dropped.", len(checks))
            continue
        if outcome.evaluation is None or outcome.unavailable:
            calls.guard.side_failed(
                f"an after-response charge or give-back of {len(checks)} rate limit(s)",
                "the storage did not decide (an outage, or a reply the limiter cannot read) and "
                f"the failure policy {policy or calls.guard.policy!r} drops it",
            )
            continue
        for c, d in zip(checks, outcome.evaluation.decisions, strict=True):
            if not c.shadow:  # clients would slow down for a limit that is not enforced
                reports.append(report_of(c.bound, d, denied=False))
    return reports


class BodySettlement:
    """A holding of the request's ledger (:mod:`flask_distlimit.defences.lifecycle`): the
    reservations settled when a streamed or file body ends, once. A bytes limit counts the
    chunks of the body as the server takes them (a client that went away: what was taken), a
    ``send_file`` body too (so the server iterates it rather than use ``sendfile(2)``), and
    while a long body is sent, charges what it sent beyond what is charged at least every
    :data:`SETTLE_EVERY_US` (the local clock, read at each chunk) and each time the ledger
    renews its holdings; ``settle`` is called when the body ends, with the response."""

    def __init__(
        self, calls: SideCalls, due: list[Deferred], response: Response, *, head: bool
    ) -> None:
        self._calls = calls
        self._due = due
        self._response = response
        self._done = False
        self._sent = 0  #: the body's bytes the server took (none for a HEAD)
        #: what each reservation has charged so far (a long stream's partial settlements)
        self._charged = [d.check.cost for d in due]
        self._clock = calls.local_clock
        self._settle_at = self._clock() + SETTLE_EVERY_US
        if not head and any(d.check.bound.spec.unit != "requests" for d in due):
            # A file too (the server's file wrapper): counted as sent, not by its length.
            body = response.response
            response.response = ClosingIterator(self._counting(body), getattr(body, "close", None))

    def _counting(self, body: Iterable[str] | Iterable[bytes]) -> Iterator[bytes]:
        """The chunks of ``body`` as the server takes them, their bytes counted; what was sent
        beyond what is charged is charged at least every :data:`SETTLE_EVERY_US`."""
        for chunk in body:  # a str chunk is sent as UTF-8, as werkzeug encodes it
            data = chunk if isinstance(chunk, bytes) else chunk.encode()
            self._sent += len(data)
            now = self._clock()
            if now >= self._settle_at:
                self._settle_at = now + SETTLE_EVERY_US
                self.renew()
            yield data

    def renew(self) -> None:
        """A long body: charge the bytes sent beyond what its bytes limits have charged."""
        if self._done:
            return
        due: list[tuple[Deferred, Check]] = []
        for i, d in enumerate(self._due):
            if d.check.bound.spec.unit != "requests" and self._sent > self._charged[i]:
                debt = _difference(d.check, self._charged[i], self._sent)
                if debt is not None:
                    due.append((d, debt))
                    self._charged[i] += debt.cost
                    _count(self._calls, d, debt.cost)
        if due:
            _settle(self._calls, due)

    def release(self) -> None:
        if self._done:
            return
        self._done = True
        due: list[tuple[Deferred, Check]] = []
        for d, charged in zip(self._due, self._charged, strict=True):
            real = _real_cost(self._calls, d, self._response, self._sent)
            _count(self._calls, d, real - (charged - d.check.cost))  # less what renew() told
            settlement = _difference(d.check, charged, real)
            if settlement is not None:
                due.append((d, settlement))
        _settle(self._calls, due)
