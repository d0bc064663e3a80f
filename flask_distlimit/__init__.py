"""Flask-DistLimit: exact distributed rate limiting for Flask on Redis."""

from __future__ import annotations

from flask_distlimit._version import __version__
from flask_distlimit.core.algorithms import ALGORITHMS, Algorithm
from flask_distlimit.core.decision import Check, Decision, Evaluation
from flask_distlimit.core.limits import Rate, parse_rates
from flask_distlimit.core.problem import (
    ConcurrencyLimitExceeded,
    Overloaded,
    RateLimitExceeded,
    RateLimitUnavailable,
)
from flask_distlimit.errors import (
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
from flask_distlimit.extension import Breach, Limiter, LimiterState
from flask_distlimit.request.current_limits import RequestLimit

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
