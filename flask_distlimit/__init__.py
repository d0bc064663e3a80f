"""Flask-DistLimit: exact distributed rate limiting for Flask on Redis."""

from __future__ import annotations

from .algorithms import ALGORITHMS, Algorithm
from .current_limits import RequestLimit
from .decision import Check, Decision, Evaluation
from .errors import (
    ConfigurationError,
    DistLimitError,
    StorageBusy,
    StorageError,
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
    "StorageMisconfigured",
    "StorageReplyLost",
    "StorageResponseError",
    "StorageUnavailable",
    "parse_rates",
]
