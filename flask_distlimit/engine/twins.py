"""The five rate-limit algorithms in pure Python: the twins of the Lua scripts.

Each decides exactly as its script does (``flask_distlimit/engine/lua/*.lua``, whose header
comments give the math), integer for integer: the same formulas, with every double operation in the
same order (an ``int * int`` that Lua computes in doubles is computed here as ``float(a) * b``).
The shared test vectors and the property tests hold the two to that.

Each algorithm is a module-level function over a small state value, used by ``memory://``
(:class:`~flask_distlimit.storage.memory.MemoryStorage`) and so by the local fallback:
``step(state, limit, period_us, cost, now_us) -> Step`` decides without changing anything
(except that the log's expired entries are pruned in place, as the script does), and
``refund(state, limit, period_us, cost, now_us) -> (state or None, ttl_us)`` gives units back.
"""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Callable
from typing import Final, NamedTuple

from flask_distlimit.core.algorithms import Algorithm
from flask_distlimit.core.decision import Check

__all__ = [
    "ALGORITHM_STEPS",
    "KEEP_TTL",
    "SWL_BATCH",
    "BucketState",
    "CounterState",
    "FixedWindowState",
    "LogEntry",
    "State",
    "Step",
    "plausible",
    "refund",
    "step",
]

_US: Final = 1_000_000


class FixedWindowState(NamedTuple):
    window: int  # window index: floor(time_us / period_us)
    used: int  # units consumed in that window


class CounterState(NamedTuple):
    window: int
    current: int  # units in `window`
    previous: int  # units in `window - 1`


class BucketState(NamedTuple):
    tokens: float
    stamp: int  # time of `tokens`, us


#: One entry of the log, one per admitted request: (time in us, start, end), its units being
#: start + 1 .. end of the key's running count (see lua/sliding_window_log.lua).
LogEntry = tuple[int, int, int]

#: Concurrency: the slots in use, token -> when its lease ends (us).
SlotState = dict[int, int]

#: The log is a list of entries in time order; GCRA is the TAT in emission intervals.
State = FixedWindowState | CounterState | BucketState | list[LogEntry] | float | SlotState


class Step(NamedTuple):
    """One algorithm's decision for one check, and what to store if the request is admitted."""

    allowed: bool
    remaining: int  # after consuming the cost (when allowed)
    reset_us: int  # likewise
    retry_us: int  # 0 when allowed, -1 when never (cost > limit)
    state: State | None  # the state to store when committed (None: nothing to write)
    ttl_us: int  # how long to keep `state`; KEEP_TTL: the key's TTL stands (see below)
    remaining_now: int  # without consuming (what a denied evaluation reports)
    reset_now_us: int


#: ``Step.ttl_us`` of a write into the window a key already holds (fixed window, sliding window
#: counter): the script sets the TTL when a key's window starts and leaves it on later writes
#: into that window, since it ends at the same time.
KEEP_TTL: Final = -1


# --- fixed window -------------------------------------------------------------------------


def _fw_read(state: State | None, period: int, now: int) -> tuple[int, int, bool]:
    """(window, units used in it, the stored window is the one in use)."""
    window = math.floor(now / period)
    if isinstance(state, FixedWindowState) and state.window >= window:
        return state.window, state.used, True
    return window, 0, False


def fixed_window(state: State | None, limit: int, period: int, cost: int, now: int) -> Step:
    window, count, kept = _fw_read(state, period, now)
    window_end = (window + 1) * period
    allowed = cost <= limit and count + cost <= limit
    after, retry = count, 0
    if allowed:
        after = count + cost
    elif cost > limit:
        retry = -1
    else:
        retry = window_end - now
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


def _fw_refund(
    state: State | None, limit: int, period: int, cost: int, now: int
) -> tuple[State | None, int]:
    window, count, _ = _fw_read(state, period, now)
    if count <= 0:
        return state, -1
    count -= cost
    if count > 0:
        return FixedWindowState(window, count), (window + 1) * period - now
    return None, 0


