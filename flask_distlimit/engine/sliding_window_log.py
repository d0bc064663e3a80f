"""The sliding window log's twin (``lua/sliding_window_log.lua``): at most ``limit`` units in any
``period``, one entry per admitted request; :func:`step` prunes the log in place, as the script
does (an empty log: the key is deleted).
"""

from __future__ import annotations

import bisect
import operator
from typing import Final

from flask_distlimit.engine.common import KEEP_TTL, NEVER_US, Refunded, State, Step

#: The log keeps one list entry per admitted request: up to this many per client and limit. A
#: call touches a few of them whatever the limit, but memory grows with it (about 26 bytes an
#: entry) and Redis frees a key's entries in one go when its TTL ends.
MAX_LOG_LIMIT: Final = 1_000

#: The most entries a retry time is looked for among, and a give-back removes whole:
#: ``SWL_BATCH`` in ``lua/sliding_window_log.lua`` (tests/engine/test_scripts.py checks the
#: two).
SWL_BATCH: Final = 4

#: One entry of the log, one per admitted request: (time in us, start, end), its units being
#: start + 1 .. end of the key's running count (see lua/sliding_window_log.lua).
LogEntry = tuple[int, int, int]

_time = operator.itemgetter(0)
_end = operator.itemgetter(2)


def _until(t: int, period: int) -> int:
    """When a log whose newest entry is dated ``t`` may go: ``swl_until`` in the script."""
    step = min(-(-period // 8), 1_000_000)
    return ((t + period) // step + 1) * step


def _read(
    state: State | None, limit: int, period: int, now: int
) -> tuple[list[LogEntry], int, int]:
    """(the log, units in the window k, base), after removing every expired entry in place, as
    the script does."""
    if not isinstance(state, list) or not state:
        return [], 0, 0
    newest, _, last = state[-1]
    if newest <= now - period:  # nothing live: the script deletes the key
        state.clear()
        return state, 0, 0
    del state[: bisect.bisect_right(state, now - period, key=_time)]
    base = state[0][1]
    return state, min(last - base, limit), base


def step(state: State | None, limit: int, period: int, cost: int, now: int) -> Step:
    log, count, _ = _read(state, limit, period, now)
    newest = log[-1][0] if count else None
    last = log[-1][2] if count else 0
    first = newest + 1 if newest is not None and newest >= now else now
    allowed = cost <= limit and count + cost <= limit
    after, latest, retry = count, newest, 0
    if allowed:
        if cost > 0:
            after, latest = count + cost, first
    elif cost > limit:
        retry = NEVER_US
    else:
        # among the SWL_BATCH oldest live entries; past them, when the last of them expires
        goal = last + cost - limit
        block_end = min(len(log), SWL_BATCH)
        found = bisect.bisect_left(log, goal, 0, block_end, key=_end)
        retry = log[min(found, block_end - 1)][0] + period - now
    reset = latest + period - now if after > 0 and latest is not None else 0
    reset_now = newest + period - now if newest is not None else 0
    new = [*log, (first, last, last + cost)] if allowed and cost > 0 else None
    until = _until(first, period)
    return Step(
        allowed,
        limit - after,
        reset,
        retry,
        new,
        KEEP_TTL if newest is not None and until == _until(newest, period) else until - now,
        limit - count,
        reset_now,
    )


def refund(state: State | None, limit: int, period: int, cost: int, now: int) -> Refunded:
    """Gives back the oldest units counted (see the script), once every expired entry is
    removed, as the script does. A negative ``cost`` is a debit: one more entry of ``-cost``
    units, as an admission writes."""
    log, count, base = _read(state, limit, period, now)  # the expired entries go
    if cost < 0:
        newest = log[-1][0] if log else None
        last = log[-1][2] if log else 0
        first = newest + 1 if newest is not None and newest >= now else now
        log.append((first, last, last - cost))
        return log, _until(first, period) - now
    if not count:
        return None, 0
    if cost == 0:
        return log, KEEP_TTL
    # the oldest units counted go: whole entries (at most SWL_BATCH), then a cut
    target = base + cost
    if target >= log[-1][2]:  # every unit counted goes back
        return None, 0
    r = min(bisect.bisect_right(log, target, key=_end), SWL_BATCH)
    time_r, start, end = log[r]
    if start < target < end:
        log[r] = (time_r, target, end)
    del log[:r]
    return log, KEEP_TTL  # in place; the newest entry stays, and so does the TTL


def plausible(state: object, limit: int, period: int, now: int) -> bool:
    return isinstance(state, list) and (not state or state[-1][0] <= now + period + limit)
