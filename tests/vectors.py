"""The shared test vectors: sequences of (time, costs) over a set of limits -> expected decisions.

Written by hand from the math in the header comments of ``flask_distlimit/engine/lua/*.lua``; every
storage (memory, fakeredis, real Redis, Redis Cluster) must answer exactly these integers.

Redis expires keys on its own clock, not the injected one: a vector must never read state whose
TTL (counted from the injected time of its write) is shorter than the real time the test takes.

Times are microseconds after :data:`T0`, a moment aligned with every period used here, so window
boundaries fall on round offsets. An :class:`Expect` is (allowed, remaining, reset_after_us,
retry_after_us) with retry ``-1`` for never. In a call that is denied overall, every limit reports
its state without consumption (its ``allowed`` still says whether it alone would admit).
"""

from __future__ import annotations

from dataclasses import dataclass

from flask_distlimit.core.algorithms import ALGORITHMS, Algorithm
from flask_distlimit.core.decision import NEVER, Check, Decision

#: 20,000 days after the epoch, in us: a multiple of every period in the table.
T0 = 20_000 * 86_400 * 1_000_000
S = 1_000_000  # one second in us


@dataclass(frozen=True)
class Limit:
    algorithm: Algorithm
    limit: int
    period: int  # seconds


@dataclass(frozen=True)
class Expect:
    allowed: bool
    remaining: int
    reset_us: int
    retry_us: int  # -1: never

    def decision(self, limit: int) -> Decision:
        return Decision(
            self.allowed,
            limit,
            self.remaining,
            self.reset_us / S,
            NEVER if self.retry_us < 0 else self.retry_us / S,
        )


@dataclass(frozen=True)
class Call:
    at: int  # us after T0
    costs: tuple[int, ...]  # one per limit
    expect: tuple[Expect, ...]  # one per limit
    refund: bool = False  # give `costs` back (the Redis Cluster refund mode) instead


@dataclass(frozen=True)
class Vector:
    name: str
    limits: tuple[Limit, ...]
    calls: tuple[Call, ...]

    def checks(self, costs: tuple[int, ...], prefix: str) -> list[Check]:
        return [
            Check(f"{prefix}:{i}:{lim.algorithm}", lim.algorithm, lim.limit, lim.period, cost)
            for i, (lim, cost) in enumerate(zip(self.limits, costs, strict=True))
        ]


def E(allowed: bool, remaining: int, reset_us: int, retry_us: int) -> Expect:
    return Expect(allowed, remaining, reset_us, retry_us)


Y, N = True, False


def one(
    algorithm: Algorithm, limit: int, period: int, *calls: tuple[int, int, Expect]
) -> tuple[tuple[Limit, ...], tuple[Call, ...]]:
    return (Limit(algorithm, limit, period),), tuple(Call(at, (c,), (e,)) for at, c, e in calls)


def _fresh(algorithm: Algorithm) -> Vector:
    return Vector(
        f"{algorithm}: peek and impossible cost on a fresh key",
        *one(
            algorithm,
            5,
            10,
            (0, 0, E(Y, 5, 0, 0)),  # a peek on a fresh key: full, nothing to reset
            (0, 6, E(N, 5, 0, -1)),  # cost > limit: never, and nothing is written
            (0, 0, E(Y, 5, 0, 0)),
        ),
    )


VECTORS: list[Vector] = [_fresh(a) for a in ALGORITHMS]

