"""Flask-DistLimit: exact distributed rate limiting for Flask on Redis."""

from __future__ import annotations

from ._version import __version__
from .algorithms import ALGORITHMS, Algorithm
from .current_limits import RequestLimit
from .decision import Check, Decision, Evaluation
from .errors import (
    ClearedAddressWarning,
    ConfigurationError,
    DistLimitError,
    StorageBusy,
    StorageError,
    StorageFull,
    StorageMisconfigured,
    StorageReplyLost,
    StorageResponseError,
    StorageUnavailable,
)
from .extension import Breach, Limiter, LimiterState
from .limits import Rate, parse_rates
from .problem import (
    ConcurrencyLimitExceeded,
    Overloaded,
    RateLimitExceeded,
    RateLimitUnavailable,
)

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "Breach",
    "Check",
    "ClearedAddressWarning",
    "ConcurrencyLimitExceeded",
    "ConfigurationError",
    "Decision",
    "DistLimitError",
    "Evaluation",
    "Limiter",
    "LimiterState",
    "Overloaded",
    "Rate",
    "RateLimitExceeded",
    "RateLimitUnavailable",
    "RequestLimit",
    "StorageBusy",
    "StorageError",
    "StorageFull",
    "StorageMisconfigured",
    "StorageReplyLost",
    "StorageResponseError",
    "StorageUnavailable",
    "__version__",
    "parse_rates",
]
