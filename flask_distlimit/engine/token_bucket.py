"""The token bucket's twin (``lua/token_bucket.lua``): ``limit`` tokens, refilled at ``limit`` per
``period``; a request takes ``cost`` tokens.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from flask_distlimit.engine.common import NEVER_US, Refunded, State, Step, adjust


class BucketState(NamedTuple):
    tokens: float
    stamp: int  # time of `tokens`, us


def _read(
    state: State | None, limit: int, period: int, now: int
) -> tuple[BucketState | None, int, float]:
    """(stored state, clamped time t0, tokens at t0)."""
    if not isinstance(state, BucketState):
        return None, now, float(limit)
    t0 = max(now, state.stamp)
    tokens = state.tokens + float(t0 - state.stamp) * limit / period
    return state, t0, min(float(limit), tokens)


def _wait(
    limit: int, period: int, base: float, stamp: int, t0: int, tokens: float, want: float
) -> int:
    d = max(1, math.ceil((want - tokens) * period / limit))
    return adjust(d, 1, math.inf, lambda x: base + float(t0 + x - stamp) * limit / period >= want)


def step(state: State | None, limit: int, period: int, cost: int, now: int) -> Step:
    stored, t0, tokens = _read(state, limit, period, now)
    shift = t0 - now
    allowed = cost <= limit and cost <= tokens
    after, retry, reset_now = tokens, 0, 0
    if tokens < limit and stored is not None:
        reset_now = shift + _wait(limit, period, stored.tokens, stored.stamp, t0, tokens, limit)
    if allowed:
        after = tokens - cost
    elif cost > limit:
        retry = NEVER_US
    else:
        assert stored is not None  # a missing key is a full bucket, which admits cost <= limit
        retry = shift + _wait(limit, period, stored.tokens, stored.stamp, t0, tokens, cost)
    reset = reset_now
    if allowed and cost > 0:
        reset = shift + _wait(limit, period, after, t0, t0, after, limit)
    left, left_now = math.floor(after), math.floor(tokens)
    if left_now < 0:  # a debit's debt: nothing left
        left = left_now = 0
    return Step(allowed, left, reset, retry, BucketState(after, t0), reset, left_now, reset_now)


def refund(state: State | None, limit: int, period: int, cost: int, now: int) -> Refunded:
    stored, t0, tokens = _read(state, limit, period, now)
    if stored is None and cost >= 0:  # a negative cost is a debit: from a full bucket
        return None, 0
    tokens = max(tokens + cost, float(-limit))  # a debit's debt: at most the limit
    if tokens < limit:
        return BucketState(tokens, t0), t0 - now + _wait(
            limit, period, tokens, t0, t0, tokens, limit
        )
    return None, 0


def plausible(state: object, limit: int, period: int, now: int) -> bool:
    return isinstance(state, BucketState) and state.stamp <= now + period
