"""What every Python twin shares, as ``lua/common.lua`` is what every Lua algorithm shares.

A twin decides exactly as its script, integer for integer, and gives ``step``, ``refund`` and
``plausible``; shared here: :class:`Step`, :data:`Refunded`, :func:`adjust`.
Design: docs/design-notes.md, "The Python twins".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, NamedTuple

#: Microseconds in a second: periods arrive in seconds, every twin computes in microseconds.
US: Final = 1_000_000

#: A twin's stored state for one key: each twin's own record (a named tuple, a list, a float, a
#: dict). Any object, so that a new algorithm brings its own without changing this module.
State = object

#: What a twin's ``refund`` answers: the state to store (``None``: delete the key) and how long
#: to keep it, us (-1: leave the key's TTL as it is).
Refunded = tuple[State | None, int]

#: ``Step.retry_us`` of a request that can never pass (its cost is above the limit).
NEVER_US: Final = -1

#: ``Step.ttl_us`` of a write into the window a key already holds (fixed window, sliding window
#: counter): the script sets the TTL when a key's window starts and leaves it on later writes
#: into that window, since it ends at the same time.
KEEP_TTL: Final = -1


class Step(NamedTuple):
    """One algorithm's decision for one check, and what to store if the request is admitted."""

    allowed: bool
    remaining: int  # after consuming the cost (when allowed)
    reset_us: int  # likewise
    retry_us: int  # 0 when allowed, NEVER_US when never (cost > limit)
    state: State | None  # the state to store when committed (None: nothing to write)
    ttl_us: int  # how long to keep `state`; KEEP_TTL: the key's TTL stands
    remaining_now: int  # without consuming (what a denied evaluation reports)
    reset_now_us: int


def adjust(guess: int, lowest: int, highest: float, fits: Callable[[int], bool]) -> int:
    """The scripts' correction of a wait computed in doubles, step for step: at most three steps
    down while one less still ``fits`` (never below ``lowest``), then at most three up until it
    ``fits`` (never past ``highest``)."""
    for _ in range(3):
        if guess <= lowest or not fits(guess - 1):
            break
        guess -= 1
    for _ in range(3):
        if guess >= highest or fits(guess):
            break
        guess += 1
    return guess
