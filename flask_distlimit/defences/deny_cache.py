"""The local deny cache: a flooding client costs the storage nothing.

After the storage denies a key for ``T`` seconds, this process refuses that key's requests of
the same or a larger cost itself until then, never one the storage would admit
(docs/design-notes.md, "The deny cache"). Entries live at most ``max_ttl`` seconds. Bounded
(LRU), thread-safe, with an injected clock in microseconds.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from flask_distlimit.core.decision import Check, Decision

#: Microseconds a remembered denial ends before the storage's retry time.
_MARGIN_US: Final = 1_000


def monotonic_us() -> int:
    """The local monotonic clock in microseconds (the default clock of the cache)."""
    return time.monotonic_ns() // 1000


@dataclass(frozen=True, slots=True)
class Denial:
    """A remembered refusal of one key."""

    cost: int  #: the cost that was refused; only requests costing at least this are answered
    until_us: int  #: local time (clock microseconds) before which a request cannot pass
    retry_us: int  #: local time by which a request can surely pass (>= until_us)
    limit: int  #: the limit's amount, for the response headers
    #: local time by which the quota the refusal saw resets (its ``reset_after``), so that the
    #: cached 429's ``X-RateLimit-Reset`` is the storage's, never earlier
    reset_us: int

    def retry_after(self, now_us: int) -> float:
        """Seconds until a request of :attr:`cost` can pass (an upper bound, for Retry-After)."""
        return max(0.0, (self.retry_us - now_us) / 1_000_000)

    def reset_after(self, now_us: int) -> float:
        """Seconds until the quota resets, as the refusal reported it (at least
        :meth:`retry_after`)."""
        return max(0.0, (max(self.reset_us, self.retry_us) - now_us) / 1_000_000)


class DenyCache:
    """Remembers denied keys for as long as the storage would keep denying them."""

    def __init__(
        self,
        *,
        clock: Callable[[], int] = monotonic_us,
        max_entries: int = 10_000,
        max_ttl: float = 60.0,
    ) -> None:
        self.clock = clock
        self.max_entries = max_entries
        self.max_ttl_us = int(max_ttl * 1_000_000)
        #: key -> its remembered denial, least recently used first (read it without the lock only
        #: to tell whether it is empty, as the request path does before any lookup)
        self.entries: OrderedDict[str, Denial] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, key: str, cost: int, now_us: int | None = None) -> Denial | None:
        """The remembered denial that certainly refuses ``cost`` on ``key`` now, if any."""
        now = self.clock() if now_us is None else now_us
        with self._lock:
            denial = self.entries.get(key)
            if denial is None:
                return None
            if now >= denial.until_us:
                del self.entries[key]
                return None
            self.entries.move_to_end(key)
        return denial if cost >= denial.cost else None

    def record(
        self, check: Check, decision: Decision, *, started_us: int, finished_us: int
    ) -> None:
        """Remember that the storage refused ``check`` with ``decision``.

        ``started_us`` and ``finished_us`` are this clock's times taken before and after the
        storage call that refused.
        """
        retry_after = decision.retry_after
        if check.cost < 1 or retry_after <= 0:
            return
        seconds = check.period if math.isinf(retry_after) else retry_after
        # floor, minus the margin: never past the real time
        ttl_us = min(int(seconds * 1_000_000) - _MARGIN_US, self.max_ttl_us)
        if ttl_us <= 0:
            return
        finished = max(finished_us, started_us)
        retry_us = finished + math.ceil(seconds * 1_000_000)
        reset_us = 0
        if math.isfinite(decision.reset_after):
            reset_us = finished + math.ceil(decision.reset_after * 1_000_000)
        denial = Denial(check.cost, started_us + ttl_us, retry_us, decision.limit, reset_us)
        with self._lock:
            self.entries[check.key] = denial
            self.entries.move_to_end(check.key)
            while len(self.entries) > self.max_entries:
                self.entries.popitem(last=False)

    def forget(self, key: str) -> None:
        """Drop what is remembered of one key."""
        with self._lock:
            self.entries.pop(key, None)

    def clear(self) -> None:
        """Forget every denial (after the limits were reset)."""
        with self._lock:
            self.entries.clear()

    def reset_after_fork(self) -> None:
        """In a forked child: a fresh lock (the parent's may have been held by another thread)."""
        self._lock = threading.Lock()
