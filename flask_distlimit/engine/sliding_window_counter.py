"""The sliding window counter's twin (``lua/sliding_window_counter.lua``): the current window's
units plus the previous window's, weighted by how much of it the window still covers (an
approximation either way).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from flask_distlimit.engine.common import KEEP_TTL, NEVER_US, Refunded, State, Step, adjust


class CounterState(NamedTuple):
    window: int
    used: int  # units in `window`
    previous: int  # units in `window - 1`


def _read(state: State | None, period: int, now: int) -> tuple[int, int, int, int, bool]:
    """(window, clamped time, current, previous, stored window is the current one)."""
    window = math.floor(now / period)
    if isinstance(state, CounterState):
        if state.window > window:
            return state.window, state.window * period, state.used, state.previous, True
        if state.window == window:
            return window, now, state.used, state.previous, True
        if state.window == window - 1:
            return window, now, 0, state.used, False
    return window, now, 0, 0, False


def _fits(limit: int, period: int, prev: int, cur: int, cost: int, elapsed: int) -> bool:
    return float(prev) * (period - elapsed) / period + (cur + cost) <= limit


def _left(limit: int, weighted: float, cur: int) -> int:
    return max(0, math.floor(limit - (weighted + cur)))


def _reset(period: int, prev: int, cur: int, shift: int, elapsed: int) -> int:
    if cur > 0:
        return shift + 2 * period - elapsed
    if prev > 0:
        return shift + period - elapsed
    return 0


def _retry(limit: int, period: int, prev: int, cur: int, cost: int, elapsed: int) -> int:
    """When ``cost`` fits (``cost <= limit``, denied now), from the clamped time."""
    if cur + cost <= limit:  # once enough of the previous window has slid out
        d = max(1, math.ceil((period - elapsed) - float(limit - cur - cost) * period / prev))
        return adjust(
            d, 1, period - elapsed, lambda x: _fits(limit, period, prev, cur, cost, elapsed + x)
        )
    # not before this window has slid out too: into the next one
    e = max(0, math.ceil(period - float(limit - cost) * period / cur))
    e = adjust(e, 0, period, lambda x: _fits(limit, period, cur, 0, cost, x))
    return (period - elapsed) + e


def step(state: State | None, limit: int, period: int, cost: int, now: int) -> Step:
    window, t, cur, prev, current = _read(state, period, now)
    elapsed = t - window * period
    shift = t - now
    weighted = float(prev) * (period - elapsed) / period
    allowed = cost <= limit and weighted + (cur + cost) <= limit
    after = cur + cost if allowed else cur
    if allowed or cost > limit:
        retry = 0 if allowed else NEVER_US
    else:
        retry = shift + _retry(limit, period, prev, cur, cost, elapsed)
    return Step(
        allowed,
        _left(limit, weighted, after),
        _reset(period, prev, after, shift, elapsed),
        retry,
        CounterState(window, after, prev),
        KEEP_TTL if current else (window + 2) * period - now,
        _left(limit, weighted, cur),
        _reset(period, prev, cur, shift, elapsed),
    )


def refund(state: State | None, limit: int, period: int, cost: int, now: int) -> Refunded:
    window, _, cur, prev, current = _read(state, period, now)
    if (not current or cur <= 0) and cost >= 0:  # a negative cost is a debit: written
        return state, -1
    cur = max(0, min(cur - cost, 2 * limit))  # the most debt a key holds, as fixed_window's
    if cur > 0 or prev > 0:
        return CounterState(window, cur, prev), (window + 2) * period - now
    return None, 0


def plausible(state: object, limit: int, period: int, now: int) -> bool:
    return isinstance(state, CounterState) and state.window * period <= now + period
