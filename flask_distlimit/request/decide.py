"""Deciding a request's checks: the local deny cache, a quota lease, else ONE storage call.

:meth:`Decider.decide` refuses a check that costs more than a whole window allows (a limit of 0
refuses every request, as Flask-Limiter's does; a shadow one only says it would), keeps one
check per key, asks the deny cache (:mod:`flask_distlimit.defences.deny_cache`), spends from the
request's one leased limit or else makes one ``guard.evaluate`` call for every check, refuses a
denial or an outage under ``closed`` (:mod:`flask_distlimit.request.refuse`), and keeps for the
headers the limit with the fewest units left, never a shadow or meta limit.
"""

from __future__ import annotations

import dataclasses
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, NoReturn

from flask import request

from flask_distlimit._typing import FailurePolicy
from flask_distlimit.core.decision import NEVER, Check, Decision, Evaluation
from flask_distlimit.defences.concurrency import SlotRelease
from flask_distlimit.defences.deny_cache import DenyCache, monotonic_us
from flask_distlimit.defences.lifecycle import Lifecycle
from flask_distlimit.defences.shadow import ShadowLog
from flask_distlimit.identity import Identity
from flask_distlimit.request import deduction
from flask_distlimit.request.data import RequestData
from flask_distlimit.request.headers import Evaluated, report_of
from flask_distlimit.request.plans import Plans
from flask_distlimit.request.refuse import Refusals
from flask_distlimit.resilience.guard import Guard
from flask_distlimit.resilience.leases import Leases
from flask_distlimit.resilience.outcome import Outcome

_KEY: Final = operator.attrgetter("key")
#: How the ids of the limits of every request begin: global and tier limits.
_ALL: Final = ("g:", "t:")


