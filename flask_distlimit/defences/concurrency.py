"""Concurrent-requests limits: at most N requests of one identity in flight, fleet-wide.

A slot (a random token in a sorted set, scored by when its ``DISTLIMIT_CONCURRENCY_LEASE`` ends)
is taken in the request's one storage call, all-or-nothing with its rate limits, and given back
when the request's ledger ends (:mod:`flask_distlimit.defences.lifecycle`) through the guard,
or by its lease if its process died: no background thread (docs/defences.md,
"Concurrent-requests limits"; docs/design-notes.md, "Giving a slot back").
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, Protocol

from flask_distlimit.core.algorithms import CONCURRENCY
from flask_distlimit.core.decision import Check

if TYPE_CHECKING:
    from collections.abc import Callable

    from flask_distlimit.core.pacing import Pace
    from flask_distlimit.declare.route_limits import BoundLimit
    from flask_distlimit.resilience.guard import Guard


#: Tokens are drawn below 2^53: the script keeps them exact as Lua numbers.
_TOKEN_LIMIT: Final = 2**53 - 1


def slot_check(b: BoundLimit, tag: str, lease: int) -> Check:
    """A check taking one slot of the concurrency limit ``b`` for an identity tag, under a
    fresh token, for ``lease`` seconds."""
    token = secrets.randbelow(_TOKEN_LIMIT) + 1
    return Check(b.key(tag), CONCURRENCY, b.rate.amount, lease, 1, token=token, bound=b)


class SideCalls(Protocol):
    """What a storage call beside the request's own (a slot's give-back or renewal, an
    after-response charge) needs of one app's limiter: its guard, the storage's time
    (``None``: the Redis server's clock) and the local clock (microseconds). The app's
    ``LimiterState`` has them, and the pace of its ERROR lines."""

    guard: Guard
    local_clock: Callable[[], int]
    paces: dict[str, Pace]  #: the ERROR lines about each limit's callables (by name)

    def storage_now(self) -> int | None: ...


class SlotRelease:
    """The slots one request took: a holding of its ledger
    (:mod:`flask_distlimit.defences.lifecycle`), given back once when the response ends, renewed
    while a long body is sent. Safe to call for slots that were never taken (a refused request):
    releasing an absent token changes nothing."""

    __slots__ = ("_checks", "_degraded", "_done", "_guard", "_now")

    def __init__(self, calls: SideCalls) -> None:
        self._guard = calls.guard
        self._now: Callable[[], int | None] = calls.storage_now
        self._checks: list[Check] = []
        self._degraded = False
        self._done = False

    def add(self, checks: Sequence[Check]) -> None:
        """Slots a storage call is about to take (held, for the metrics, until given back)."""
        self._checks.extend(dataclasses.replace(c, release=True) for c in checks)
        self._held(checks, 1)

    def discard(self, checks: Sequence[Check]) -> None:
        """Slots the storage refused to take (the request was denied): nothing to give back."""
        tokens = {c.token for c in checks}
        self._checks = [c for c in self._checks if c.token not in tokens]
        self._held(checks, -1)

    def _held(self, checks: Sequence[Check], change: int) -> None:
        metrics = self._guard.metrics
        if metrics is not None:
            metrics.slots_held(checks, change)

    def held_locally(self) -> None:
        """The local fallback decided the request: its slots are held in this process."""
        self._degraded = True

    def renew(self) -> None:
        """Take the slots again under their tokens, in the storage: each live slot's lease
        starts again (a slot whose lease ended is taken again if there is room). Slots the
        local fallback holds (the request was decided during an outage) are not renewed: they
        end at their lease, since a local evaluation would count as a failure and keep the
        process on local limits. Never raises an Exception."""
        if self._done or not self._checks or self._degraded:
            return
        again = [dataclasses.replace(c, release=False) for c in self._checks]
        self._guard.evaluate_beside(again, "a concurrency slot's renewal", now_us=self._now())

    def release(self) -> None:
        if self._done or not self._checks:
            return
        self._done = True
        self._held(self._checks, -1)
        guard = self._guard
        now = self._now()
        for fallback, indexes in guard.fallbacks.split(self._checks).items():
            part = [self._checks[i] for i in indexes]
            if self._degraded or fallback.holding:
                # never fallback.evaluate: a give-back is no outage, and must not engage it
                fallback.release(part, instances=guard.instances.divisor, now_us=now)
        # Only to the nodes whose breaker lets a call through (each slot group's own on a
        # Redis Cluster), which hear how it ended; the lease gives back the slots of the
        # others, and of a node that failed.
        guard.evaluate_beside(self._checks, "a concurrency slot's give-back", now_us=now)
