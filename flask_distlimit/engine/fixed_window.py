"""The fixed window's twin (``lua/fixed_window.lua``): ``limit`` units per window of ``period``,
aligned on the storage's clock.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from flask_distlimit.engine.common import KEEP_TTL, NEVER_US, Refunded, State, Step


class FixedWindowState(NamedTuple):
    window: int  # window index: floor(time_us / period_us)
    used: int  # units consumed in that window


def _read(state: State | None, period: int, now: int) -> tuple[int, int, bool]:
    """(window, units used in it, the stored window is the one in use)."""
    window = math.floor(now / period)
    if isinstance(state, FixedWindowState) and state.window >= window:
        return state.window, state.used, True
    return window, 0, False


def step(state: State | None, limit: int, period: int, cost: int, now: int) -> Step:
    window, count, kept = _read(state, period, now)
    window_end = (window + 1) * period
    allowed = cost <= limit and count + cost <= limit
    after = count + cost if allowed else count
    retry = 0 if allowed else NEVER_US if cost > limit else window_end - now
    return Step(
        allowed,
        max(0, limit - after),
        window_end - now if after > 0 else 0,
        retry,
        FixedWindowState(window, after),
        KEEP_TTL if kept else window_end - now,
        max(0, limit - count),
        window_end - now if count > 0 else 0,
    )


def refund(state: State | None, limit: int, period: int, cost: int, now: int) -> Refunded:
    window, count, _ = _read(state, period, now)
    if count <= 0 and cost >= 0:  # a negative cost is a debit: written into the window
        return state, -1
    count = min(count - cost, 2 * limit)  # the most debt a key holds: one limit past a full one
    if count > 0:
        return FixedWindowState(window, count), (window + 1) * period - now
    return None, 0


def plausible(state: object, limit: int, period: int, now: int) -> bool:
    return isinstance(state, FixedWindowState) and state.window * period <= now + period
