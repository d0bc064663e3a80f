"""What a guard tells the operator about its storage: paced log lines, and the counts behind them.

One :class:`StorageLog` per guard, i.e. per app and process (logger ``flask_distlimit.guard``, a
public name: docs/failure-modes.md). Each kind of trouble (a storage that refuses the limiter,
calls queued past their budget, a refused write, an error reply, a failed call beside a request's)
is logged once, then at most once every interval of the guard's injected clock, so that a storage
failing every call costs one line a minute, not one per request; each method says its level.
Error replies and failed side calls are also counted, for ``health()`` and the metrics; each key
the storage found holding garbage and reset gets one WARNING line. Logging takes one lock around
the pacing only (no I/O under it); a forked child starts afresh (:meth:`StorageLog.after_fork`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Final

from flask_distlimit._typing import FailurePolicy
from flask_distlimit.core.pacing import Pace, paced
from flask_distlimit.errors import StorageBusy, StorageError, StorageFull, StorageMisconfigured
from flask_distlimit.telemetry.metrics import Metrics

log = logging.getLogger("flask_distlimit.guard")  # a public name (docs/failure-modes.md), kept

#: Seconds between two ERROR lines about a storage that refuses the limiter (per guard).
MISCONFIGURED_LOG_INTERVAL: Final = 60.0

#: Seconds between two WARNING lines about calls beside a request's that failed (per guard).
SIDE_FAILURE_LOG_INTERVAL: Final = 60.0


def one_line(text: str) -> str:
    """``text`` with every run of whitespace (newlines included) made one space."""
    return " ".join(text.split())


def _said(exc: BaseException | str) -> str:
    return one_line(str(exc) or type(exc).__name__)


class StorageLog:
    """The paced log lines and counts of one guard (see the module docstring).

    ``name`` names the storage in every line, ``policy`` is the guard's default failure policy,
    ``key_prefix`` the prefix of the limiter's keys, ``clock`` the guard's monotonic clock.
    """

    def __init__(
        self,
        name: str,
        *,
        policy: FailurePolicy,
        key_prefix: str,
        clock: Callable[[], float],
    ) -> None:
        self.name = name
        self.policy: FailurePolicy = policy
        self.key_prefix = key_prefix
        self._clock = clock
        self.after_fork()

    def after_fork(self) -> None:
        """Start afresh (a new lock, nothing logged nor counted yet): also the initial state."""
        self._lock = threading.Lock()
        #: each kind of line's pace (by its method's name), but the side calls'
        self._paces: dict[str, Pace] = {}
        self._side = Pace(SIDE_FAILURE_LOG_INTERVAL)
        #: error replies answered by the failure policy, and the last one in one line
        self.unreadable_count = 0
        self.unreadable_last: str | None = None
        #: calls beside requests' that failed, and the last one (what: cause) in one line
        self.side_failures = 0
        self.side_last: str | None = None

    def _paced(self, kind: str, level: int, message: str, *args: object) -> None:
        now = self._clock()
        with self._lock:
            due = paced(self._paces, kind, now, MISCONFIGURED_LOG_INTERVAL)
        if due:
            log.log(level, message, self.name, *args)

    def refused(self, exc: StorageMisconfigured) -> None:
        """Log at ERROR that the storage refuses the limiter
        (:class:`~flask_distlimit.errors.StorageMisconfigured`: NOPERM, WRONGPASS, a bad database
        index, an unknown command): once, then at most every :data:`MISCONFIGURED_LOG_INTERVAL`."""
        self._paced(
            "refused",
            logging.ERROR,
            "Rate-limit storage %s refuses the limiter, so every request is answered by the "
            "failure policy (%r unless its route sets one) until the configuration is fixed "
            "(logged at most once a minute): %s",
            self.policy,
            exc,
        )

    def busy(self, exc: StorageBusy) -> None:
        """Log at WARNING that this process's calls queue past their budget: once, then at most
        once a minute."""
        self._paced(
            "busy",
            logging.WARNING,
            "Rate-limit storage %s: this process's calls queue past their budget, so "
            "such requests are answered 503 (Retry-After: 1); the breaker is not told "
            "(logged at most once a minute): %s",
            exc,
        )

    def full(self, exc: StorageFull, divisor: int) -> None:
        """Log at WARNING that the storage refuses writes (requests go to the local share
        ``limit / divisor``): once, then at most once a minute."""
        self._paced(
            "full",
            logging.WARNING,
            "Rate-limit storage %s refuses writes, so requests are decided at each "
            "process's local share of their limits (limit / %d, DISTLIMIT_INSTANCES; 503 "
            'under policy "closed") until it has room; its breaker stays closed (logged at '
            "most once a minute): %s",
            divisor,
            exc,
        )

    def unreadable(self, exc: StorageError, call: str | None, metrics: Metrics | None) -> None:
        """Count and log an error reply to a request's call, or to the side call ``call``
        names (skipped): every one counted, one ERROR line, then at most one a minute."""
        now = self._clock()
        if metrics is not None:
            metrics.unreadable()
        with self._lock:
            self.unreadable_count += 1
            self.unreadable_last = _said(exc)
            if not paced(self._paces, "unreadable", now, MISCONFIGURED_LOG_INTERVAL):
                return
        answered, then = f"answered {call} with", "; it is skipped"
        if call is None:
            answered = "answered"
            then = (
                ", so such requests are answered by the failure policy "
                f"({self.policy!r} unless their route sets one)"
            )
        log.error(
            "Rate-limit storage %s %s what the limiter cannot read (a bug, data it does not "
            "expect, or a Redis-compatible server that runs Lua otherwise)%s; logged at most "
            "once a minute: %s",
            self.name,
            answered,
            then,
            exc,
        )

    def side_failed(self, what: str, cause: BaseException | str, metrics: Metrics | None) -> None:
        """Count and log a call beside a request's that did not complete (``what`` names it,
        ``cause`` the error or why it was not made): every one counted; the first logs one
        WARNING line, then at most one every :data:`SIDE_FAILURE_LOG_INTERVAL` seconds, which
        says how many failed since the previous line."""
        now = self._clock()
        if metrics is not None:
            metrics.side_call_failed()
        text = _said(cause)
        with self._lock:
            self.side_failures += 1
            self.side_last = f"{what}: {text}"
            held = self._side.due(now)
            if held is None:
                return
        log.warning(
            "Rate-limit storage %s: %s failed and is skipped (%s); %d call(s) beside requests "
            "failed since the last such line (logged at most once a minute; every request "
            "is still decided as usual)",
            self.name,
            what,
            text,
            held + 1,
        )

    def repaired(self, keys: Sequence[str]) -> None:
        """Log each key the storage found holding data of the wrong type or shape, and reset."""
        for key in keys:
            log.warning(
                "Rate-limit key %s held data of the wrong type or shape; it was reset to a "
                "fresh state (something else writes under the key prefix %r?)",
                key,
                self.key_prefix,
            )
