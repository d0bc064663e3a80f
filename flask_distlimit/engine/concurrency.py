"""Concurrency's twin (``lua/concurrency.lua``): at most ``limit`` requests in flight, each holding
a slot (the check's ``cost`` is its token) for at most ``period``; the refund releases a slot.
"""

from __future__ import annotations

from typing import Final

from flask_distlimit.engine.common import Refunded, State, Step

#: The most slots one concurrency limit may hold (each is a sorted-set member in Redis).
MAX_CONCURRENCY: Final = 10_000

#: The slots in use, token -> when its lease ends (us).
SlotState = dict[int, int]

_RETRY_HINT: Final = 1_000_000  # us: when a slot frees is unknown; the script's hint
_GARBAGE_US: Final = 2 * 86_400 * 1_000_000  # a lease ending later is garbage (as the script)


def step(state: State | None, limit: int, period: int, cost: int, now: int) -> Step:
    """``cost`` is the slot's token (0: a peek); ``period`` the lease."""
    slots: SlotState = state if isinstance(state, dict) else {}
    for token in [t for t, until in slots.items() if until <= now]:
        del slots[token]  # expired: removed in place, as the script's ZREMRANGEBYSCORE
    k = len(slots)
    own = cost > 0 and cost in slots  # its own live slot (its call made again): renewed
    taking = cost > 0 and not own
    allowed = not taking or k < limit
    taken = k + 1 if taking and allowed else k
    reset_now = max(slots.values()) - now if slots else 0
    reset = period if taken > k or own else reset_now
    retry = 0
    if not allowed:
        retry = min(slots.values()) - now
        if retry > _RETRY_HINT or retry <= 0:
            retry = _RETRY_HINT
    new = {**slots, cost: now + period} if cost > 0 and allowed else None
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


def refund(state: State | None, limit: int, period: int, cost: int, now: int) -> Refunded:
    """The release: the token's slot goes (the key's TTL stands)."""
    if not isinstance(state, dict) or cost not in state:
        return state, -1  # nothing to give back: unchanged
    del state[cost]  # in place, as the script's ZREM; the key's TTL stands
    return (state, -1) if state else (None, 0)


def plausible(state: object, limit: int, period: int, now: int) -> bool:
    """No lease ends more than two days on (the script's ZCOUNT; a lease is a day at most)."""
    return isinstance(state, dict) and all(until <= now + _GARBAGE_US for until in state.values())