@dataclass(slots=True, kw_only=True)
class Decider:
    """Decides the checks of one app's requests (see the module docstring)."""

    guard: Guard
    leases: Leases
    plans: Plans  #: whether some limit leases
    refusals: Refusals
    lifecycle: Lifecycle
    deny_cache: DenyCache | None
    #: the injected clock, microseconds (None: the local monotonic clock, and the storage's own)
    clock: Callable[[], int] | None
    wall: Callable[[], float]  #: Unix seconds
    new_slots: Callable[[], SlotRelease]  #: a request's holding of concurrency slots
    shadow_log: ShadowLog = field(init=False)

    def __post_init__(self) -> None:
        self.shadow_log = ShadowLog(self.clock or monotonic_us)

    def _beyond(
        self,
        checks: list[Check],
        identity: Identity | None,
        data: RequestData,
        policy: FailurePolicy | None,
    ) -> list[Check]:
        """``checks`` but those no storage call decides. An enforced limit the request's cost
        exceeds refuses it, after the request's global and tier limits counted it (decided
        first, in one storage call: one of them may refuse it instead), as every refused request
        that reaches no view does, so such requests cannot flood past them. A limit of 0 is
        never stored: a shadow one is counted and logged here as a refusal, and one of cost 0
        has nothing to count. A shadow limit of 1 or more goes on: the storage says it would
        deny."""
        kept = []
        for c in checks:
            if c.limit and (c.shadow or c.cost <= c.limit):
                kept.append(c)
            elif c.cost and not c.shadow:
                data.unwritten()  # a refused call wrote nothing: never charged after the response
                every = [e for e in checks if e.cost <= e.limit and e.bound.limit_id[:2] in _ALL]
                if every:  # raises the 429 (or 503) of a global or tier limit that refuses
                    self.decide(every, identity, policy, data)
                refused = Decision(False, c.limit, 0, 0.0, NEVER)  # in RateLimit-Policy too
                data.evaluated.append(Evaluated((c,), (refused,), self.wall()))
                self.refusals.unaffordable(c, identity, data)
            else:  # a limit of 0, never stored: a shadow one, or a request of cost 0
                data.deferred.pop(c.key, None)
                if c.cost:  # the shadow limit's refusal, counted as the storage's would be
                    if self.guard.metrics is not None:
                        decision = Decision(False, 0, 0, 0.0, NEVER, True)
                        self.guard.metrics.evaluated([c], Evaluation((decision,)))
                    self.shadow_log.would_deny([c])
        return kept

    def _from_cache(
        self,
        checks: list[Check],
        identity: Identity | None,
        data: RequestData,
        cache: DenyCache,
    ) -> None:
        """Refuse the request if the deny cache holds a denial of one of its checks."""
        now = monotonic_us() if self.clock is None else self.clock()
        for c in checks:
            denial = cache.lookup(c.key, c.cost, now)
            if denial is None:
                continue
            wait = denial.retry_after(now)
            decision = Decision(False, denial.limit, 0, denial.reset_after(now), wait)
            metrics = self.guard.metrics
            if metrics is not None:  # count the refusal as if the storage had made it
                metrics.evaluated([c], Evaluation((decision,)))
            report = report_of(c.bound, decision, denied=True)
            self.refusals.refuse([c], report, identity, data, from_cache=True)

    def decide(
        self,
        checks: list[Check],
        identity: Identity | None,
        policy: FailurePolicy | None,
        data: RequestData,
        *,
        simple: bool = False,
    ) -> None:
        """Decide ``checks`` under the failure policy ``policy``; raise on a refusal.
        ``simple``: no slot and no shadow limit among them."""
        for c in checks:
            if c.cost > c.limit or not c.limit:
                checks = self._beyond(checks, identity, data, policy)
                if not checks:
                    return
                break
        if len(checks) > 1 and len(set(map(_KEY, checks))) != len(checks):
            first: dict[str, Check] = {}
            for c in checks:
                first.setdefault(c.key, c)  # one check per key: the first
            checks = list(first.values())
        cache = self.deny_cache
        if cache is not None and cache.entries:
            self._from_cache(checks, identity, data, cache)
        leasing = self.plans.leasing
        if leasing and len(checks) == 1 and checks[0].bound.spec.lease:  # resilience.leases
            leased = self.leases.spend_one(checks[0])
            if leased is not None:  # the usual leased request: no storage call
                # no slot, shadow or deduct_when limit can be leased
                data.evaluated.append(Evaluated(checks, (leased,), self.wall()))
                report = report_of(checks[0].bound, leased, denied=False)
                if data.report is None or report.remaining < data.report.remaining:
                    data.report = report
                return
        slots = [] if simple else [c for c in checks if c.token]
        if slots:  # given back when the response ends, whatever happens from here
            if data.slots is None:
                data.slots = self.new_slots()
                # given back when the response ends, however (flask_distlimit.defences.lifecycle)
                self.lifecycle.ledger(request.environ).take(data.slots)
            data.slots.add(slots)
            if self.guard.owed:  # slots a stall left taken: given back before these are taken
                self.guard.evaluate_beside((), "an owed concurrency slot's give-back")
        # no clock injected: no call of ours to read the time (this runs on every request)
        now_us = None if self.clock is None else self.clock()
        started = time.monotonic_ns() // 1000 if now_us is None else now_us
        if leasing and any(c.bound.spec.lease for c in checks):  # flask_distlimit.resilience.leases
            outcome = self.leases.evaluate(checks, policy=policy, now_us=now_us)
        else:
            outcome = self.guard.evaluate(checks, policy=policy, now_us=now_us)
            if leasing:  # after a storage call: leased units left unspent go back
                self.leases.housekeeping()
        if slots and data.slots is not None:
            if outcome.degraded and outcome.evaluation is not None:
                data.slots.held_locally()  # decided by the local fallback
            elif outcome.evaluation is not None and not outcome.evaluation.allowed:
                data.slots.discard(slots)  # refused: the storage took none
        if outcome.unavailable:
            self.refusals.unavailable(data, busy=outcome.busy)
        evaluation = outcome.evaluation
        if evaluation is None:  # storage down, policy "open"
            data.degraded = True
            data.unwritten()  # this call reserved nothing: nothing of it to give back
            return
        decisions = evaluation.decisions
        if data.deferred and evaluation.now_us:  # never given back to the window after theirs
            local = monotonic_us() if self.clock is None else self.clock()
            deduction.note_windows(data.deferred, checks, decisions, evaluation.now_us, local)
        # kept as they are; limiter.current_limits reads them only when asked
        data.evaluated.append(Evaluated(checks, decisions, self.wall()))
        if data.deferred or not simple:
            self._shadow(checks, decisions, data)
        # Report the limit with the fewest units left (ties: the latest reset); never a shadow
        # limit (clients would slow down for a limit that is not enforced), a slot or a meta
        # limit; refuse at the first denial instead. Compared in place: no record made per check.
        best: Check | None = None
        least: Decision | None = None
        for c, d in zip(checks, decisions, strict=True):
            if not d.allowed:
                self._refuse(checks, decisions, identity, data, outcome, started)
            if c.shadow or c.token or c.meta:
                continue
            if (
                least is None
                or d.remaining < least.remaining
                or (d.remaining == least.remaining and d.reset_after > least.reset_after)
            ):
                best, least = c, d
        if best is not None and least is not None:
            report = report_of(best.bound, least, denied=False)
            if data.report is None or report.remaining < data.report.remaining:
                data.report = report
        data.degraded = data.degraded or outcome.degraded
        for key, later in data.deferred.items():  # written: settled if a later call refuses
            data.deferred[key] = dataclasses.replace(later, written=True)

    def _refuse(
        self,
        checks: list[Check],
        decisions: Sequence[Decision],
        identity: Identity | None,
        data: RequestData,
        outcome: Outcome,
        started: int,
    ) -> NoReturn:
        """Remember the denials in the deny cache, then refuse the request (a 429)."""
        cache = self.deny_cache
        finished = monotonic_us() if self.clock is None else self.clock()
        meta = checks[-1].meta  # meta checks come last (request.checks); none in a simple call
        by_meta = meta and any(
            c.meta and not d.allowed for c, d in zip(checks, decisions, strict=True)
        )
        denials = [
            (c, d)
            for c, d in zip(checks, decisions, strict=True)
            if not d.allowed and c.meta == by_meta
        ]
        if cache is not None and not outcome.degraded and by_meta == meta:
            for c, d in denials:  # not a slot, nor a reservation: either may come back soon
                if not c.token and c.key not in data.deferred:
                    cache.record(c, d, started_us=started, finished_us=finished)
        # the denial the client waits longest for binds (ties: the first)
        longest, wait = max(denials, key=lambda denial: denial[1].retry_after)
        self.refusals.refuse(
            [c for c, _ in denials],
            report_of(longest.bound, wait, denied=True),
            identity,
            data,
            from_cache=False,
            degraded=outcome.degraded,
        )

    def _shadow(
        self, checks: list[Check], decisions: Sequence[Decision], data: RequestData
    ) -> None:
        """Count and log what the shadow limits would have refused (never refused; never in
        ``simple`` checks, which hold no shadow limit)."""
        denied = [c for c, d in zip(checks, decisions, strict=True) if d.shadow_denied]
        for c in denied:  # not written: its reservation is not given back
            data.deferred.pop(c.key, None)
        if denied:
            self.shadow_log.would_deny(denied)
