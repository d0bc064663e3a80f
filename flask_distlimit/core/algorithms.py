"""The five rate-limit algorithms, by name.

Each has a Lua implementation (``lua/<name>.lua``, run atomically in Redis) and a pure-Python twin
(``flask_distlimit.engine.twins``) that decides exactly as the Lua does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, Literal

from flask_distlimit.errors import ConfigurationError

if TYPE_CHECKING:
    from flask_distlimit.core.limits import Rate

__all__ = [
    "ALGORITHMS",
    "CONCURRENCY",
    "EXACT_ALGORITHMS",
    "MAX_CONCURRENCY",
    "MAX_GCRA_RATE",
    "MAX_LIMITS_PER_REQUEST",
    "MAX_LOG_LIMIT",
    "Algorithm",
    "check_cost",
    "check_limit_count",
    "check_rate",
    "max_cost",
    "validate_algorithm",
]

Algorithm = Literal[
    "fixed_window",
    "sliding_window_log",
    "sliding_window_counter",
    "token_bucket",
    "gcra",
    "concurrency",
]

#: Not a rate: requests in flight (:mod:`flask_distlimit.defences.concurrency`). Never a default
#: algorithm, so not in :data:`ALGORITHMS`.
CONCURRENCY: Final = "concurrency"
#: The most slots one concurrency limit may hold (each is a sorted-set member in Redis).
MAX_CONCURRENCY: Final = 10_000

ALGORITHMS: Final[tuple[Algorithm, ...]] = (
    "fixed_window",
    "sliding_window_log",
    "sliding_window_counter",
    "token_bucket",
    "gcra",
)

#: Algorithms that never admit more than ``limit`` units in their window/burst (the sliding
#: window counter is an approximation and may err either way).
EXACT_ALGORITHMS: Final[frozenset[Algorithm]] = frozenset(
    {"fixed_window", "sliding_window_log", "token_bucket", "gcra"}
)


def validate_algorithm(name: object) -> Algorithm:
    """Return ``name`` as an :data:`Algorithm`, or raise :class:`ConfigurationError`."""
    if isinstance(name, str) and name in ALGORITHMS:
        return name
    raise ConfigurationError(
        f"Unknown rate-limit algorithm {name!r}. Use one of: {', '.join(ALGORITHMS)}."
    )


# -- bounded work per call --------------------------------------------------------------------
# Redis runs a script alone: while one call runs, every other client waits. Each limit a call
# evaluates does a bounded amount of work whatever its cost (the counters a few commands on one
# small hash; the log at most 6 commands and a few members, lua/sliding_window_log.lua), so the
# bounds below keep every call a request can make under 1 ms on a 2-core machine
# (bench/bench_script_time.py, docs/bench/script-time.md).

#: The sliding window log keeps one sorted-set member per admitted request: up to this many per
#: client and limit. A call touches a few of them whatever the limit, but memory grows with it
#: (about 100 bytes a member) and Redis frees a key's members in one go when its TTL ends.
MAX_LOG_LIMIT: Final = 1_000
#: GCRA keeps its state in emission intervals of ``period / limit`` microseconds; faster than one
#: unit per microsecond, the interval cannot be computed exactly.
MAX_GCRA_RATE: Final = 1_000_000  # units per second
#: The most limits one request may carry (global, tier and route limits together): the storage
#: evaluates all of a request's limits in one script call, so its time grows with their number.
MAX_LIMITS_PER_REQUEST: Final = 8


def check_rate(algorithm: Algorithm, rate: Rate) -> None:
    """Raise :class:`ConfigurationError` when ``algorithm`` cannot enforce ``rate`` exactly, or
    not with bounded work per request."""
    if algorithm == "sliding_window_log" and rate.amount > MAX_LOG_LIMIT:
        raise ConfigurationError(
            f"The sliding_window_log algorithm keeps one entry per request, so it accepts limits "
            f"up to {MAX_LOG_LIMIT} per window, got {rate}: a larger log costs too much memory "
            "and stalls Redis when it expires. Use sliding_window_counter (two numbers per "
            "client, near-exact) or gcra (one number, exact for a burst of the limit) for large "
            "limits."
        )
    if algorithm == "gcra" and rate.amount > MAX_GCRA_RATE * rate.period:
        raise ConfigurationError(
            f"The gcra algorithm accepts rates up to {MAX_GCRA_RATE} per second, got {rate}. "
            "Use token_bucket or fixed_window for faster rates."
        )


def max_cost(rate: Rate) -> int:
    """The largest cost a request may be charged against ``rate``, by any algorithm: its amount.

    A larger cost could never pass. Up to it, no algorithm does more work per call for a larger
    cost (the log writes one member per request, whatever its cost).
    """
    return rate.amount


def check_cost(cost: int, rates: Sequence[Rate], where: str) -> None:
    """Raise :class:`ConfigurationError` when a fixed ``cost`` exceeds :func:`max_cost` of one of
    ``rates`` (``where`` names the declaration in the message)."""
    for rate in rates:
        if cost > max_cost(rate):
            raise ConfigurationError(
                f"cost={cost} on {where} is larger than the limit {rate}: such a request could "
                f"never pass. Use a cost of at most {max_cost(rate)}, or a larger limit."
            )


def check_limit_count(count: int, where: str) -> None:
    """Raise :class:`ConfigurationError` when ``count`` limits would apply to one request
    (``where`` says which limits, for the message)."""
    if count > MAX_LIMITS_PER_REQUEST:
        raise ConfigurationError(
            f"{where} make {count} limits for one request; a request may carry at most "
            f"{MAX_LIMITS_PER_REQUEST}, since all of them are evaluated in one Redis script call "
            "that every other client waits for. Join rates that say the same thing, or move a "
            "limit to a route of its own."
        )