# --- sliding window log -------------------------------------------------------------------


#: The most members one call removes from one log key, and reads to find a retry time:
#: ``SWL_BATCH`` in ``lua/sliding_window_log.lua`` (the twin prunes exactly as much, so that a
#: clock that goes back finds the same members in both; tests/test_scripts.py checks the two).
SWL_BATCH: Final = 4

_time = operator.itemgetter(0)
_end = operator.itemgetter(2)


def _swl_read(
    state: State | None, limit: int, period: int, now: int
) -> tuple[list[LogEntry], int, int, int]:
    """(the log, units in the window k, base, index of the oldest live entry), after removing
    at most :data:`SWL_BATCH` expired entries in place, as the script does."""
    if not isinstance(state, list) or not state:
        return [], 0, 0, 0
    cut = now - period
    expired = bisect.bisect_right(state, cut, key=_time)
    drop = min(expired, SWL_BATCH)
    if drop:
        del state[:drop]
        expired -= drop
    if not state:
        return state, 0, 0, 0
    newest, _, last = state[-1]
    if newest <= cut:  # nothing live: the script deletes the key
        state.clear()
        return state, 0, 0, 0
    base = state[expired][1]
    if last - base > limit:
        base = last - limit
    return state, last - base, base, expired


def sliding_window_log(state: State | None, limit: int, period: int, cost: int, now: int) -> Step:
    """Prunes ``state`` (a list) in place, as the script does in its first phase."""
    log, count, base, oldest = _swl_read(state, limit, period, now)
    newest = log[-1][0] if count else None
    last = log[-1][2] if count else 0
    first = newest + 1 if newest is not None and newest >= now else now
    allowed = cost <= limit and count + cost <= limit
    after, latest, retry = count, newest, 0
    if allowed:
        if cost > 0:
            after, latest = count + cost, first
    elif cost > limit:
        retry = -1
    else:
        # among the SWL_BATCH oldest live entries; past them, when the last of them expires
        goal = base + count + cost - limit
        block_end = min(len(log), oldest + SWL_BATCH)
        found = bisect.bisect_left(log, goal, oldest, block_end, key=_end)
        retry = log[min(found, block_end - 1)][0] + period - now
    reset = latest + period - now if after > 0 and latest is not None else 0
    reset_now = newest + period - now if newest is not None else 0
    new = [*log, (first, last, last + cost)] if allowed and cost > 0 else None
    return Step(
        allowed,
        limit - after,
        reset,
        retry,
        new,
        first + period - now,
        limit - count,
        reset_now,
    )


def _swl_refund(
    state: State | None, limit: int, period: int, cost: int, now: int
) -> tuple[State | None, int]:
    """Reads the log without pruning it, as the script does (the evaluation after it prunes)."""
    if not isinstance(state, list):
        return None, 0
    live = bisect.bisect_right(state, now - period, key=_time)  # index of the oldest live entry
    if live == len(state):
        return None, 0
    if cost == 0:
        return state, -1
    last = state[-1][2]
    target, lo, base = last - cost, live, last - limit
    if len(state) - live > SWL_BATCH:  # more live entries than one call may touch
        lo = len(state) - SWL_BATCH
        target = max(target, state[lo - 1][2])
    else:
        base = max(base, state[live][1])
    if target <= base:
        return None, 0
    # the lowest entry holding a unit above target; it stays, cut down to target
    r = bisect.bisect_left(state, target + 1, lo, len(state), key=_end)
    time_r, start, _ = state[r]
    del state[r + 1 :]
    if start < target:
        state[r] = (time_r, start, target)
    else:
        del state[r]
    return state, state[-1][0] + period - now


# --- sliding window counter ---------------------------------------------------------------


def _swc_read(state: State | None, period: int, now: int) -> tuple[int, int, int, int, bool]:
    """(window, clamped time, current, previous, stored window is the current one)."""
    window = math.floor(now / period)
    if isinstance(state, CounterState):
        if state.window > window:
            return state.window, state.window * period, state.current, state.previous, True
        if state.window == window:
            return window, now, state.current, state.previous, True
        if state.window == window - 1:
            return window, now, 0, state.current, False
    return window, now, 0, 0, False


