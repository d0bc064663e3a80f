"""The local fallback: limits enforced in-process while the shared storage fails.

Under policy ``"local"`` unanswered checks are decided by an in-process
:class:`~flask_distlimit.storage.memory.MemoryStorage` at this process's share, ``floor(limit /
instances)``, at least 1. Promises: at most ``L`` per window fleet-wide, plus what the fleet
admitted in the tenth of a period before an outage; memory bounded by ``max_keys``, never by
lifting a limit; nothing written back to Redis. Design: docs/design-notes.md, "The local fallback".
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Final

from flask_distlimit.core.algorithms import Algorithm
from flask_distlimit.core.decision import NEVER, Check, Evaluation
from flask_distlimit.core.pacing import Pace
from flask_distlimit.engine.registry import REGISTRY
from flask_distlimit.resilience.last_known import LastKnown
from flask_distlimit.storage.base import Storage

# Imported here, not on the first local decision: an import in the middle of an outage held every
# other thread of the worker for as long as it took (16 ms idle, 180-340 ms on a busy machine).
from flask_distlimit.storage.memory import MemoryStorage

log = logging.getLogger("flask_distlimit.guard")  # a public name (docs/failure-modes.md), kept

#: What Redis said was left for a key is trusted for this fraction of the key's period after it
#: said it; an older figure gives the key no local budget until its quota is whole again.
FRESHNESS: Final = 0.1

#: The most keys one fallback counts (``DISTLIMIT_FALLBACK_MAX_KEYS``): up to 50 MB.
DEFAULT_MAX_KEYS: Final = 50_000

_FOREVER = float("inf")
_SWEEP_MIN = 1024
_US = 1_000_000

#: A key's algorithm and period: how long its local admissions stay in the windows Redis sees.
_Kind = tuple[Algorithm, int]


def divided_limit(limit: int, instances: int) -> int:
    """One instance's share of ``limit``: ``floor(limit / instances)``, at least 1."""
    return max(1, limit // instances)


def _overflow(check: Check) -> Check:
    """``check`` on its limit's overflow key: its key without the identity tag, and its rate."""
    tail = check.key.rpartition("}")[2] if "}" in check.key else ""
    key = f"overflow{tail}:{check.algorithm}:{check.limit}/{check.period}"
    return dataclasses.replace(check, key=key)


def _divided(check: Check, instances: int) -> Check:
    return dataclasses.replace(check, limit=divided_limit(check.limit, instances))


class LocalFallback:
    """Decides checks in-process at each limit's per-instance share, and keeps those counts
    while they matter (see the module docstring).

    ``factory`` builds the in-process store (default: a fresh ``MemoryStorage``); it is called
    lazily, on the first local decision after the store was dropped. ``clock`` (monotonic
    seconds) times the settling. ``settle``: seconds after this process's last failure, and
    after its first success following a failure, during which every request is counted here too
    (the guard passes the breaker's reset timeout).
    ``last_known`` tells where a key's local budget starts; without it, from a whole share.
    ``max_keys``: the most keys counted here (the module docstring's "Memory").
    """

    def __init__(
        self,
        factory: Callable[[], Storage] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        settle: float = 30.0,
        last_known: LastKnown | None = None,
        max_keys: int = DEFAULT_MAX_KEYS,
    ) -> None:
        self.max_keys = max_keys
        self._full_sweep_at = -_FOREVER
        self._full_pace = Pace(60.0)  # the WARNING that the fallback is full
        self._factory: Callable[[], Storage] = factory or MemoryStorage
        self._clock = clock
        self.settle = settle
        self.last_known = last_known
        self._wall_offset_us = 0  # the storage's time (now_us) minus clock(), in microseconds
        self._lock = threading.Lock()
        self._storage: Storage | None = None
        self._drop_locked()

    def drop(self) -> None:
        """Forget every local count (nothing is written back to the storage)."""
        with self._lock:
            self._drop_locked()

    def _drop_locked(self) -> None:
        """Close the store and start afresh: nothing counted, engaged or held."""
        storage, self._storage = self._storage, None
        #: key -> clock() until which its local count is known complete (see _cover).
        self._covered: dict[str, float] = {}
        #: keys decided here (a failure), with their kind and clock() of their last local
        #: decision: held to the end of a window (_hold, _holds).
        self._decided: dict[str, tuple[_Kind, float]] = {}
        #: kind -> clock() until which a key of that kind decided here is held (see _engage).
        self._hold: dict[_Kind, float] = {}
        self._failed = False  # a failure since the last success: the next success engages
        #: clock() of the last failure (or first success after it) + settle
        self._engaged_until: float = -_FOREVER
        #: the latest of every moment above: the store is dropped then
        self._until: float = -_FOREVER
        self._sweep_at: int = _SWEEP_MIN
        if storage is not None:
            storage.close()

    @property
    def active(self) -> bool:
        """True while the fallback holds counts that still matter."""
        return self._storage is not None and self._clock() < self._until

    @property
    def pending(self) -> bool:
        """A failure awaits its first success after it, which will engage the fallback."""
        return self._storage is not None and self._failed

    @property
    def holding(self) -> bool:
        """True while the in-process store exists (cheap: no clock, no lock)."""
        return self._storage is not None

    @property
    def engaged(self) -> bool:
        """True within ``settle`` seconds of this process's last failure, or of its first
        success after a failure."""
        return self._clock() < self._engaged_until

    def covers(self, key: str) -> bool:
        """Is ``key`` counted here (every admission of it since it entered)? Cheap: no lock."""
        return key in self._covered

    def held(self) -> int:
        """How many keys are counted here now."""
        now = self._clock()
        with self._lock:
            return sum(1 for key, until in self._covered.items() if self._holds(key, until, now))

    def evaluate(
        self, checks: Sequence[Check], *, instances: int, now_us: int | None = None
    ) -> Evaluation:
        """Decide ``checks`` locally (the storage failed), each limit divided by ``instances``."""
        with self._lock:
            now = self._clock()
            storage = self._storage
            if storage is None or now >= self._until:
                self._drop_locked()
                storage = self._storage = self._factory()
            self._failed = True
            self._engage(now, now_us)
            checks = self._placed(checks, now)
            for check in checks:
                # decided here at now: held to the end of the window that contains the end of
                # this process's engagement, at most two settling periods after now (_holds)
                kind = (check.algorithm, check.period)
                self._decided[check.key] = (kind, now)
                if kind not in self._hold:
                    self._hold_kind(kind, self._engaged_until)
                if check.key not in self._covered:
                    self._enter(storage, check, instances, now_us)
            evaluation = storage.evaluate([_divided(c, instances) for c in checks], now_us=now_us)
            for check, decision in zip(checks, evaluation.decisions, strict=True):
                # Its local admissions leave every window when the quota it saw is whole: at
                # most two periods (min() keeps its first argument over an inf or NaN second).
                settle = min(2 * check.period, decision.reset_after)
                self._cover(check.key, max(now + settle, self._engaged_until))
            if len(self._covered) >= self._sweep_at:
                self._sweep(now)
        return evaluation

    def _placed(self, checks: Sequence[Check], now: float) -> Sequence[Check]:
        """``checks``, each on its own key if counted here or if there is room, else on its
        limit's overflow key (the module docstring's "Memory")."""
        covered = self._covered
        room = self.max_keys - len(covered)
        if room >= len(checks):
            return checks
        if now >= self._full_sweep_at:  # full: forget the keys no longer held, once a second
            self._full_sweep_at = now + 1.0
            self._sweep(now)
            room = self.max_keys - len(covered)
        placed: list[Check] = []
        for check in checks:
            if check.key in covered or room > 0:
                room -= check.key not in covered
                placed.append(check)
                continue
            placed.append(_overflow(check))
            held = self._full_pace.due(now)  # once a minute at most, with the decisions since
            if held is not None:
                log.warning(
                    "distlimit: the local fallback is full (DISTLIMIT_FALLBACK_MAX_KEYS = %d "
                    "keys): %d decisions since the last such line shared their limits' overflow "
                    "keys. Raise the setting if an outage's real traffic needs more "
                    "(docs/failure-modes.md).",
                    self.max_keys,
                    held + 1,
                )
        return placed

    def release(
        self, checks: Sequence[Check], *, instances: int, now_us: int | None, refund: bool = False
    ) -> None:
        """Give back, in the in-process store, the concurrency slots ``checks`` took there
        (:attr:`Check.release <flask_distlimit.core.decision.Check.release>` checks): the request
        ended; with ``refund``, undo a local admission of ``checks`` instead (:meth:`evaluate`
        admitted them, but the request was refused elsewhere: by another node's fallback on a
        Redis Cluster). Nothing else changes: a give-back is no failure of the storage, so it
        never engages the fallback, holds a key or starts a store (a slot taken here before the
        store was dropped is gone with it)."""
        with self._lock:
            storage = self._storage
            if storage is not None and checks:
                run = storage.refund if refund else storage.evaluate
                covered = self._covered  # a key not counted here was decided on its overflow key
                on = [c if c.key in covered else _overflow(c) for c in checks]
                run([_divided(c, instances) for c in on], now_us=now_us)

    def refusal(
        self, checks: Sequence[Check], *, instances: int, now_us: int | None = None
    ) -> Evaluation | None:
        """The local refusal of a request over this process's share of a key counted here, or
        ``None``: ask Redis. Decided before the call, so that Redis never counts a request that
        :meth:`charge` would refuse (a sliding window would hold that phantom for a whole period
        and admit less and less). A pure read: the local counts are peeked at cost 0; a refused
        check's ``retry_after`` is its ``reset_after``, when the quota is whole again (an upper
        bound)."""
        if self._storage is None:  # nothing held: the path of every healthy request
            return None
        with self._lock:
            now = self._clock()
            storage = self._storage
            if storage is None or now >= self._until:
                return None
            engaged = now < self._engaged_until
            covered = [
                i
                for i, c in enumerate(checks)
                if not (c.release or c.debt)
                and (until := self._covered.get(c.key)) is not None
                and (engaged or self._holds(c.key, until, now))
            ]
            if not covered:
                return None
            peek = storage.evaluate(
                [dataclasses.replace(_divided(c, instances), cost=0) for c in checks],
                now_us=now_us,
            )
        decisions = list(peek.decisions)
        refused = False
        for i in covered:
            decision, cost = decisions[i], checks[i].cost
            if decision.remaining < cost:
                if checks[i].shadow:  # counted here too, but never refuses
                    decisions[i] = dataclasses.replace(decision, shadow_denied=True)
                    continue
                refused = True
                wait = NEVER if cost > decision.limit else decision.reset_after
                decisions[i] = dataclasses.replace(decision, allowed=False, retry_after=wait)
        return Evaluation(tuple(decisions)) if refused else None

    def charge(
        self,
        checks: Sequence[Check],
        evaluation: Evaluation,
        *,
        instances: int,
        now_us: int | None = None,
    ) -> Evaluation | None:
        """Redis admitted ``checks`` (its ``evaluation``; the guard has shown it to
        ``last_known``): count them here too while they matter.

        Answers ``None`` when the request stays admitted, or the evaluation refusing it (the
        local decision for the keys counted here, Redis's for the others) when it exceeds this
        process's share. Redis has counted it then: the error is on the strict side.
        """
        if self._storage is None:  # nothing held: the path of every healthy request
            return None
        with self._lock:
            storage = self._storage
            if storage is None:
                return None
            now = self._clock()
            if self._failed:
                # The first success after a failure: Redis is back for this process, not yet
                # for those whose breakers are still open (they try again at most a reset
                # timeout after opening, before Redis came back): count everything here until
                # then (docs/design-notes.md, "Handing back").
                self._failed = False
                self._engage(now, now_us)
            if now >= self._until:
                self._drop_locked()  # settled: Redis alone is exact again
                return None
            engaged = now < self._engaged_until
            counted: list[int] = []
            for i, check in enumerate(checks):
                until = self._covered.get(check.key)
                if until is not None and (engaged or self._holds(check.key, until, now)):
                    counted.append(i)  # every admission of it since it entered is counted here
                elif engaged and len(self._covered) < self.max_keys:
                    # Failures go on: from now on this key counts here too, starting from what
                    # Redis just said was left (this request included).
                    self._enter(storage, check, instances, now_us)
                    self._cover(check.key, self._engaged_until)
                elif until is not None:
                    # Settled: Redis alone is exact for it, and this admission is not counted
                    # here, so its local count is incomplete from now on.
                    del self._covered[check.key]
                    self._decided.pop(check.key, None)
                    storage.delete([check.key])
            if not counted:
                return None
            local = storage.evaluate(
                [_divided(checks[i], instances) for i in counted], now_us=now_us
            )
            for i in counted:
                if engaged:
                    self._cover(checks[i].key, self._engaged_until)
        if local.allowed:
            return None
        decisions = list(evaluation.decisions)
        for i, decision in zip(counted, local.decisions, strict=True):
            decisions[i] = decision
        return Evaluation(tuple(decisions))

    def _enter(self, storage: Storage, check: Check, instances: int, now_us: int | None) -> None:
        """Start counting ``check``'s key here from what Redis last said was left: this
        process's part of it, ``remaining // instances``, at most the share."""
        storage.delete([check.key])  # counts of an earlier spell no longer matter
        # this process's share of it, spent: charged, not settled
        local = dataclasses.replace(_divided(check, instances), release=False, debt=False)
        reading = None if self.last_known is None else self.last_known.reading(check)
        # Nothing said since the quota was whole: a whole share (module docstring); an older
        # figure says nothing of what the others spent since: nothing is left here.
        spent = 0
        if reading is not None:
            left = reading.remaining if reading.age <= FRESHNESS * check.period else 0
            spent = local.limit - min(local.limit, max(0, left) // max(1, instances))
        overflow = _overflow(check).key
        if not check.token and overflow in self._covered:
            # it may have spent there: no more than what its limit's overflow key has left
            peek = storage.evaluate(
                [dataclasses.replace(local, key=overflow, cost=0)], now_us=now_us
            )
            spent = max(spent, local.limit - max(0, peek.decisions[0].remaining))
        if spent > 0:
            storage.evaluate([dataclasses.replace(local, cost=spent)], now_us=now_us)

    def _engage(self, now: float, now_us: int | None) -> None:
        """A failure at ``now``, or the first success after one: remember how the storage's
        time (``now_us``, else the wall clock) maps onto clock(); count every request here for
        ``settle`` seconds at least, and every key decided here until the end of the window
        that contains that moment (:meth:`_window_end`)."""
        wall_us = time.time_ns() // 1_000 if now_us is None else now_us
        self._wall_offset_us = wall_us - round(now * _US)
        until = now + self.settle
        if until <= self._engaged_until:
            return
        self._engaged_until = until
        for kind in self._hold:
            self._hold_kind(kind, until)
        self._until = max(self._until, until)

    def _hold_kind(self, kind: _Kind, moment: float) -> None:
        """Hold the keys of ``kind`` decided here until the end of the window that contains
        ``moment``."""
        self._hold[kind] = end = self._window_end(kind, moment)
        self._until = max(self._until, end)

    def _window_end(self, kind: _Kind, moment: float) -> float:
        """clock() when admissions made by ``moment`` have left every window of a key of
        ``kind`` that Redis will look at: the end of the fixed window that contains ``moment``
        (windows are aligned on the storage's time), one period after it for the sliding window
        log, the token bucket and GCRA, two for the sliding window counter."""
        algorithm, period = kind
        entry = REGISTRY[algorithm]
        if entry.aligned:
            period_us = period * _US
            at_us = round(moment * _US) + self._wall_offset_us
            end_us = (at_us // period_us + 1) * period_us
            return (end_us - self._wall_offset_us) / _US
        return moment + entry.span * period

    def _holds(self, key: str, until: float, now: float) -> bool:
        """Whether ``key`` (counted here until ``until``) still counts here at ``now``.

        Past ``until`` (its local admissions have left every window), a key decided here is
        held to the end of the window that contains the end of the engagement, but no later
        than the end of the window that contains two settling periods after its last local
        decision: a process whose breaker was open when this one last decided the key admits
        locally at most until then (Redis back at once; its trial one reset timeout later,
        this process engaged one more), and a key this process has not decided since is held
        no longer than one it never decided (docs/failure-modes.md, "The bound")."""
        if until > now:
            return True
        decided = self._decided.get(key)
        if decided is None:
            return False
        kind, at = decided
        return now < self._hold[kind] and now < self._window_end(kind, at + 2 * self.settle)

    def _cover(self, key: str, until: float) -> None:
        """Count ``key`` here until ``until`` at least (longer while this process is engaged).
        A key stays in ``_covered`` as long as every admission of it in this process since it
        entered was counted here; one that was not is removed (and its local count deleted),
        and starts again from what Redis last said when it enters again."""
        if until > self._covered.get(key, -_FOREVER):
            self._covered[key] = until
            self._until = max(self._until, until)

    def _sweep(self, now: float) -> None:
        """Forget keys whose count has ended (amortized: once per doubling of the keys); they
        start again from what Redis last said when they enter again."""
        for key in [k for k, until in self._covered.items() if not self._holds(k, until, now)]:
            del self._covered[key]
            self._decided.pop(key, None)
        self._sweep_at = max(_SWEEP_MIN, 2 * len(self._covered))

    def _after_fork(self) -> None:
        # A forked process admits its own share: it starts again from what Redis last said.
        self._lock = threading.Lock()
        self._storage = None  # the parent's store: dropped without closing it
        self._drop_locked()
