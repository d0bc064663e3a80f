"""Log pacing: at most one line per interval, with a count of the lines held back."""

from __future__ import annotations

__all__ = ["Pace"]


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