def _swc_fits(limit: int, period: int, prev: int, cur: int, cost: int, elapsed: int) -> bool:
    return float(prev) * (period - elapsed) / period + (cur + cost) <= limit


def _swc_left(limit: int, weighted: float, cur: int) -> int:
    return max(0, math.floor(limit - (weighted + cur)))


def _swc_reset(period: int, prev: int, cur: int, shift: int, elapsed: int) -> int:
    if cur > 0:
        return shift + 2 * period - elapsed
    if prev > 0:
        return shift + period - elapsed
    return 0


def sliding_window_counter(
    state: State | None, limit: int, period: int, cost: int, now: int
) -> Step:
    window, t, cur, prev, current = _swc_read(state, period, now)
    elapsed = t - window * period
    shift = t - now
    weighted = float(prev) * (period - elapsed) / period
    allowed = cost <= limit and weighted + (cur + cost) <= limit
    after, retry = cur, 0
    if allowed:
        after = cur + cost
    elif cost > limit:
        retry = -1
    elif cur + cost <= limit:
        d = max(1, math.ceil((period - elapsed) - float(limit - cur - cost) * period / prev))
        for _ in range(3):
            if d > 1 and _swc_fits(limit, period, prev, cur, cost, elapsed + d - 1):
                d -= 1
            else:
                break
        for _ in range(3):
            if d >= period - elapsed or _swc_fits(limit, period, prev, cur, cost, elapsed + d):
                break
            d += 1
        retry = shift + d
    else:
        e = max(0, math.ceil(period - float(limit - cost) * period / cur))
        for _ in range(3):
            if e > 0 and _swc_fits(limit, period, cur, 0, cost, e - 1):
                e -= 1
            else:
                break
        for _ in range(3):
            if e >= period or _swc_fits(limit, period, cur, 0, cost, e):
                break
            e += 1
        retry = shift + (period - elapsed) + e
    return Step(
        allowed,
        _swc_left(limit, weighted, after),
        _swc_reset(period, prev, after, shift, elapsed),
        retry,
        CounterState(window, after, prev),
        KEEP_TTL if current else (window + 2) * period - now,
        _swc_left(limit, weighted, cur),
        _swc_reset(period, prev, cur, shift, elapsed),
    )


def _swc_refund(
    state: State | None, limit: int, period: int, cost: int, now: int
) -> tuple[State | None, int]:
    window, _, cur, prev, current = _swc_read(state, period, now)
    if not current or cur <= 0:
        return state, -1
    cur = max(0, cur - cost)
    if cur > 0 or prev > 0:
        return CounterState(window, cur, prev), (window + 2) * period - now
    return None, 0


# --- token bucket -------------------------------------------------------------------------


def _tb_read(
    state: State | None, limit: int, period: int, now: int
) -> tuple[BucketState | None, int, float]:
    """(stored state, clamped time t0, tokens at t0)."""
    if not isinstance(state, BucketState):
        return None, now, float(limit)
    t0 = max(now, state.stamp)
    tokens = state.tokens + float(t0 - state.stamp) * limit / period
    return state, t0, min(float(limit), tokens)


def _tb_wait(
    limit: int, period: int, base: float, stamp: int, t0: int, tokens: float, want: float
) -> int:
    d = max(1, math.ceil((want - tokens) * period / limit))
    for _ in range(3):
        if d > 1 and base + float(t0 + d - 1 - stamp) * limit / period >= want:
            d -= 1
        else:
            break
    for _ in range(3):
        if base + float(t0 + d - stamp) * limit / period >= want:
            break
        d += 1
    return d


