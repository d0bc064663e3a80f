"""One quota lease: the units this process holds of one storage key, and how it spends them.

Thread-safe, oldest units first. Promises: windowed units are spent only in their window, token
bucket and GCRA units only within the time the limit takes to earn them back; a lease is about
100 ms of this process's demand, at most ``limit // 20``, none for a cold key. Design:
docs/design-notes.md, "One lease"; docs/leasing.md.
"""

from __future__ import annotations

import bisect
import operator
import threading
from collections.abc import Callable
from typing import Final, NamedTuple, TypeAlias

from flask_distlimit.core.decision import Check, Decision
from flask_distlimit.declare.lease_options import auto_cap
from flask_distlimit.engine.registry import REGISTRY

#: ``lease=True`` sizes a lease to this much of the process's demand on the key (microseconds).
LEASE_SPAN_US: Final = 100_000
#: Fixed window and counter units a lease has not spent from for this long go back to the
#: shared count (microseconds): ten times the traffic a sized lease is taken for.
GIVE_BACK_AFTER_US: Final = 1_000_000
#: The demand rate is sampled over at least this long (microseconds).
_SAMPLE_US: Final = 50_000
_US: Final = 1_000_000


class Held(NamedTuple):
    """What a lease holds now (:meth:`Lease.holds`)."""

    units: int
    good_for_us: int  #: how long the longest-lived units stay good (0: none held)


class _Chunk:
    __slots__ = ("expires", "units", "window")

    def __init__(self, units: int, expires: int, window: int) -> None:
        self.units = units
        self.expires = expires  # local clock, us; 0: given back to the storage
        #: a fixed window or counter's window index as the storage numbered it (-1: unknown,
        #: or a bucket: never given back)
        self.window = window


_expiry = operator.attrgetter("expires")


#: the chunks a request spent from, and how much of each (:meth:`Lease.give_back` returns them)
Spent: TypeAlias = list[tuple[_Chunk, int]]


class Taken(NamedTuple):
    """What :meth:`Lease.take` did."""

    spent: Spent | None  #: the chunks spent from and how much of each (None: not held)
    top_up: int  #: the units this request asks for (0: none; more: it claimed the renewal)


