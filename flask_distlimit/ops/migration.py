"""Porting from Flask-Limiter: what ``Limiter(...)`` says when given Flask-Limiter's arguments.

Each Flask-Limiter argument raises :class:`TypeError` naming what replaces it; each leftover
``RATELIMIT_*`` key (:data:`CONFIG_KEYS`) gets one WARNING at ``init_app``
(:func:`warn_leftover_keys`), not an error, so both extensions may run while an app migrates. The
whole table: docs/migrating-from-flask-limiter.md.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Final

log = logging.getLogger("flask_distlimit")

#: Flask-Limiter 4.x ``Limiter(...)`` arguments -> what to write here instead.
CONSTRUCTOR: Final[dict[str, str]] = {
    "key_func": (
        "none app-wide, drop it: the identity is the verified user, JWT or API key, else the "
        "client IP (set DISTLIMIT_TRUSTED_PROXIES behind a proxy); for another key pass "
        "key_func= per limit"
    ),
    "app": "Limiter(app) or Limiter(app=app)",
    "default_limits": "DISTLIMIT_DEFAULT_LIMITS = '100/hour;10/minute' (one string, ';'-joined), "
    "a callable answering one, or a mapping tier -> limit string",
    "default_limits_per_method": "limiter.limit(..., per_method=True)(app): a default limit",
    "default_limits_exempt_when": "a default limit on the app: "
    "limiter.limit('100/hour', exempt_when=...)(app)",
    "default_limits_deduct_when": "limiter.limit('100/hour', deduct_when=...)(app)",
    "default_limits_cost": "limiter.limit('100/hour', cost=...)(app); "
    "DISTLIMIT_CONDITIONAL_COST for conditional GETs",
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
    "storage_options": "options in the URL query, DISTLIMIT_REDIS_TIMEOUT, or "
    "Limiter(storage=RedisStorage(...))",
    "swallow_errors": "DISTLIMIT_FAILURE_POLICY = 'open' (the default) with the breaker",
    "fail_on_first_breach": "none: every limit of a request is decided in one atomic call",
    "on_breach": "Limiter(on_breach=...) or @limiter.on_breach: called with a Breach",
    "meta_limits": "DISTLIMIT_META_LIMITS = '2/hour;5/day' (a limit string per identity, "
    "watching every limit of the request)",
    "on_meta_breach": "Limiter(on_breach=...): a meta refusal's violated_policies start with "
    "'meta:'",
    "in_memory_fallback": "DISTLIMIT_FAILURE_POLICY = 'local' (the same limits, divided among "
    "DISTLIMIT_INSTANCES)",
    "in_memory_fallback_enabled": "DISTLIMIT_FAILURE_POLICY = 'local'",
    "retry_after": "none: Retry-After is always delta-seconds",
    "key_prefix": "DISTLIMIT_KEY_PREFIX",
    "request_identifier": "none: routes are known by endpoint (view identity, never its name)",
    "enabled": "DISTLIMIT_ENABLED",
}

#: Flask-Limiter 4.x's configuration keys (``flask_limiter.constants.ConfigVars``) -> what
#: replaces each here (the guide's table says the same, with reasons).
CONFIG_KEYS: Final[dict[str, str]] = {
    "RATELIMIT_ENABLED": "DISTLIMIT_ENABLED",
    "RATELIMIT_KEY_FUNC": "none: the request's identity (DISTLIMIT_TRUSTED_PROXIES behind a "
    "proxy), or key_func= per limit",
    "RATELIMIT_KEY_PREFIX": "DISTLIMIT_KEY_PREFIX",
    "RATELIMIT_FAIL_ON_FIRST_BREACH": "none: every limit of a request is decided in one call",
    "RATELIMIT_ON_BREACH_CALLBACK": "Limiter(on_breach=...)",
    "RATELIMIT_SWALLOW_ERRORS": "DISTLIMIT_FAILURE_POLICY",
    "RATELIMIT_APPLICATION": "DISTLIMIT_GLOBAL_LIMITS",
    "RATELIMIT_APPLICATION_PER_METHOD": "none: global limits count every method together",
    "RATELIMIT_APPLICATION_EXEMPT_WHEN": "Limiter(request_filter=...)",
    "RATELIMIT_APPLICATION_DEDUCT_WHEN": "none: global limits are charged before the view",
    "RATELIMIT_APPLICATION_COST": "none: a global limit costs 1 per request",
    "RATELIMIT_DEFAULT": "DISTLIMIT_DEFAULT_LIMITS",
    "RATELIMIT_DEFAULTS_PER_METHOD": "limiter.limit(..., per_method=True)(app)",
    "RATELIMIT_DEFAULTS_EXEMPT_WHEN": "limiter.limit(..., exempt_when=...)(app)",
    "RATELIMIT_DEFAULTS_DEDUCT_WHEN": "limiter.limit(..., deduct_when=...)(app)",
    "RATELIMIT_DEFAULTS_COST": "limiter.limit(..., cost=...)(app)",
    "RATELIMIT_REQUEST_IDENTIFIER": "none: routes are known by endpoint",
    "RATELIMIT_STRATEGY": "DISTLIMIT_ALGORITHM",
    "RATELIMIT_STORAGE_URI": "DISTLIMIT_STORAGE_URL",
    "RATELIMIT_STORAGE_OPTIONS": "the URL's query, DISTLIMIT_REDIS_TIMEOUT",
    "RATELIMIT_HEADERS_ENABLED": "DISTLIMIT_HEADERS",
    "RATELIMIT_HEADER_LIMIT": "none: header names are fixed",
    "RATELIMIT_HEADER_REMAINING": "none: header names are fixed",
    "RATELIMIT_HEADER_RESET": "none: header names are fixed",
    "RATELIMIT_HEADER_RETRY_AFTER": "none: header names are fixed",
    "RATELIMIT_HEADER_RETRY_AFTER_VALUE": "none: Retry-After is always delta-seconds",
    "RATELIMIT_IN_MEMORY_FALLBACK": "DISTLIMIT_FAILURE_POLICY = 'local'",
    "RATELIMIT_IN_MEMORY_FALLBACK_ENABLED": "DISTLIMIT_FAILURE_POLICY = 'local'",
    "RATELIMIT_META": "DISTLIMIT_META_LIMITS (a limit string per identity)",
    "RATELIMIT_ON_META_BREACH_CALLBACK": "Limiter(on_breach=...), told meta refusals too",
}

_GUIDE: Final = "See docs/migrating-from-flask-limiter.md."


def leftover_keys_message(config: Mapping[str, object]) -> str | None:
    """The WARNING text for the ``RATELIMIT_*`` keys of ``config`` (None when it has none)."""
    found = sorted(k for k in config if isinstance(k, str) and k.startswith("RATELIMIT_"))
    if not found:
        return None
    parts = [
        f"{key} -> {CONFIG_KEYS.get(key, 'not a Flask-Limiter 4.x key either')}" for key in found
    ]
    return (
        f"Flask-DistLimit does not read Flask-Limiter's setting{'s' if len(found) > 1 else ''} "
        f"{', '.join(found)}: {'they have' if len(found) > 1 else 'it has'} no effect on this "
        f"limiter. Port: {'; '.join(parts)}. Remove the RATELIMIT_* keys once Flask-Limiter no "
        f"longer runs on this app. {_GUIDE}"
    )


def warn_leftover_keys(config: Mapping[str, object], app_name: str) -> None:
    """Log one WARNING naming each ``RATELIMIT_*`` key of ``config`` and its replacement
    (called by ``init_app``; see the module docstring for why this warns and does not raise)."""
    message = leftover_keys_message(config)
    if message is not None:
        log.warning("App %r: %s", app_name, message)


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


def options_message(names: Collection[str]) -> str:
    """The TypeError text for keyword arguments ``Limiter`` does not take (its ``**kwargs``)."""
    parts = [f"{name}: {CONSTRUCTOR[name]}" for name in names if name in CONSTRUCTOR]
    unknown = [name for name in names if name not in CONSTRUCTOR]
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
