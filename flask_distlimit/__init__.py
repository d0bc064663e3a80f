"""Flask-DistLimit: exact distributed rate limiting for Flask on Redis.

The public API is what this module exports, with :mod:`flask_distlimit.testing` and
:mod:`flask_distlimit.storage`. The package is laid out in layers, lowest first: a module
imports only from its own layer or a lower one, at any time (``TYPE_CHECKING`` and
function-local imports too), and no two modules import each other, directly or through others
(tests/project/test_package_layout.py holds the package to this list):

1. foundation: ``_typing``, ``_version``, ``errors``, ``frozen``, ``forks``
2. ``core``: limit strings, algorithm names, checks and decisions, policies, priorities, refusals
3. ``engine``: each algorithm's Lua and its Python twin, the script a storage loads
4. ``storage``: ``memory://``, Redis single node, Sentinel and Cluster, their pools
5. ``telemetry``: Prometheus and OpenTelemetry metrics
6. ``identity``: who is asking, and the identity tags
7. ``declare``: declared limits, their registry and decorators, a route's bound limits
8. ``resilience``: circuit breakers, the guard around storage calls, the local fallback, leases
9. ``defences``: shadow and concurrency limits, load shedding, the deny cache, the ledger
10. ``request``: one request's path, from the gate before the view to the headers after it
11. ``ops``: operator tools (admin, migration from Flask-Limiter, who serves the app)
12. app: ``extension``, ``state``, ``config``, ``cli`` (and ``cli_limits``), ``testing``, and
   this module
"""

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
from flask_distlimit.declare.registry import ExemptionScope
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
from flask_distlimit.extension import Limiter
from flask_distlimit.request.current_limits import RequestLimit
from flask_distlimit.request.refuse import Breach
from flask_distlimit.state import LimiterState

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
    "ExemptionScope",
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
