"""The five rate-limit algorithms, by name.

Each has a Lua implementation (``lua/<name>.lua``, run atomically in Redis) and a pure-Python twin
(``flask_distlimit.storage.twins``) that decides exactly as the Lua does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, Literal

from .errors import ConfigurationError

if TYPE_CHECKING:
    from .limits import Rate

__all__ = [
    "ALGORITHMS",
    "EXACT_ALGORITHMS",
    "MAX_GCRA_RATE",
    "MAX_LOG_LIMIT",
    "Algorithm",
    "check_rate",
    "validate_algorithm",
]

Algorithm = Literal[
    "fixed_window",
    "sliding_window_log",
    "sliding_window_counter",
    "token_bucket",
    "gcra",
]

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


#: The sliding window log stores one entry per unit: a larger limit costs too much memory and
#: one request of a large cost would write that many entries while Redis waits.
MAX_LOG_LIMIT: Final = 100_000
#: GCRA keeps its state in emission intervals of ``period / limit`` microseconds; faster than one
#: unit per microsecond, the interval cannot be computed exactly.
MAX_GCRA_RATE: Final = 1_000_000  # units per second


def check_rate(algorithm: Algorithm, rate: Rate) -> None:
    """Raise :class:`ConfigurationError` when ``algorithm`` cannot enforce ``rate`` exactly."""
    if algorithm == "sliding_window_log" and rate.amount > MAX_LOG_LIMIT:
        raise ConfigurationError(
            f"The sliding_window_log algorithm keeps one entry per request, so it accepts limits "
            f"up to {MAX_LOG_LIMIT} per window, got {rate}. Use sliding_window_counter (two "
            "numbers per client) or token_bucket for large limits."
        )
    if algorithm == "gcra" and rate.amount > MAX_GCRA_RATE * rate.period:
        raise ConfigurationError(
            f"The gcra algorithm accepts rates up to {MAX_GCRA_RATE} per second, got {rate}. "
            "Use token_bucket or fixed_window for faster rates."
        )
