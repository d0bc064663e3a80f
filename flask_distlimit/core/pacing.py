"""Log pacing: at most one line per interval, with a count of the lines held back; at most one
per key (a client and limit) per window."""

from __future__ import annotations

from collections.abc import Iterable

from flask_distlimit.core.decision import Check


class Pace:
    """At most one line every ``interval`` (in the caller's clock units). Not locked: callers
    that share one hold their own lock."""

    __slots__ = ("held", "interval", "last")

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.last: float | None = None  # the clock when the last line was let through
        self.held = 0  # lines held back since then

    def due(self, now: float) -> int | None:
        """``None`` when a line was let through less than ``interval`` ago (this one is held
        back and counted), else the count held back since the last (this one is let through)."""
        last = self.last
        if last is not None and 0 <= now - last < self.interval:
            self.held += 1
            return None
        self.last = now
        held, self.held = self.held, 0
        return held


def paced(paces: dict[str, Pace], key: str, now: float, interval: float) -> bool:
    """Whether a line about ``key`` may go out at ``now``: one per ``interval`` per key, each
    key's :class:`Pace` kept in ``paces`` (emptied when it holds 10,000 keys)."""
    pace = paces.get(key)
    if pace is None:
        if len(paces) >= 10_000:
            paces.clear()
        pace = paces[key] = Pace(interval)
    return pace.due(now) is not None


class OncePerWindow:
    """Clients and limits (a check's storage key) told of at most once per their window: each
    is kept until its window ends (microseconds), at most ``kept`` of them (the ended ones go
    first, then all). Not locked: a lost mark costs one line more."""

    __slots__ = ("_kept", "until")

    def __init__(self, kept: int = 10_000) -> None:
        self._kept = kept
        self.until: dict[str, int] = {}

    def due(self, checks: Iterable[Check], now: int) -> list[Check]:
        """Those of ``checks`` that may be told of at ``now``, noted as told of until their
        window (``Check.period``) ends."""
        until = self.until
        fresh = [c for c in checks if until.get(c.key, 0) <= now]
        if fresh and len(until) >= self._kept:
            for key in [k for k, end in until.items() if end <= now]:
                del until[key]
            if len(until) >= self._kept:
                until.clear()
        for c in fresh:
            until[c.key] = now + c.period * 1_000_000
        return fresh
