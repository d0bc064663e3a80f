"""A guard's health report: the storage checked, its breakers, fallbacks and troubles; never raises.

:func:`health` answers :meth:`Guard.health <flask_distlimit.resilience.guard.Guard.health>`. The
storage is checked even while a breaker is open, without moving it: a PING, whether the scripts
are loaded, one evaluation of cost 0 (consumes nothing, writes no key). Any failure gives
``ok: False``, its cause in one line in ``error`` and its class name in ``error_type``.
``breaker``, ``breaker_failures`` and ``breaker_open_seconds`` are the worst node's
(:func:`~flask_distlimit.resilience.breakers.worst`). Every entry is documented in
docs/failure-modes.md, "Observability".
"""

from __future__ import annotations

import logging

from flask_distlimit.core.decision import Check
from flask_distlimit.errors import StorageError
from flask_distlimit.resilience.breaker import Breaker
from flask_distlimit.resilience.breakers import worst
from flask_distlimit.resilience.guard_core import GuardCore
from flask_distlimit.resilience.storage_log import one_line

__all__ = ["health"]

log = logging.getLogger("flask_distlimit.guard")  # a public name (docs/failure-modes.md), kept


def health(guard: GuardCore) -> dict[str, object]:
    """The health report of ``guard`` (see the module docstring)."""
    storage = guard.storage
    # What is evaluated: cost 0 consumes nothing and writes no key, but needs what a request
    # needs (EVALSHA, the script's commands, access to keys under the prefix).
    probe = Check(f"{guard.key_prefix}:{{health}}:probe:fixed_window", "fixed_window", 1, 1, 0)
    error: str | None = None
    error_type: str | None = None
    latency: float | None = None
    loaded: bool | None = None
    try:
        latency = storage.ping()
        loaded = storage.scripts_loaded()
        storage.evaluate([probe])
    except StorageError as exc:
        error, error_type = one_line(str(exc) or type(exc).__name__), type(exc).__name__
    except Exception as exc:  # a broken storage must not break the health check
        log.debug("Health check of %s failed", guard.name, exc_info=True)
        error = one_line(f"unexpected {type(exc).__name__} from the storage: {exc}")
        error_type = type(exc).__name__
    if guard.follows:
        guard.follow_node(refresh=False)  # name the master the storage found, if it connected
    guard.breakers.prune()
    current = guard.breaker  # made if new: the heartbeat key's node is always shown
    by_node = guard.breakers.by_node()
    figures = {node: _figures(b) for node, b in by_node.items()}
    shown = worst(list(by_node.values())) or current
    aggregate = shown.state
    told = guard.storage_log
    instances = guard.instances
    return {
        "ok": error is None and aggregate == "closed",
        "storage": storage.scheme,
        "latency_ms": None if latency is None else round(latency * 1000, 3),
        "error": error,
        "error_type": error_type,
        "scripts_loaded": loaded,
        "breaker": aggregate,
        "breakers": {node: f["state"] for node, f in figures.items()},
        "breaker_nodes": figures,
        "breaker_failures": shown.failures,
        "breaker_open_seconds": _seconds(shown),
        "policy": guard.policy,
        "instances": instances.setting,
        "instances_min": instances.minimum,
        "instances_seen": instances.seen,
        "fallback_divisor": instances.divisor,
        "fallback_active": guard.fallback_active,
        "fallback_held_keys": sum(f.held() for f in guard.fallbacks.all()),
        "unreadable_replies": told.unreadable_count,
        "unreadable_last": told.unreadable_last,
        "side_call_failures": told.side_failures,
        "side_call_last": told.side_last,
    }


def _seconds(breaker: Breaker) -> float | None:
    """How long ``breaker`` has been open, to the millisecond (``None``: closed)."""
    opened_for = breaker.opened_for()
    return None if opened_for is None else round(opened_for, 3)


def _figures(breaker: Breaker) -> dict[str, object]:
    """One node's line of ``health()["breaker_nodes"]``."""
    return {"state": breaker.state, "failures": breaker.failures, "open_seconds": _seconds(breaker)}
