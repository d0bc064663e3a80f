"""Porting from Flask-Limiter: what ``Limiter(...)`` says when given Flask-Limiter's arguments.

``Limiter(get_remote_address, app=app)`` and ``Limiter(key_func, default_limits=[...])`` raise
:class:`TypeError` naming, for each Flask-Limiter argument, what replaces it here. The guide
``docs/migrating-from-flask-limiter.md`` has the whole table, with the decorator arguments and
the ``RATELIMIT_*`` keys.

Why a positional ``key_func`` is refused rather than accepted: Flask-Limiter's ``key_func``
decides who is counted for every limit of the app. Here that is the identity layer (a verified
user, a JWT, an API key, else the client address behind ``DISTLIMIT_TRUSTED_PROXIES``), which
the breaker, the local fallback, the CLI and the headers all rely on. Taking
``get_remote_address`` silently would count ``REMOTE_ADDR`` as is, which behind a load balancer
is the balancer's address: every client in one bucket. Refusing with the port spelled out costs
one edit; accepting it would change who is counted without a word.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

__all__ = ["CONSTRUCTOR", "key_func_message", "options_message"]

#: Flask-Limiter 4.x ``Limiter(...)`` arguments -> what to write here instead.
CONSTRUCTOR: Final[dict[str, str]] = {
    "key_func": (
        "drop it: the default identity is the verified user, JWT or API key, else the client IP "
        "(set DISTLIMIT_TRUSTED_PROXIES behind a proxy); for another key pass key_func= per limit"
    ),
    "app": "Limiter(app) or Limiter(app=app)",
    "default_limits": "DISTLIMIT_DEFAULT_LIMITS = '100/hour;10/minute' (a string, ';'-joined)",
    "default_limits_per_method": "per_method=True on the limits that need it (no app-wide switch)",
    "default_limits_exempt_when": "Limiter(request_filter=...) or limiter.exempt on the views",
    "default_limits_deduct_when": "deduct_when= on the routes that need it",
    "default_limits_cost": "cost= per limit; DISTLIMIT_CONDITIONAL_COST for conditional requests",
    "application_limits": "DISTLIMIT_GLOBAL_LIMITS (per client IP, every route)",
    "application_limits_per_method": "none: global limits count every method together",
    "application_limits_exempt_when": "Limiter(request_filter=...) (exempts every limit)",
    "application_limits_deduct_when": "none: global limits are charged before the view",
    "application_limits_cost": "none: a global limit costs 1 per request",
    "headers_enabled": "DISTLIMIT_HEADERS = 'legacy' | 'ietf' | 'both' | 'none'",
    "header_name_mapping": "none: header names are fixed (X-RateLimit-*, RateLimit, Retry-After)",
    "strategy": "DISTLIMIT_ALGORITHM (fixed-window -> fixed_window, moving-window -> "
    "sliding_window_log, sliding-window-counter -> sliding_window_counter)",
    "storage_uri": "DISTLIMIT_STORAGE_URL (redis://, rediss://, redis+sentinel://, "
    "redis+cluster://, memory://)",
    "storage_options": "options in the URL query, or Limiter(storage=RedisStorage(...))",
    "swallow_errors": "DISTLIMIT_FAILURE_POLICY = 'open' (the default) with the breaker",
    "fail_on_first_breach": "none: every limit of a request is decided in one atomic call",
    "on_breach": "Limiter(on_breach=...) or @limiter.on_breach: called with a Breach",
    "meta_limits": "none (see the guide)",
    "on_meta_breach": "none (see the guide)",
    "in_memory_fallback": "DISTLIMIT_FAILURE_POLICY = 'local' (the same limits, divided among "
    "DISTLIMIT_INSTANCES)",
    "in_memory_fallback_enabled": "DISTLIMIT_FAILURE_POLICY = 'local'",
    "retry_after": "none: Retry-After is always delta-seconds",
    "key_prefix": "DISTLIMIT_KEY_PREFIX",
    "request_identifier": "none: routes are known by endpoint (view identity, never its name)",
    "enabled": "DISTLIMIT_ENABLED",
}

_GUIDE: Final = "See docs/migrating-from-flask-limiter.md."


def key_func_message(func: object) -> str:
    name = getattr(func, "__qualname__", None) or repr(func)
    return (
        f"Limiter's first argument is the Flask app, got the function {name}: this is "
        "Flask-Limiter's Limiter(key_func, app=app). Port it as Limiter(app) (or Limiter() then "
        "limiter.init_app(app)) and drop the key function: the limiter counts the verified "
        "user, JWT or API key, else the client IP (set DISTLIMIT_TRUSTED_PROXIES behind a "
        "proxy; get_remote_address would count the proxy). For another key, pass "
        f"key_func= on the limits that need it. {_GUIDE}"
    )


def options_message(names: Iterable[str]) -> str:
    """The TypeError text for keyword arguments ``Limiter`` does not take."""
    parts: list[str] = []
    unknown: list[str] = []
    for name in names:
        hint = CONSTRUCTOR.get(name)
        if hint is None:
            unknown.append(name)
        else:
            parts.append(f"{name}: {hint}")
    if unknown and not parts:
        return (
            f"Limiter() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; it "
            "takes app, storage, clock, on_breach, deny_cache, deny_cache_size and "
            "request_filter; everything else is a DISTLIMIT_* setting of the app."
        )
    head = "Limiter() does not take Flask-Limiter's argument(s); port them: " + "; ".join(parts)
    if unknown:
        head += f". Unknown: {', '.join(map(repr, unknown))}"
    return f"{head}. {_GUIDE}"
