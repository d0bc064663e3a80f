"""Quota leasing: a process takes units of a hot limit in advance and spends them in-process.

:class:`Leases` is every lease (:mod:`flask_distlimit.resilience.lease`) of one app in this
process; :meth:`Leases.evaluate` stands in for the guard's when a request has a leased limit
(``lease=True`` or ``lease=<units>``). Every unit spent was consumed from the shared count first,
so the fleet never admits more than the limit; renewal rides on a request's one storage call;
units left unspent go back to the window they were taken in (:meth:`Leases.housekeeping`);
a refused request puts its units back; a fork, or a reset of their counts (:meth:`Leases.drop`),
drops them. No background thread; the clock is the app's. docs/leasing.md says how and why.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Final

from flask_distlimit._typing import FailurePolicy
from flask_distlimit.core.decision import Check, Decision, Evaluation
from flask_distlimit.declare.lease_options import auto_cap
from flask_distlimit.forks import AfterFork
from flask_distlimit.resilience.guard import Guard
from flask_distlimit.resilience.holdings import record_of
from flask_distlimit.resilience.instances import process_member
from flask_distlimit.resilience.lease import GIVE_BACK_AFTER_US, Lease, Spent
from flask_distlimit.resilience.outcome import Outcome
from flask_distlimit.telemetry.metrics import limit_label

if TYPE_CHECKING:
    from flask_distlimit.declare.route_limits import BoundLimit
    from flask_distlimit.storage.base import Storage


#: The most leases one process keeps per app; the least recently used go first.
MAX_LEASES: Final = 1024
#: A process publishes what it holds, and gives back units it left unspent, at most this often,
#: after a storage call (microseconds).
PUBLISH_INTERVAL_US: Final = 1_000_000
#: The most leases one pass gives back (each a storage call of its own).
GIVE_BACK_PER_PASS: Final = 8
_US: Final = 1_000_000
#: A leased check decided in-process, until its lease's decision replaces it.
_IN_PROCESS: Final = Decision(True, 0, 0, 0.0, 0.0)


def _give(
    lease: Lease, window: int, units: int, now_us: int | None, storage: Storage
) -> tuple[str, ...]:
    """Give back ``units`` of ``lease`` left unspent in ``window`` (a side call: an error
    reply is counted and logged there, and the units are not given back)."""
    period = lease.period_us // _US
    storage.give_back(lease.key, lease.algorithm, period, window, units, now_us=now_us)
    return ()


@dataclass(slots=True)
class _Ask:
    """A leased check of the request: what it spent of its lease, and asks of the storage."""

    index: int
    lease: Lease
    spent: Spent  #: what it spent of the lease (none: it did not hold the cost)
    need: int  #: units the request needs from the storage (none: the lease held the cost)
    renew: int  #: the top-up asked for (less on a second try)
    claimed: bool  #: this request renews the lease: it clears ``renewing``


_all: AfterFork[Leases] = AfterFork(lambda leases: leases.after_fork())


class Leases:
    """Every lease of one app's limiter in this process; :meth:`evaluate` stands in for
    :meth:`Guard.evaluate <flask_distlimit.resilience.guard.Guard.evaluate>` when a request has a
    leased limit."""

    def __init__(
        self, guard: Guard, clock: Callable[[], int], storage_now: Callable[[], int | None]
    ) -> None:
        self.guard = guard
        self.clock = clock
        self.storage_now = storage_now  #: the injected time for the storage (tests)
        #: the leased limits bound so far: key tail -> the largest lease of it, in units
        self._declared: dict[str, int] = {}
        #: where every process of the app publishes what it holds (for ``inspect``)
        self.records_key = f"{guard.key_prefix}:leases"
        self.after_fork()
        _all.add(self)

    def declare(self, bounds: Sequence[BoundLimit]) -> bool:
        """Note the leased limits among ``bounds`` (bound for a route); true if any."""
        leased = [b for b in bounds if b.spec.lease is not False]
        for b in leased:
            size = auto_cap(b.rate.amount) if b.spec.lease is True else int(b.spec.lease)
            self._declared[b.key_tail] = size
        return bool(leased)

    def largest(self, key: str) -> int | None:
        """The most units a process leases of the limit stored under ``key`` (``None``: not
        a leased limit, or none of its routes bound yet)."""
        declared = list(self._declared.items())  # declare() may add meanwhile
        return next((size for tail, size in declared if key.endswith(tail)), None)

    def after_fork(self) -> None:
        """A forked child holds nothing: the parent's units are the parent's (also the initial
        state)."""
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self.process = process_member()
        self._look_at = 0  #: the local time (us) from which leases are looked at again
        self._publish_at = 0  #: the local time (us) from which a publication may be made again
        #: a renewal was granted (or a reset dropped units) since the last publication
        self._renewed = False

    def drop(self, keys: Iterable[str] | None = None) -> None:
        """Forget the leases of ``keys`` (``None``: every lease), whose counts were just
        deleted (``limiter.reset()``, a client's reset, ``limiter.clear()``): their units were
        counted in the deleted count, so spent after it, or given back into the count that
        follows, they would be admissions the fresh count never sees. A renewal in flight
        meanwhile grants its units to a lease no request finds again (they are lost, never
        spent twice)."""
        with self._lock:
            gone = list(self._leases) if keys is None else keys
            dropped = [lease for key in gone if (lease := self._leases.pop(key, None))]
        for lease in dropped:
            if lease.clear():
                # published again after the next storage call: inspect counts what a record
                # lists as used, for as long as the units would have been good
                self._renewed = True

    def _lease(self, check: Check, size: bool | int, now: int) -> Lease:
        lease = self._leases.get(check.key)
        if lease is not None:
            return lease
        with self._lock:
            lease = self._leases.get(check.key)
            if lease is None:
                if len(self._leases) >= MAX_LEASES:
                    self._evict(now)
                lease = self._leases[check.key] = Lease(check, size, now)
        return lease

    def _evict(self, now: int) -> None:
        """Drop half the leases: those that hold no unit first (a client with a few requests
        holds none), the least recently used first. A lease that holds units goes only when
        fewer than half hold none: its units stay counted in the shared count until their
        window or bucket period ends, so a flood of fresh identities would otherwise strand a
        hot key's units again and again."""

        def order(lease: Lease) -> tuple[bool, int]:
            return lease.holds(now).units > 0, lease.used

        ordered = sorted(self._leases.values(), key=order)
        for lease in ordered[: len(ordered) // 2 or 1]:
            del self._leases[lease.key]

    def units_of(self, label: str) -> float:
        """Units held in the leases of one limit (its metrics label), every identity's."""
        now = self.clock()
        leases = list(self._leases.values())
        return sum(lease.holds(now).units for lease in leases if limit_label(lease.key) == label)

    def housekeeping(self) -> None:
        """After a storage call of this process: at most once a second, give back the units
        of fixed windows and counters that leases left unspent; and, at most once a second,
        publish what the process holds if a renewal was granted or units went back since it
        last did (each a storage call of its own, beside the request's)."""
        now = self.clock()
        gave = False
        if now >= self._look_at:
            with self._lock:
                look, self._look_at = now >= self._look_at, now + PUBLISH_INTERVAL_US
            gave = look and self._give_back(now)
        if (gave or self._renewed) and now >= self._publish_at:
            with self._lock:
                if now < self._publish_at:
                    return
                self._publish_at, self._renewed = now + PUBLISH_INTERVAL_US, False
            self._publish(now)

    def _give_back(self, now: int) -> bool:
        """Give back what leases left unspent (:meth:`Lease.unspent`); true if any."""
        passes = 0
        for lease in list(self._leases.values()):
            if passes >= GIVE_BACK_PER_PASS:
                break
            # (used is read without its lock: unspent() looks again under it)
            idle = lease.gives_back and now - lease.used >= GIVE_BACK_AFTER_US
            # while no call can be made (the breaker of its node is open, or trying) the units
            # stay in the lease, spent first when its traffic comes back, instead of being
            # taken out for a give-back that is never made
            if idle and self.guard.breaker_of(lease.key).state == "closed":
                for window, units in lease.unspent(now):
                    passes += 1
                    give = functools.partial(_give, lease, window, units, self.storage_now())
                    self.guard.side_call(lease.key, give, "a lease's give-back")
        return passes > 0

    def _publish(self, now: int) -> None:
        """Publish what this process holds (a storage call of its own, which counts and logs
        an error reply)."""
        record, hold = record_of(list(self._leases.values()), now)
        key, process = self.records_key, self.process

        def publish(storage: Storage) -> tuple[str, ...]:
            return storage.publish_leases(key, process, record, hold)

        self.guard.side_call(key, publish, "the lease records")

    def held(self) -> dict[str, dict[str, object]]:
        """The leases this process holds, by storage key (``health()["leases"]``)."""
        now = self.clock()
        return {key: lease.report(now) for key, lease in list(self._leases.items())}

    def spend_one(self, check: Check) -> Decision | None:
        """The usual leased request, its only limit ``check``: spent out of the lease, which
        needs no renewal, with no storage call; its decision. ``None``, and nothing spent, when
        :meth:`evaluate` must decide (no lease yet, not enough held, time to renew)."""
        lease = self._leases.get(check.key)
        if lease is None or check.cost <= 0 or check.shadow:
            return None
        decision = lease.spend(check.cost, self.clock())
        if decision is not None and self.guard.metrics is not None:
            self.guard.metrics.leased((check.key,))
        return decision

    def evaluate(
        self,
        checks: Sequence[Check],
        *,
        policy: FailurePolicy | None,
        now_us: int | None,
    ) -> Outcome:
        """Decide ``checks`` (those of a leased limit out of its lease where it holds enough)
        with at most the storage calls the rest and the renewals need; the answer is
        :meth:`Guard.evaluate`'s, with one decision per check of ``checks``."""
        now = self.clock()

        asks: list[_Ask] = []
        plain: list[int] = []
        for i, c in enumerate(checks):
            leased = c.bound.spec.lease if c.bound is not None else False
            if leased is False or c.cost <= 0 or c.shadow:
                plain.append(i)
                continue
            lease = self._lease(c, leased, now)
            # renewed only while the breaker of the lease key's own node (Redis Cluster) is
            # closed and its local fallback holds nothing: a top-up never goes to the failure
            # policy (asked only when one is due)
            spent, renew = lease.take(c.cost, now, functools.partial(self.guard.renewable, c.key))
            asks.append(_Ask(i, lease, spent or [], 0 if spent else c.cost, renew, renew > 0))
        try:
            outcome, sent = self._call(checks, plain, asks, policy, now_us)
        except BaseException:
            for a in asks:
                a.lease.give_back(a.spent, now)
            raise
        finally:
            for ask in asks:
                if ask.claimed:
                    with ask.lease.lock:
                        ask.lease.renewing = False
        if plain or any(a.need or a.renew for a in asks):  # the storage was called
            self.housekeeping()
        after = self.clock()
        evaluation = outcome.evaluation
        if outcome.unavailable or (evaluation is not None and not evaluation.allowed):
            for a in asks:
                a.lease.give_back(a.spent, after)
        elif self.guard.metrics is not None and any(a.spent for a in asks):
            self.guard.metrics.leased([checks[a.index].key for a in asks if a.spent])
        if evaluation is None:
            return outcome
        # the decisions put back at the indexes of checks
        merged = [_IN_PROCESS] * len(checks)
        for i, d in zip([*plain, *(a.index for a in sent)], evaluation.decisions, strict=True):
            merged[i] = d
        granted = evaluation.allowed and not outcome.degraded  # the top-ups sent were granted
        for a in asks:
            # covered by its lease, or topped up (else refused with its top-up, so is the
            # request): the shared count as last seen plus what the lease holds
            if merged[a.index].allowed and (a.spent or (granted and a.renew)):
                merged[a.index] = a.lease.decision(after)
        return replace(outcome, evaluation=Evaluation(tuple(merged), evaluation.repaired_keys))

    def _call(
        self,
        checks: Sequence[Check],
        plain: list[int],
        asks: list[_Ask],
        policy: FailurePolicy | None,
        now_us: int | None,
    ) -> tuple[Outcome, list[_Ask]]:
        """The storage calls: the request's checks with the top-ups; asked again for less when
        only top-ups refused. Answers the last call's outcome (its decisions: those of
        ``plain``, then those of the asks sent with it), and those asks."""
        for attempt in range(3):
            sent = [a for a in asks if a.need + a.renew > 0]
            if not plain and not sent:  # every check decided in-process
                return Outcome(Evaluation(())), []
            call = [checks[i] for i in plain]
            call += [replace(checks[a.index], cost=a.need + a.renew) for a in sent]
            started = self.clock()
            # Only top-ups: if the storage fails, the leases covered the request, and no failure
            # policy is to charge the local fallback with a lease it never grants.
            renewing_only = not plain and all(a.need == 0 for a in sent)
            outcome = self.guard.evaluate(
                call, policy="open" if renewing_only else policy, now_us=now_us
            )
            evaluation = outcome.evaluation
            if renewing_only and (outcome.degraded or evaluation is None):
                return Outcome(Evaluation(())), []  # the leases covered the request
            if evaluation is None:
                return outcome, sent
            answers = list(zip(sent, evaluation.decisions[len(plain) :], strict=True))
            if evaluation.allowed and not outcome.degraded:
                after = self.clock()
                metrics = self.guard.metrics
                for a, d in answers:
                    a.lease.granted(a.renew, d, started, after, evaluation.now_us)
                    if a.renew:
                        self._renewed = True
                        if metrics is not None:
                            metrics.watch_lease_units(a.lease.key, self.units_of)
                return outcome, sent
            refused = [(a, d) for a, d in answers if not d.allowed]
            if attempt == 2 or not any(a.renew for a, _ in refused):
                return outcome, sent
            # Refused, and a refused check carried a top-up (it answered for its cost with the
            # top-up). If the storage answered and the request's own needs fit, ask again for
            # what the reply says remains, then for nothing but them; if they do not, ask once
            # more for them alone, so that the refusal (its Retry-After, and the deny cache's
            # wait) is for what the request needs: a bucket's wait for 1 + 6 units is 7 times its
            # wait for 1. If the local fallback refused a top-up (the storage failing, over this
            # process's share), ask again for the request's own needs alone: a top-up is never
            # granted while the storage fails, and never what refuses a request (all-or-nothing:
            # the refused call charged nothing).
            fits = (
                attempt == 0
                and not outcome.degraded
                and all(d.allowed for d in evaluation.decisions[: len(plain)])
                and all(a.renew and a.need <= d.remaining for a, d in refused)
            )
            for a, d in answers:
                if a.renew:
                    a.renew = max(0, min(a.renew, d.remaining - a.need)) if fits else 0
        raise AssertionError("unreachable")  # pragma: no cover
