"""How many processes share the limits: the divisor of the local fallback.

``DISTLIMIT_INSTANCES`` is a fixed count or ``"auto"``. With ``"auto"``, while the storage is
healthy each process (each gunicorn worker is one) keeps a heartbeat: a member
``<hostname>:<pid>:<random>`` in the sorted set ``<key_prefix>:instances``, refreshed at most every
``interval`` seconds and expiring after ``ttl``. The refresh piggy-backs on a request (one extra,
cheap storage call, only when due; no background thread, which would not survive gunicorn's fork).
The live count it answers is remembered: when the storage goes away, that count is the divisor.

A process that has never reached the storage divides by 1 (it cannot know better) and says so in
:meth:`Instances.snapshot`.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Literal

from .errors import ConfigurationError, StorageResponseError, StorageUnavailable
from .storage.base import Storage

__all__ = ["Instances", "InstancesSetting", "validate_instances"]

log = logging.getLogger(__name__)

InstancesSetting = int | Literal["auto"]


def validate_instances(value: object) -> InstancesSetting:
    """``DISTLIMIT_INSTANCES`` as a positive int or ``"auto"``; else :class:`ConfigurationError`."""
    if value == "auto":
        return "auto"
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ConfigurationError(
        f"DISTLIMIT_INSTANCES={value!r} is not valid. Use a positive integer (the number of "
        'processes sharing the limits, e.g. replicas x gunicorn workers) or "auto" (count live '
        "processes through heartbeats in the storage)."
    )


def _member() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class Instances:
    """The fallback divisor, fixed or counted through heartbeats."""

    def __init__(
        self,
        setting: InstancesSetting = 1,
        *,
        key_prefix: str = "ratelimit",
        interval: float = 5.0,
        ttl: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.setting = validate_instances(setting)
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
        self.member = _member()
        #: Live processes counted by the last heartbeat (``None``: never reached the storage).
        self.seen: int | None = None
        self._next_at = float("-inf") if self.auto else float("inf")
        self._beating = False

    @property
    def divisor(self) -> int:
        """What the local fallback divides every limit by."""
        if isinstance(self.setting, int):
            return self.setting
        return max(1, self.seen or 1)

    def due(self) -> bool:
        """Cheap: is a heartbeat due now? (Always false unless ``"auto"``.)"""
        return self._clock() >= self._next_at

    def beat(self, storage: Storage) -> None:
        """Refresh this process's heartbeat and remember the live count.

        Only one thread beats at a time; the others return at once. An outage is raised as
        :class:`StorageUnavailable` (the caller counts it); an error reply is logged, not raised:
        the request it rides on has already been decided.
        """
        with self._lock:
            now = self._clock()
            if self._beating or now < self._next_at:
                return
            self._beating = True
            self._next_at = now + self.interval
        try:
            count = storage.heartbeat(self.key, self.member, self.ttl)
        except StorageUnavailable:
            raise
        except StorageResponseError:
            log.exception(
                "Heartbeat on %r failed with an error reply; keeping count %s", self.key, self.seen
            )
        else:
            if count != self.seen:
                log.info("Live rate-limit instances: %d (was %s)", count, self.seen)
            self.seen = max(1, int(count))
        finally:
            self._beating = False

    def snapshot(self) -> dict[str, object]:
        return {
            "setting": self.setting,
            "seen": self.seen,
            "divisor": self.divisor,
            "member": self.member,
        }

    def _after_fork(self) -> None:
        # A gunicorn worker is an instance of its own: new member, beat on its first request.
        self._lock = threading.Lock()
        self._beating = False
        self.member = _member()
        if self.auto:
            self._next_at = float("-inf")
