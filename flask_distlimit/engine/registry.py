"""One entry per algorithm: everything the layers above need to know of it, in one place.

:data:`REGISTRY` maps each name to an :class:`AlgorithmEntry`: its wire code, its Python twin, its
bounds, and the facts the memory store, the fallback, the leases and the give-backs ask instead of
switching on names. Adding an algorithm is its Lua, its twin, its entry here and its tests.
:func:`check_rate` refuses, when a limit is declared, a rate an algorithm cannot enforce exactly.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, Protocol

from flask_distlimit.core.algorithms import Algorithm
from flask_distlimit.core.limits import Rate
from flask_distlimit.engine import (
    concurrency,
    fixed_window,
    gcra,
    sliding_window_counter,
    sliding_window_log,
    token_bucket,
)
from flask_distlimit.engine.common import Refunded, State, Step
from flask_distlimit.engine.fixed_window import FixedWindowState
from flask_distlimit.engine.sliding_window_counter import CounterState
from flask_distlimit.errors import ConfigurationError


class Twin(Protocol):
    """What every twin module gives (:mod:`flask_distlimit.engine.common` says what each does)."""

    def step(self, state: State | None, limit: int, period: int, cost: int, now: int) -> Step: ...

    def refund(
        self, state: State | None, limit: int, period: int, cost: int, now: int
    ) -> Refunded: ...

    def plausible(self, state: object, limit: int, period: int, now: int) -> bool: ...


@dataclass(frozen=True)
class AlgorithmEntry:
    """What one algorithm is, for every layer that handles it."""

    name: Algorithm
    code: int  #: the number it is sent as (``ARGV``): its place in ``lua/evaluate.lua``
    twin: Twin  #: its Python twin's module
    #: Never admits more than ``limit`` units in its window or burst (the sliding window
    #: counter is an approximation and may err either way).
    exact: bool
    #: A quota lease is defined for it (not the log: it stores when each unit is used, and a
    #: leased unit's time of use is unknown when it is taken).
    leasable: bool
    #: The periods an admission stays in the windows it reads (the counter weighs the previous
    #: window too: 2).
    span: int = 1
    #: Its windows are aligned on the storage's clock (the fixed window): an admission leaves
    #: them at the end of the window it was made in, sooner than ``span`` periods.
    aligned: bool = False
    #: Units come back at a steady rate, ``limit`` per period (token bucket, GCRA), not when a
    #: window ends: a leased unit is earned back ``period / limit`` after it was taken.
    refills: bool = False
    #: The field of the key's hash holding the window's count, which a give-back of leased units
    #: takes units off (:mod:`flask_distlimit.storage.give_back`); None: never given back.
    give_back_field: str | None = None
    #: Its twin's state, whose ``used`` count of its ``window`` the memory store's give-back
    #: takes units off, as the script does the field's; None: never given back.
    counted: type[FixedWindowState | CounterState] | None = None
    #: Whether its (plausible) state holds nothing: the key is deleted, as the script does.
    empty: Callable[[object], bool] = lambda state: False
    #: Why ``(limit, period_us, now_us)`` cannot be decided exactly ("": it can).
    refusal: Callable[[int, int, int], str] = lambda limit, period_us, now_us: ""
    max_limit: int | None = None  #: the largest limit it accepts (None: any)
    max_rate: int | None = None  #: the fastest rate it accepts, units per second (None: any)
    #: The message of a rate over its bound: a format string with ``{bound}`` and ``{rate}``.
    too_large: str = ""


_LOG_TOO_LARGE: Final = (
    "The sliding_window_log algorithm keeps one entry per request, so it accepts limits up to "
    "{bound} per window, got {rate}: a larger log costs too much memory and stalls Redis when it "
    "expires. Use sliding_window_counter (two numbers per client, near-exact) or gcra (one "
    "number, exact for a burst of the limit) for large limits."
)
_GCRA_TOO_LARGE: Final = (
    "The gcra algorithm accepts rates up to {bound} per second, got {rate}. Use token_bucket or "
    "fixed_window for faster rates."
)
_SLOTS_TOO_LARGE: Final = (
    "A concurrency limit accepts up to {bound} requests in flight at once, got {rate}: each is "
    "a member of a sorted set in Redis. Use a lower limit."
)

#: Every algorithm's entry, by name.
REGISTRY: Final[Mapping[Algorithm, AlgorithmEntry]] = {
    e.name: e
    for e in (
        AlgorithmEntry(
            "fixed_window", 1, fixed_window, exact=True, leasable=True, aligned=True,
            give_back_field="n", counted=FixedWindowState,
        ),
        AlgorithmEntry(
            "sliding_window_log", 2, sliding_window_log, exact=True, leasable=False,
            empty=operator.not_, max_limit=sliding_window_log.MAX_LOG_LIMIT,
            too_large=_LOG_TOO_LARGE,
        ),
        AlgorithmEntry(
            "sliding_window_counter", 3, sliding_window_counter, exact=False, leasable=True,
            span=2, give_back_field="c", counted=CounterState,
        ),
        AlgorithmEntry("token_bucket", 4, token_bucket, exact=True, leasable=True, refills=True),
        AlgorithmEntry(
            "gcra", 5, gcra, exact=True, leasable=True, refills=True, refusal=gcra.refusal,
            max_rate=gcra.MAX_GCRA_RATE, too_large=_GCRA_TOO_LARGE,
        ),
        AlgorithmEntry(
            "concurrency", 6, concurrency, exact=True, leasable=False,
            max_limit=concurrency.MAX_CONCURRENCY, too_large=_SLOTS_TOO_LARGE,
        ),
    )
}  # fmt: skip


def check_rate(algorithm: Algorithm, rate: Rate) -> None:
    """Raise :class:`ConfigurationError` when ``algorithm`` cannot enforce ``rate`` exactly, or
    not with bounded work per request (its entry's ``max_limit`` and ``max_rate``).

    Redis runs a script alone: while one call runs, every other client waits. Each limit a call
    evaluates does a bounded amount of work whatever its cost (the counters a few commands on one
    small hash; the log a few commands and entries, lua/sliding_window_log.lua), so the
    bounds keep every call a request can make under 1 ms on a 2-core machine
    (bench/bench_script_time.py, docs/bench/script-time.md)."""
    entry = REGISTRY[algorithm]
    if entry.max_limit is not None and rate.amount > entry.max_limit:
        raise ConfigurationError(entry.too_large.format(bound=entry.max_limit, rate=rate))
    if entry.max_rate is not None and rate.amount > entry.max_rate * rate.period:
        raise ConfigurationError(entry.too_large.format(bound=entry.max_rate, rate=rate))