def token_bucket(state: State | None, limit: int, period: int, cost: int, now: int) -> Step:
    stored, t0, tokens = _tb_read(state, limit, period, now)
    shift = t0 - now
    allowed = cost <= limit and cost <= tokens
    after, retry, reset_now = tokens, 0, 0
    if tokens < limit and stored is not None:
        reset_now = shift + _tb_wait(limit, period, stored.tokens, stored.stamp, t0, tokens, limit)
    if allowed:
        after = tokens - cost
    elif cost > limit:
        retry = -1
    else:
        assert stored is not None  # a missing key is a full bucket, which admits cost <= limit
        retry = shift + _tb_wait(limit, period, stored.tokens, stored.stamp, t0, tokens, cost)
    reset = reset_now
    if allowed and cost > 0:
        reset = shift + _tb_wait(limit, period, after, t0, t0, after, limit)
    return Step(
        allowed,
        math.floor(after),
        reset,
        retry,
        BucketState(after, t0),
        reset,
        math.floor(tokens),
        reset_now,
    )


def _tb_refund(
    state: State | None, limit: int, period: int, cost: int, now: int
) -> tuple[State | None, int]:
    stored, t0, tokens = _tb_read(state, limit, period, now)
    if stored is None:
        return None, 0
    tokens += cost
    if tokens < limit:
        return BucketState(tokens, t0), t0 - now + _tb_wait(
            limit, period, tokens, t0, t0, tokens, limit
        )
    return None, 0


# --- GCRA ---------------------------------------------------------------------------------


def _gcra_read(
    state: State | None, limit: int, period: int, now: int
) -> tuple[float, float, float]:
    """(emission interval T in us, now in units of T, TAT in units of T)."""
    interval = period / limit
    now_u = now / interval
    tat = state if isinstance(state, float) else now_u
    return interval, now_u, max(tat, now_u)


def _gcra_until(interval: float, now: int, now_u: float, tat: float) -> int:
    if tat <= now_u:
        return 0
    r = max(1, math.ceil((tat - now_u) * interval))
    for _ in range(3):
        if r > 1 and (now + r - 1) / interval >= tat:
            r -= 1
        else:
            break
    for _ in range(3):
        if (now + r) / interval >= tat:
            break
        r += 1
    return r


def _gcra_left(limit: int, now_u: float, tat: float) -> int:
    return max(0, math.floor(limit - (tat - now_u)))


def gcra(state: State | None, limit: int, period: int, cost: int, now: int) -> Step:
    interval, now_u, tat = _gcra_read(state, limit, period, now)
    used = tat - now_u
    allowed = cost <= limit and used + cost <= limit
    after, retry = tat, 0
    if allowed:
        after = tat + cost
    elif cost > limit:
        retry = -1
    else:
        d = max(1, math.ceil((used + cost - limit) * interval))
        for _ in range(3):
            if d > 1 and (tat - (now + d - 1) / interval) + cost <= limit:
                d -= 1
            else:
                break
        for _ in range(3):
            if (tat - (now + d) / interval) + cost <= limit:
                break
            d += 1
        retry = d
    reset = _gcra_until(interval, now, now_u, after)
    return Step(
        allowed,
        _gcra_left(limit, now_u, after),
        reset,
        retry,
        after,
        reset,
        _gcra_left(limit, now_u, tat),
        _gcra_until(interval, now, now_u, tat),
    )


def _gcra_refund(
    state: State | None, limit: int, period: int, cost: int, now: int
) -> tuple[State | None, int]:
    if not isinstance(state, float):
        return None, 0
    interval, now_u, tat = _gcra_read(state, limit, period, now)
    tat -= cost
    if tat > now_u:
        return tat, _gcra_until(interval, now, now_u, tat)
    return None, 0


def plausible(algorithm: str, state: object, limit: int, period: int, now: int) -> bool:
    """Whether stored state can be used at ``now``: the script's garbage bounds, so that state
    from more than a period in the future (a clock jump back) is reset here exactly as in Redis."""
    if algorithm == "fixed_window" and isinstance(state, FixedWindowState):
        return state.window * period <= now + period
    if algorithm == "sliding_window_counter" and isinstance(state, CounterState):
        return state.window * period <= now + period
    if algorithm == "sliding_window_log" and isinstance(state, list):
        return not state or state[-1][0] <= now + period + limit
    if algorithm == "token_bucket" and isinstance(state, BucketState):
        return state.stamp <= now + period
    if algorithm == "gcra" and isinstance(state, float):
        return state - now / (period / limit) <= 2 * limit
    return algorithm == "concurrency" and isinstance(state, dict)


