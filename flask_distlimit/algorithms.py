"""The five rate-limit algorithms, by name.

Each has a Lua implementation (``lua/<name>.lua``, run atomically in Redis) and a pure-Python twin
(``flask_distlimit.storage.memory``) that decides exactly as the Lua does.
"""

from __future__ import annotations

from typing import Final, Literal

from .errors import ConfigurationError

__all__ = ["ALGORITHMS", "EXACT_ALGORITHMS", "Algorithm", "validate_algorithm"]

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
