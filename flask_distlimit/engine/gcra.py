"""GCRA's twin (``lua/gcra.lua``): the theoretical arrival time, in emission intervals of
``period / limit``, at most ``limit`` intervals ahead of now; :func:`refusal` names the times and
rates whose intervals cannot be computed exactly.
"""

from __future__ import annotations

import math
from typing import Final

from flask_distlimit.engine.common import NEVER_US, Refunded, State, Step, adjust

#: GCRA keeps its state in emission intervals of ``period / limit`` microseconds; faster than one
#: unit per microsecond, the interval cannot be computed exactly.
MAX_GCRA_RATE: Final = 1_000_000  # units per second

#: now / T must stay below 2^52 (see lua/gcra.lua).
_MAX_UNITS: Final = 2**52


def _read(state: State | None, limit: int, period: int, now: int) -> tuple[float, float, float]:
    """(emission interval T in us, now in units of T, TAT in units of T)."""
    interval = period / limit
    now_u = now / interval
    tat = state if isinstance(state, float) else now_u
    return interval, now_u, max(tat, now_u)


def _until(interval: float, now: int, now_u: float, tat: float) -> int:
    if tat <= now_u:
        return 0
    r = max(1, math.ceil((tat - now_u) * interval))
    return adjust(r, 1, math.inf, lambda x: (now + x) / interval >= tat)


def _left(limit: int, now_u: float, tat: float) -> int:
    return max(0, math.floor(limit - (tat - now_u)))


def step(state: State | None, limit: int, period: int, cost: int, now: int) -> Step:
    interval, now_u, tat = _read(state, limit, period, now)
    used = tat - now_u
    allowed = cost <= limit and used + cost <= limit
    after = tat + cost if allowed else tat
    retry = 0 if allowed else NEVER_US
    if not allowed and cost <= limit:  # the first whole us at which cost fits
        d = max(1, math.ceil((used + cost - limit) * interval))
        retry = adjust(d, 1, math.inf, lambda x: (tat - (now + x) / interval) + cost <= limit)
    reset = _until(interval, now, now_u, after)
    return Step(
        allowed,
        _left(limit, now_u, after),
        reset,
        retry,
        after,
        reset,
        _left(limit, now_u, tat),
        _until(interval, now, now_u, tat),
    )


def refund(state: State | None, limit: int, period: int, cost: int, now: int) -> Refunded:
    if not isinstance(state, float) and cost >= 0:  # a negative cost is a debit
        return None, 0
    interval, now_u, tat = _read(state, limit, period, now)
    tat = min(tat - cost, now_u + (2 * limit - 1))
    if tat > now_u:
        return tat, _until(interval, now, now_u, tat)
    return None, 0


def plausible(state: object, limit: int, period: int, now: int) -> bool:
    return isinstance(state, float) and state - now / (period / limit) <= 2 * limit


def refusal(limit: int, period: int, now: int) -> str:
    """Why ``limit`` per ``period`` us cannot be decided exactly at ``now`` us ("": it can)."""
    if now / (period / limit) >= _MAX_UNITS:
        return "a GCRA rate above 2,000,000 per second cannot be computed exactly; use token_bucket"
    return ""
