"""How many processes share the limits: the divisor of the local fallback.

``DISTLIMIT_INSTANCES`` is a count or ``"auto"``: a heartbeat piggy-backed on requests, no thread.
Promises: the divisor is the largest fleet size this process was told in its last beats, at least
``DISTLIMIT_INSTANCES_MIN``; it survives a Redis restart and follows a shrinking fleet within
about three TTLs. Design: docs/design-notes.md, "Counting the instances".
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Final, Literal

from flask_distlimit.core.ranges import Range
from flask_distlimit.errors import ConfigurationError
from flask_distlimit.storage.base import Storage
from flask_distlimit.storage.heartbeat import MAX_FLEET

log = logging.getLogger("flask_distlimit.instances")  # a public name (docs/failure-modes.md), kept

InstancesSetting = int | Literal["auto"]


def validate_instances(value: object) -> InstancesSetting:
    """``DISTLIMIT_INSTANCES`` as an int from 1 to 100000 or ``"auto"`` (a string of digits is
    refused, as by every numeric key); else :class:`ConfigurationError`."""
    if value == "auto":
        return "auto"
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_FLEET:
        return value
    raise ConfigurationError(
        f"DISTLIMIT_INSTANCES = {value!r} is not valid. Use a positive integer up to {MAX_FLEET} "
        "(the number of processes sharing the limits, e.g. replicas x gunicorn workers) or "
        "'auto' (count live processes through heartbeats in the storage)."
    )


#: ``DISTLIMIT_INSTANCES_MIN``'s values
INSTANCES_MIN: Final = Range(
    True,
    1,
    MAX_FLEET,
    " (the smallest divisor of the local fallback, what a process that has "
    "not reached the storage yet divides by)",
)


def process_member() -> str:
    """This process, as the storage knows it: ``host:pid:token`` (the token tells apart two
    limiters of one process, and a PID the system gave again)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class Instances:
    """The fallback divisor, fixed or counted through heartbeats."""

    def __init__(
        self,
        setting: InstancesSetting = 1,
        *,
        minimum: int = 1,
        key_prefix: str = "ratelimit",
        interval: float = 5.0,
        ttl: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.setting = validate_instances(setting)
        self.minimum = int(INSTANCES_MIN.read("DISTLIMIT_INSTANCES_MIN", minimum))
        self.auto = self.setting == "auto"
        self.key = f"{key_prefix}:instances"
        self.interval = interval
        self.ttl = ttl if ttl is not None else 3 * interval
        if self.ttl <= interval:
            raise ConfigurationError(
                f"heartbeat ttl ({self.ttl} s) must be longer than its interval ({interval} s), "
                "or live processes would drop out of the count between two beats"
            )
        self._clock = clock
        self._lock = threading.Lock()
        self.member = process_member()
        #: Live processes counted by the last heartbeat (``None``: never reached the storage).
        self.seen: int | None = None
        beats = math.ceil(self.ttl / interval)  # one TTL of beating
        self._live: deque[int] = deque(maxlen=beats)  # live counts this process saw
        self._told: deque[int] = deque(maxlen=beats)  # the largest sizes it was told
        #: What the local fallback divides every limit by.
        self.divisor = max(self.minimum, self.setting if isinstance(self.setting, int) else 1)
        self._next_at = float("-inf") if self.auto else float("inf")
        self._beating = False

    def due(self) -> bool:
        """Cheap: is a heartbeat due now? (Always false unless ``"auto"``.)"""
        return self._clock() >= self._next_at

    def beat(self, storage: Storage) -> tuple[str, ...]:
        """Refresh this process's heartbeat, learn the fleet size, and answer the keys the
        storage found holding garbage and replaced (the caller logs them).

        Only one thread beats at a time; the others return at once. An outage is raised as
        :class:`StorageUnavailable` (the caller counts it), an error reply as
        :class:`StorageResponseError` (the caller, :meth:`Guard.side_call
        <flask_distlimit.resilience.guard.Guard.side_call>`, counts and logs it; the divisor is
        kept).
        """
        with self._lock:
            now = self._clock()
            if self._beating or now < self._next_at:
                return ()
            self._beating = True
            self._next_at = now + self.interval
        try:
            known = max(self._live, default=0)
            fleet = storage.heartbeat_fleet(self.key, self.member, self.ttl, known)
            live = max(1, int(fleet.live))
            self._live.append(live)
            self._told.append(max(live, int(fleet.largest), known))
            divisor = max(self.minimum, *self._told)
            if live != self.seen or divisor != self.divisor:
                log.info(
                    "Live rate-limit instances: %d (was %s); fallback divisor %d (the largest "
                    "fleet in the last %d heartbeats, at least %d)",
                    live,
                    self.seen,
                    divisor,
                    len(self._told),
                    self.minimum,
                )
            self.seen = live
            self.divisor = divisor
            return fleet.repaired_keys
        finally:
            self._beating = False

    def _after_fork(self) -> None:
        # A gunicorn worker is an instance of its own: new member, beat on its first request.
        # What the parent knew of the fleet still holds for it.
        self._lock = threading.Lock()
        self._beating = False
        self.member = process_member()
        if self.auto:
            self._next_at = float("-inf")
