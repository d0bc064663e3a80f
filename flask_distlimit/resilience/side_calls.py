"""Calls beside a request's own: the heartbeat, lease records, give-backs, the tag key's read.

Made only while its node's breaker lets calls through, which then hears how it ended; no failure
policy and no fallback: a failed side call is counted, logged and skipped. Entry points:
:meth:`Guard.open_side_call`, :meth:`Guard.side_call`, :meth:`Guard.evaluate_beside`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

from flask_distlimit.core.decision import Check
from flask_distlimit.errors import StorageError, StorageMisconfigured, StorageResponseError
from flask_distlimit.resilience.breaker import Breaker
from flask_distlimit.resilience.breakers import report_call, report_parts
from flask_distlimit.resilience.guard_core import GuardCore
from flask_distlimit.storage.base import Storage

__all__ = ["SideReport", "evaluate_beside", "heartbeat_if_due", "open_side_call", "side_call"]

log = logging.getLogger("flask_distlimit.guard")  # a public name (docs/failure-modes.md), kept

#: How a call beside the request's ended, told to its node's breaker (:func:`open_side_call`):
#: ``None`` when the storage answered, else the exception the call raised.
SideReport = Callable[[BaseException | None], None]


def open_side_call(core: GuardCore, key: str, what: str) -> SideReport | None:
    """Open a call beside the request's own on ``key`` (:meth:`Guard.open_side_call
    <flask_distlimit.resilience.guard.Guard.open_side_call>`)."""
    breaker = core.breaker_of(key)
    if not breaker.allow():
        return None
    return functools.partial(_heard, core, breaker, what)


def _heard(core: GuardCore, breaker: Breaker, what: str, error: BaseException | None) -> None:
    """Tell ``breaker`` how a call beside the request's ended (:func:`open_side_call`), and the
    operator what it should know."""
    report_call(breaker, error)
    if isinstance(error, StorageMisconfigured):
        core.storage_log.refused(error)
    elif isinstance(error, StorageResponseError):
        core.count_unreadable(error, what)


def side_call(
    core: GuardCore, key: str, call: Callable[[Storage], Sequence[str]], what: str
) -> None:
    """One separate, cheap storage call on ``key`` (:meth:`Guard.side_call
    <flask_distlimit.resilience.guard.Guard.side_call>`)."""
    heard = open_side_call(core, key, what)
    if heard is None:
        return
    try:
        repaired = call(core.storage)
    except StorageError as exc:
        heard(exc)
        if not isinstance(exc, StorageResponseError):  # those are counted as unreadable
            core.side_failed(what, exc)
        return
    except BaseException as exc:
        heard(exc)
        raise
    heard(None)
    if repaired:
        core.storage_log.repaired(repaired)


def heartbeat_if_due(core: GuardCore) -> None:
    """Refresh this process's instance heartbeat when ``DISTLIMIT_INSTANCES = "auto"`` and it is
    due (after a request the storage answered)."""
    instances = core.instances
    if instances.auto and instances.due():
        side_call(core, core.heartbeat_check.key, instances.beat, "the instance heartbeat")


def evaluate_beside(
    core: GuardCore, checks: Sequence[Check], what: str, now_us: int | None
) -> None:
    """Evaluate ``checks`` that no failure policy answers and whose answer nobody reads
    (:meth:`Guard.evaluate_beside <flask_distlimit.resilience.guard.Guard.evaluate_beside>`);
    never raises an :class:`Exception`."""
    if core.routed:
        routes = core.storage.route(checks)
        trying, _ = core.breakers.admit(node for node, _ in routes)
        live = [(n, [checks[i] for i in indexes]) for n, indexes in routes if n in trying]
    else:
        if not core.node_breaker.allow():
            return
        trying = {core.node: core.node_breaker}
        live = [(core.node, list(checks))]
    if not live:
        return
    try:
        results = core.storage.evaluate_parts([part for _, part in live], now_us=now_us)
    except BaseException as exc:
        for breaker in trying.values():
            breaker.release()
        if not isinstance(exc, Exception):
            raise
        log.error("%s failed unexpectedly; it is skipped", what.capitalize(), exc_info=True)
        return
    for refused in report_parts(trying, [node for node, _ in live], results):
        core.storage_log.refused(refused)
    for result in results:
        if isinstance(result, StorageResponseError):
            core.count_unreadable(result, what)
        elif isinstance(result, StorageError):
            core.side_failed(what, result)