class Lease:
    """The units this process holds of one storage key, and what it last saw of the key."""

    def __init__(self, check: Check, size: bool | int, now: int) -> None:
        self.key = check.key
        self.algorithm = check.algorithm
        #: unspent units go back to the shared count, a window's count the storage numbers
        #: (:meth:`unspent`; a bucket earns them back)
        self.gives_back = REGISTRY[check.algorithm].give_back_field is not None
        self.limit = check.limit
        self.period_us = check.period * _US
        self.fixed = 0 if size is True else int(size)
        self.cap = auto_cap(check.limit)
        self.lock = threading.Lock()
        self.chunks: list[_Chunk] = []  #: by expiry; none empty
        #: the low-water mark: a quarter of the size last computed (renew at or below it)
        self.low = 0
        self.renewing = False
        self.demand = 0  #: units asked for since ``mark``
        self.mark = now
        self.rate = -1.0  #: EWMA of the demand, units per second (-1: not measured yet)
        self.seen_remaining = 0  #: the shared count's remaining, lease excluded, as last seen
        self.seen_reset_us = 0
        self.seen_at = now
        self.used = now

    # all under self.lock
    def _held(self, now: int) -> int:
        chunks = self.chunks
        if chunks and chunks[0].expires <= now:
            chunks[:] = [c for c in chunks if c.expires > now]
        return sum(c.units for c in chunks)

    def size(self, now: int) -> int:
        """The lease this process should hold now."""
        if self.fixed:
            return self.fixed
        elapsed = now - self.mark
        if elapsed >= _SAMPLE_US:
            sample = self.demand * _US / elapsed
            self.rate = sample if self.rate < 0 else (self.rate + sample) / 2
            self.demand, self.mark = 0, now
        if self.rate < 0:
            return 0
        return min(self.cap, int(self.rate * LEASE_SPAN_US / _US))

    def take(self, cost: int, now: int, renew_allowed: Callable[[], bool]) -> Taken:
        """Spend ``cost`` units if held, and ask for a top-up when due (:class:`Taken`)."""
        with self.lock:
            self.used = now
            self.demand += cost
            held = self._held(now)
            spent: Spent | None = None
            if held >= cost:
                spent = self._spend(cost)
                held -= cost
            renew = 0
            if not self.renewing:
                target = self.size(now)
                self.low = target // 4
                if target and (spent is None or held <= self.low) and renew_allowed():
                    # more than none: what is held here is at most a quarter of the target
                    renew = target - held if spent is not None else target
                    self.renewing = True
            return Taken(spent, renew)

    def spend(self, cost: int, now: int) -> Decision | None:
        """The usual request: ``cost`` spent out of the lease, which needs no renewal (or
        another request renews it): its decision. ``None``, and nothing spent, otherwise."""
        with self.lock:
            held = self._held(now) - cost
            if held < 0 or (held <= self.low and not self.renewing):
                return None  # not enough held, or time to renew
            self._spend(cost)
            self.used = now
            self.demand += cost
            return self._decision(held, now)

    def _spend(self, cost: int) -> Spent:  # under self.lock, with at least ``cost`` held
        spent: Spent = []
        while cost:
            chunk = self.chunks[0]  # the oldest first: they expire first
            n = min(cost, chunk.units)
            chunk.units -= n
            cost -= n
            spent.append((chunk, n))
            if not chunk.units:
                del self.chunks[0]
        return spent

    def give_back(self, spent: Spent, now: int) -> None:
        """A request refused by another limit: the units it took from the lease return."""
        with self.lock:
            for chunk, n in spent:
                if chunk.expires > now:
                    if not chunk.units:  # it was emptied and dropped
                        bisect.insort(self.chunks, chunk, key=_expiry)
                    chunk.units += n

    def granted(self, units: int, d: Decision, started: int, now: int, storage_now: int) -> None:
        """The storage consumed ``units`` more for this lease, 0 or more (``d``: the leased
        check's decision, what the lease last saw of the shared count; ``started``: the local
        time before the call; ``storage_now``: the storage's clock when it decided, us, 0 if
        unknown). The request that claimed the renewal clears ``renewing`` after its call."""
        window = storage_now // self.period_us if storage_now > 0 and self.gives_back else -1
        reset_us = round(d.reset_after * _US)
        # until when the units stay spendable, counted from the call's start
        entry = REGISTRY[self.algorithm]
        if entry.refills:  # token bucket, GCRA: the time the limit takes to earn the units back
            ends = started + units * self.period_us // self.limit
        else:
            # a window's end, no sooner on the server's clock: the reset of a counter, which
            # weighs the previous window too, is the end of the next window
            ends = started + reset_us - (entry.span - 1) * self.period_us
        with self.lock:
            if units > 0 and ends > now:
                last = self.chunks[-1] if self.chunks else None
                if last is not None and abs(last.expires - ends) <= self.period_us // 100:
                    # the same window (its end seen through another round trip): one chunk,
                    # expiring at the sooner of the two ends (given back only if both name
                    # the same window)
                    last.units += units
                    last.expires = min(last.expires, ends)
                    if last.window != window:
                        last.window = -1
                else:
                    bisect.insort(self.chunks, _Chunk(units, ends, window), key=_expiry)
            self.seen_remaining = d.remaining
            self.seen_reset_us = reset_us
            self.seen_at = now

    def unspent(self, now: int) -> list[tuple[int, int]]:
        """Units of a known window this lease has not spent from for
        :data:`GIVE_BACK_AFTER_US`, taken out of the lease (no request can spend them, nor a
        refused one put units back into their chunk): ``(window, units)`` to give back."""
        with self.lock:
            if self.renewing or now - self.used < GIVE_BACK_AFTER_US:
                return []
            out: dict[int, int] = {}
            for chunk in self.chunks:
                if chunk.window >= 0 and chunk.expires > now:
                    out[chunk.window] = out.get(chunk.window, 0) + chunk.units
                    chunk.units, chunk.expires = 0, 0
            self.chunks[:] = [c for c in self.chunks if c.units]  # none is left empty
            return sorted(out.items())

    def holds(self, now: int) -> Held:
        """The units held now, and how long the longest-lived stay good."""
        with self.lock:
            units = self._held(now)
            return Held(units, self.chunks[-1].expires - now if units else 0)

    def clear(self) -> bool:
        """Drop every unit (their count was deleted); true if it held some."""
        with self.lock:
            dropped, self.chunks = self.chunks, []
        return bool(dropped)  # none is empty

    def decision(self, now: int) -> Decision:
        """A leased check decided in-process: the shared count as last seen, plus the units
        still held."""
        with self.lock:
            return self._decision(self._held(now), now)

    def _decision(self, held: int, now: int) -> Decision:  # under self.lock
        reset = max(0, self.seen_reset_us - (now - self.seen_at))
        remaining = min(self.limit, self.seen_remaining + held)
        return Decision(True, self.limit, remaining, reset / _US, 0.0)

    def report(self, now: int) -> dict[str, object]:
        with self.lock:
            held = self._held(now)
            expires = min((c.expires for c in self.chunks), default=now)
            return {
                "held": held,
                "size": self.size(now),
                "limit": self.limit,
                "algorithm": self.algorithm,
                "expires_in": round((expires - now) / _US, 3),
                "renewing": self.renewing,
            }
