"""The settings record of one app: every ``DISTLIMIT_*`` value, read and checked by
:class:`flask_distlimit.config.Settings` at ``init_app``, then read as they are by the request path
(docs/configuration.md documents each)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from flask_distlimit._typing import FailurePolicy, HeaderMode
from flask_distlimit.core.algorithms import Algorithm
from flask_distlimit.core.limits import Rate
from flask_distlimit.core.priorities import Priority
from flask_distlimit.declare.dynamic_limits import DynamicValue
from flask_distlimit.defences import shedding
from flask_distlimit.defences.shadow import ShadowSetting
from flask_distlimit.resilience.fallback import DEFAULT_MAX_KEYS
from flask_distlimit.storage.startup_check import StartupCheck


@dataclass(frozen=True, slots=True)
class LimiterSettings:
    """Every ``DISTLIMIT_*`` setting of one app, as read (their defaults when unset)."""

    storage_url: str = "memory://"
    algorithm: Algorithm = "sliding_window_counter"
    default_limits: tuple[Rate, ...] = ()
    #: ``DISTLIMIT_DEFAULT_LIMITS`` as a callable or a mapping (then ``default_limits`` is empty)
    default_dynamic: DynamicValue | None = None
    global_limits: tuple[Rate, ...] = ()
    global_dynamic: DynamicValue | None = None  #: a callable DISTLIMIT_GLOBAL_LIMITS
    meta_limits: tuple[Rate, ...] = ()
    headers: HeaderMode = "both"
    key_prefix: str = "ratelimit"
    redis_timeout: float = 0.1
    request_tokens: str = "auto"
    startup_check: StartupCheck = "warn"
    conditional_cost: int = 1
    enabled: bool = True
    failure_policy: FailurePolicy = "open"
    instances: int | Literal["auto"] = 1
    instances_min: int = 1
    fallback_max_keys: int = DEFAULT_MAX_KEYS
    breaker_fail_max: int = 5
    breaker_reset_timeout: float = 30.0
    charge_preflights: bool = False
    dynamic_limit_ttl: float = 60.0
    shadow: ShadowSetting = False
    concurrency_lease: int = 60
    worker_threads: int = 0
    worker_shed_at: Mapping[Priority, float] = field(
        default_factory=lambda: shedding.DEFAULT_SHED_AT
    )
    fleet_capacity: int = 0
    fleet_shares: Mapping[Priority, float] = field(default_factory=lambda: shedding.DEFAULT_SHARES)