# --- concurrency (requests in flight; lua/concurrency.lua) -----------------------------------

_RETRY_HINT: Final = 1_000_000  # us: when a slot frees is unknown; the script's hint


def _cc_live(state: State | None, now: int) -> SlotState:
    """The live slots, the expired ones removed in place (as the script's ZREMRANGEBYSCORE)."""
    if not isinstance(state, dict):
        return {}
    for token in [t for t, until in state.items() if until <= now]:
        del state[token]
    return state


def concurrency(state: State | None, limit: int, period: int, cost: int, now: int) -> Step:
    """``cost`` is the slot's token (0: a peek); ``period`` the lease."""
    slots = _cc_live(state, now)
    k = len(slots)
    allowed, taken = True, k
    own = cost > 0 and cost in slots  # its own live slot (its call made again): renewed
    if cost > 0 and not own:
        if k + 1 <= limit:
            taken = k + 1
        else:
            allowed = False
    reset_now = max(slots.values()) - now if slots else 0
    reset = period if taken > k or own else reset_now
    retry = 0
    if not allowed:
        retry = min(slots.values()) - now
        if retry > _RETRY_HINT or retry <= 0:
            retry = _RETRY_HINT
    new: SlotState | None = None
    if cost > 0 and allowed:
        new = {**slots, cost: now + period}
    return Step(
        allowed,
        max(0, limit - taken),
        reset,
        retry,
        new,
        period,
        max(0, limit - k),
        reset_now,
    )


def _cc_refund(
    state: State | None, limit: int, period: int, cost: int, now: int
) -> tuple[State | None, int]:
    """The release: the token's slot goes (the key's TTL stands)."""
    if not isinstance(state, dict) or cost not in state:
        return state, -1  # nothing to give back: unchanged
    del state[cost]  # in place, as the script's ZREM; the key's TTL stands
    return (state, -1) if state else (None, 0)


StepFunction = Callable[[State | None, int, int, int, int], Step]
RefundFunction = Callable[[State | None, int, int, int, int], tuple[State | None, int]]

#: Each algorithm's decision function: ``(state, limit, period_us, cost, now_us) -> Step``.
ALGORITHM_STEPS: Final[dict[Algorithm, StepFunction]] = {
    "fixed_window": fixed_window,
    "sliding_window_log": sliding_window_log,
    "sliding_window_counter": sliding_window_counter,
    "token_bucket": token_bucket,
    "gcra": gcra,
    "concurrency": concurrency,
}

_REFUNDS: Final[dict[Algorithm, RefundFunction]] = {
    "fixed_window": _fw_refund,
    "sliding_window_log": _swl_refund,
    "sliding_window_counter": _swc_refund,
    "token_bucket": _tb_refund,
    "gcra": _gcra_refund,
    "concurrency": _cc_refund,
}


def step(algorithm: Algorithm, state: State | None, check: Check, cost: int, now_us: int) -> Step:
    """Decide ``check`` (with ``cost``) over ``state`` at ``now_us``."""
    if check.token:  # a concurrency slot: the token stands for the cost of 1
        cost = check.token if cost else 0
    return ALGORITHM_STEPS[algorithm](state, check.limit, check.period * _US, cost, now_us)


def refund(
    algorithm: Algorithm, state: State | None, check: Check, now_us: int
) -> tuple[State | None, int]:
    """Give ``check.cost`` back: ``(new state or None to delete, ttl_us)``; ttl -1 = unchanged."""
    cost = check.token or check.cost  # a concurrency slot is given back by its token
    return _REFUNDS[algorithm](state, check.limit, check.period * _US, cost, now_us)
