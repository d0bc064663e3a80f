"""Flask-DistLimit: exact distributed rate limiting for Flask on Redis."""

from __future__ import annotations

from .algorithms import ALGORITHMS, Algorithm
from .decision import Check, Decision, Evaluation
from .errors import (
    ConfigurationError,
    DistLimitError,
    StorageError,
    StorageResponseError,
    StorageUnavailable,
)
from .limits import Rate, parse_rates

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "Check",
    "ConfigurationError",
    "Decision",
    "DistLimitError",
    "Evaluation",
    "Rate",
    "StorageError",
    "StorageResponseError",
    "StorageUnavailable",
    "parse_rates",
]