VECTORS += [
    Vector(
        "fixed_window: counts, denies to the end of the window, peeks, starts over",
        *one(
            "fixed_window", 3, 10,
            (0, 1, E(Y, 2, 10 * S, 0)),
            (1 * S, 1, E(Y, 1, 9 * S, 0)),
            (2 * S, 1, E(Y, 0, 8 * S, 0)),
            (3 * S, 1, E(N, 0, 7 * S, 7 * S)),
            (3 * S, 0, E(Y, 0, 7 * S, 0)),
            (10 * S, 1, E(Y, 2, 10 * S, 0)),
            (10 * S, 4, E(N, 2, 10 * S, -1)),
        ),
    ),
    Vector(
        "fixed_window: costs > 1",
        *one(
            "fixed_window", 5, 60,
            (0, 3, E(Y, 2, 60 * S, 0)),
            (1 * S, 3, E(N, 2, 59 * S, 59 * S)),
            (1 * S, 2, E(Y, 0, 59 * S, 0)),
        ),
    ),
    Vector(
        "fixed_window: the boundary, one microsecond apart",
        *one(
            "fixed_window", 2, 10,
            (0, 2, E(Y, 0, 10 * S, 0)),
            (10 * S - 1, 1, E(N, 0, 1, 1)),
            (10 * S, 2, E(Y, 0, 10 * S, 0)),
        ),
    ),
    Vector(
        "fixed_window: the clock goes back a second, the stored window is kept",
        *one(
            "fixed_window", 2, 10,
            (10 * S, 1, E(Y, 1, 10 * S, 0)),
            (9 * S, 1, E(Y, 0, 11 * S, 0)),
            (9 * S, 1, E(N, 0, 11 * S, 11 * S)),
        ),
    ),
    Vector(
        "sliding_window_log: entries expire one by one",
        *one(
            "sliding_window_log", 3, 10,
            (0, 1, E(Y, 2, 10 * S, 0)),
            (1 * S, 1, E(Y, 1, 10 * S, 0)),
            (2 * S, 1, E(Y, 0, 10 * S, 0)),
            (3 * S, 1, E(N, 0, 9 * S, 7 * S)),  # the entry at 0 frees a unit at 10 s
            (10 * S, 1, E(Y, 0, 10 * S, 0)),  # 0 is out (an entry counts while s > now - P)
            (10 * S, 1, E(N, 0, 10 * S, 1 * S)),
            (11 * S, 2, E(N, 1, 9 * S, 1 * S)),  # needs one more unit: the entry at 2 s
            (11 * S, 4, E(N, 1, 9 * S, -1)),
        ),
    ),
    Vector(
        "sliding_window_log: one microsecond, several requests, costs > 1: one entry each",
        *one(
            "sliding_window_log", 5, 10,
            (0, 3, E(Y, 2, 10 * S, 0)),  # one entry at 0 us holding units 1..3
            (0, 2, E(Y, 0, 10 * S + 1, 0)),  # one at 1 us (unique times), units 4..5
            (0, 1, E(N, 0, 10 * S + 1, 10 * S)),  # the entry at 0 frees 3 units at 10 s
            (5 * S, 4, E(N, 0, 5 * S + 1, 5 * S + 1)),  # 4 units: both entries must expire
            (10 * S, 1, E(Y, 2, 10 * S, 0)),  # the entry at 0 expired: 2 units + this one
        ),
    ),
    Vector(
        "sliding_window_log: the clock goes back, entries stay unique and in order",
        *one(
            "sliding_window_log", 2, 10,
            (10 * S, 1, E(Y, 1, 10 * S, 0)),
            (9 * S, 1, E(Y, 0, 11 * S + 1, 0)),  # dated 10 s + 1 us
            (9 * S, 1, E(N, 0, 11 * S + 1, 11 * S)),
        ),
    ),
    Vector(
        "sliding_window_counter: Cloudflare's estimate across windows",
        *one(
            "sliding_window_counter", 10, 10,
            (0, 5, E(Y, 5, 20 * S, 0)),
            (9 * S, 5, E(Y, 0, 11 * S, 0)),
            # window 1, elapsed 0: estimate 10 * 10/10 + 0 = 10: no room; 1 unit fits once
            # 1 s of the previous window has slid out
            (10 * S, 1, E(N, 0, 10 * S, 1 * S)),
            (11 * S, 1, E(Y, 0, 19 * S, 0)),  # estimate 9 + 1 = 10
            (15 * S, 2, E(Y, 2, 15 * S, 0)),  # 5 + 1 + 2 = 8
            # 5 + 3 + 4 = 12: in this window at elapsed 7 s: 3 + 3 + 4 = 10
            (15 * S, 4, E(N, 2, 15 * S, 2 * S)),
            # 3 + 9 > 10: only in window 2, once 3 * (P - e)/P + 9 <= 10: e = 6666667 us
            (15 * S, 9, E(N, 2, 15 * S, 5 * S + 6_666_667)),
            (15 * S, 11, E(N, 2, 15 * S, -1)),
            (30 * S, 1, E(Y, 9, 20 * S, 0)),  # two windows later: fresh
        ),
    ),
    Vector(
        "sliding_window_counter: the clock goes back into an earlier window",
        *one(
            "sliding_window_counter", 4, 10,
            (10 * S, 2, E(Y, 2, 20 * S, 0)),
            (9 * S, 1, E(Y, 1, 21 * S, 0)),  # time clamped to 10 s
        ),
    ),
    Vector(
        "token_bucket: one token a second, fractions, refill to full",
        *one(
            "token_bucket", 4, 4,
            (0, 4, E(Y, 0, 4 * S, 0)),
            (0, 1, E(N, 0, 4 * S, 1 * S)),
            (1_500_000, 1, E(Y, 0, 3_500_000, 0)),  # 1.5 tokens -> 0.5
            (1_500_000, 1, E(N, 0, 3_500_000, 500_000)),
            (2 * S, 1, E(Y, 0, 4 * S, 0)),
            (100 * S, 0, E(Y, 4, 0, 0)),
            (100 * S, 5, E(N, 4, 0, -1)),
        ),
    ),
    Vector(
        "token_bucket: a rate that is not a whole number of microseconds per token",
        *one(
            "token_bucket", 30, 10,
            (0, 30, E(Y, 0, 10 * S, 0)),
            (0, 1, E(N, 0, 10 * S, 333_334)),  # 1/3 s per token
            (333_334, 1, E(Y, 0, 10 * S, 0)),  # 1.000002 tokens -> 0.000002
        ),
    ),
    Vector(
        "token_bucket: the clock goes back, no refill, no loss",
        *one(
            "token_bucket", 2, 2,
            (5 * S, 2, E(Y, 0, 2 * S, 0)),
            (4 * S, 1, E(N, 0, 3 * S, 2 * S)),
        ),
    ),
    Vector(
        "gcra: bursts, partial recovery, costs",
        *one(
            "gcra", 4, 4,
            (0, 1, E(Y, 3, 1 * S, 0)),
            (0, 3, E(Y, 0, 4 * S, 0)),
            (0, 1, E(N, 0, 4 * S, 1 * S)),
            (2_500_000, 2, E(Y, 0, 3_500_000, 0)),  # owed 1.5 + 2 = 3.5 <= 4
            (2_500_000, 1, E(N, 0, 3_500_000, 500_000)),
            (2_500_000, 5, E(N, 0, 3_500_000, -1)),
        ),
    ),
    Vector(
        "gcra: an emission interval that is not whole (1/3 s): exactly 30 in a burst",
        (Limit("gcra", 30, 10),),
        (
            Call(0, (20,), (E(Y, 10, 6_666_667, 0),)),
            # ten more single units: the TAT grows by exactly 1 each time
            *(Call(0, (1,), (E(Y, 10 - i, -(-(20 + i) * 10 * S // 30), 0),)) for i in range(1, 11)),
            Call(0, (1,), (E(N, 0, 10 * S, 333_334),)),
            Call(333_334, (1,), (E(Y, 0, 10 * S, 0),)),
        ),
    ),
    Vector(
        "gcra: the clock goes back",
        *one(
            "gcra", 2, 2,
            (5 * S, 2, E(Y, 0, 2 * S, 0)),
            (4 * S, 1, E(N, 0, 3 * S, 2 * S)),
        ),
    ),
    Vector(
        "two limits: all or nothing, a denied request consumes nothing anywhere",
        (Limit("fixed_window", 2, 10), Limit("token_bucket", 5, 10)),
        (
            Call(0, (1, 1), (E(Y, 1, 10 * S, 0), E(Y, 4, 2 * S, 0))),
            Call(0, (1, 1), (E(Y, 0, 10 * S, 0), E(Y, 3, 4 * S, 0))),
            # the window denies; the bucket alone would admit, reports 3 tokens, keeps them
            Call(0, (1, 1), (E(N, 0, 10 * S, 10 * S), E(Y, 3, 4 * S, 0))),
            Call(0, (0, 3), (E(Y, 0, 10 * S, 0), E(Y, 0, 10 * S, 0))),
            Call(0, (0, 1), (E(Y, 0, 10 * S, 0), E(N, 0, 10 * S, 2 * S))),
        ),
    ),
    Vector(
        "three limits, three algorithms: one denial blocks all",
        (Limit("fixed_window", 10, 60), Limit("sliding_window_log", 1, 10), Limit("gcra", 5, 5)),
        (
            Call(0, (1, 1, 1), (E(Y, 9, 60 * S, 0), E(Y, 0, 10 * S, 0), E(Y, 4, S, 0))),
            Call(
                5 * S,
                (1, 1, 1),
                (E(Y, 9, 55 * S, 0), E(N, 0, 5 * S, 5 * S), E(Y, 5, 0, 0)),
            ),
            Call(10 * S, (1, 1, 1), (E(Y, 8, 50 * S, 0), E(Y, 0, 10 * S, 0), E(Y, 4, S, 0))),
        ),
    ),
    Vector(
        "refund: each algorithm gives units back, then reports a peek",
        (
            Limit("fixed_window", 3, 10),
            Limit("token_bucket", 4, 4),
            Limit("gcra", 4, 4),
            Limit("sliding_window_log", 3, 10),
            Limit("sliding_window_counter", 4, 10),
        ),
        (
            Call(
                0,
                (2, 3, 3, 2, 3),
                (
                    E(Y, 1, 10 * S, 0),
                    E(Y, 1, 3 * S, 0),
                    E(Y, 1, 3 * S, 0),
                    E(Y, 1, 10 * S, 0),  # one entry at 0 holding 2 units
                    E(Y, 1, 20 * S, 0),
                ),
            ),
            Call(
                S,
                (2, 2, 1, 1, 2),
                (
                    E(Y, 3, 0, 0),  # the window is back to 0: key deleted
                    E(Y, 4, 0, 0),  # 1 + 1 refilled + 2 = 4: full
                    E(Y, 3, S, 0),  # owed 3 - 1 (time) - 1 (refund) = 1
                    E(Y, 2, 9 * S, 0),  # the entry keeps 1 of its 2 units
                    E(Y, 3, 19 * S, 0),
                ),
                refund=True,
            ),
            Call(S, (3, 0, 0, 0, 0), (E(Y, 0, 9 * S, 0), *(E(Y, r, t, 0) for r, t in (
                (4, 0), (3, S), (2, 9 * S), (3, 19 * S))))),
            # a refund after the window moved on gives nothing back (counter: stays previous)
            Call(
                10 * S,
                (0, 0, 0, 0, 1),
                (E(Y, 3, 0, 0), E(Y, 4, 0, 0), E(Y, 4, 0, 0), E(Y, 3, 0, 0), E(Y, 3, 10 * S, 0)),
                refund=True,
            ),
        ),
    ),
]  # fmt: skip
