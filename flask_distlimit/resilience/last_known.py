"""What the storage last said was left, per key: where the local fallback starts from.

:class:`LastKnown` keeps per key the units left, when that was said and when the quota is whole
again; at most ``max_entries`` keys, the least recently answered dropped first; thread-safe;
injected clock in seconds. Design: docs/design-notes.md, "What Redis last said".
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple

from flask_distlimit.core.decision import Check, Evaluation


class _Entry(NamedTuple):
    limit: int  # the limit the figure is for: a changed limit makes it meaningless
    remaining: int  # units left for the whole fleet, as the storage said
    read_at: float  # clock() when the storage said it: the others may have spent since
    whole_at: float  # clock() when the quota is whole again: the figure is stale from then on


class Reading(NamedTuple):
    """What the storage last said was left for a key, and how long ago (seconds)."""

    remaining: int
    age: float


class LastKnown:
    """The units the storage last said were left for each key, while that figure holds."""

    def __init__(
        self, *, clock: Callable[[], float] = time.monotonic, max_entries: int = 10_000
    ) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries!r}")
        self.max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, checks: Sequence[Check], evaluation: Evaluation) -> None:
        """Remember what the storage answered for each of ``checks``."""
        now = self._clock()
        entries = self._entries
        with self._lock:
            for check, decision in zip(checks, evaluation.decisions, strict=False):
                entries[check.key] = _Entry(
                    check.limit, decision.remaining, now, now + decision.reset_after
                )
                entries.move_to_end(check.key)
            while len(entries) > self.max_entries:
                entries.popitem(last=False)

    def reading(self, check: Check) -> Reading | None:
        """What the storage last said was left for ``check``'s key and how long ago, or
        ``None`` when it said nothing since the quota was last whole (or for another limit)."""
        with self._lock:
            entry = self._entries.get(check.key)
        now = self._clock()
        if entry is None or entry.limit != check.limit or now >= entry.whole_at:
            return None
        return Reading(entry.remaining, max(0.0, now - entry.read_at))

    def _after_fork(self) -> None:
        self._lock = threading.Lock()  # what the parent knew still holds for the fleet
