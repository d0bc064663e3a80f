"""The rate-limit algorithms by name, and the bounds of a request whatever its algorithms.

Each algorithm's Lua, Python twin and facts are its entry in :mod:`flask_distlimit.engine.registry`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, Literal, get_args

from flask_distlimit.errors import ConfigurationError

if TYPE_CHECKING:
    from flask_distlimit.core.limits import Rate

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

#: The rate algorithms, in the order of :data:`Algorithm`.
ALGORITHMS: Final[tuple[Algorithm, ...]] = tuple(a for a in get_args(Algorithm) if a != CONCURRENCY)


def validate_algorithm(name: object) -> Algorithm:
    """Return ``name`` as an :data:`Algorithm`, or raise :class:`ConfigurationError`."""
    if isinstance(name, str) and name in ALGORITHMS:
        return name
    raise ConfigurationError(
        f"Unknown rate-limit algorithm {name!r}. Use one of: {', '.join(ALGORITHMS)}."
    )


# -- bounded work per call --------------------------------------------------------------------
# Redis runs a script alone: while one call runs, every other client waits. Each algorithm's own
# bounds are in its registry entry (flask_distlimit.engine.registry.check_rate); these are the
# bounds of a request, whatever its algorithms.

#: The most limits one request may carry (global, tier and route limits together): the storage
#: evaluates all of a request's limits in one script call, so its time grows with their number.
MAX_LIMITS_PER_REQUEST: Final = 8


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
