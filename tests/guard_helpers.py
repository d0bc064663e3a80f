"""Test doubles for the guard's tests: a fake clock and a scriptable storage.

These are for the Python-layer unit tests only; the fault tests (tests/resilience/test_faults*.py)
run against real redis-server processes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Literal

from flask_distlimit.core.decision import Check, Decision, Evaluation
from flask_distlimit.errors import StorageMisconfigured, StorageResponseError, StorageUnavailable
from flask_distlimit.storage.base import Storage
from flask_distlimit.telemetry.metrics import Count, Instruments


class FakeClock:
    """A monotonic clock that moves only when told to."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


Mode = Literal["ok", "down", "refused", "error", "broken"]

#: The message of mode ``refused`` (what a Redis lacking an ACL permission gives).
REFUSAL = "Redis refuses the limiter's commands (NOPERM no 'evalsha'). Grant its ACL user ..."


class ScriptedStorage(Storage):
    """A storage whose health is set by the test: ``mode`` ``ok``, ``down`` (outage), ``refused``
    (misconfigured: an outage too), ``error`` (an error reply) or ``broken`` (a RuntimeError, as
    from a bug in a storage).

    When ok it runs a fixed-window count per key (window = the check's period, time from
    ``now_us`` or the wall clock), so allow/deny is real enough to check limits with.
    ``delay`` seconds are slept inside every call (outside any lock).
    """

    scheme = "scripted"

    def __init__(self, mode: Mode = "ok", *, delay: float = 0.0) -> None:
        self.mode: Mode = mode
        self.delay = delay
        self.calls = 0
        self.heartbeats: dict[str, dict[str, float]] = {}
        self.repaired: tuple[str, ...] = ()
        self.closed = False
        self._counts: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()

    def _check_mode(self) -> None:
        with self._lock:
            self.calls += 1
        if self.delay:
            time.sleep(self.delay)
        if self.mode == "down":
            raise StorageUnavailable("scripted outage")
        if self.mode == "refused":
            raise StorageMisconfigured(REFUSAL)
        if self.mode == "error":
            raise StorageResponseError("scripted error reply")
        if self.mode == "broken":
            raise RuntimeError("scripted bug\nwith a second line")

    def evaluate(self, checks: Sequence[Check], *, now_us: int | None = None) -> Evaluation:
        self._check_mode()
        now = now_us if now_us is not None else int(time.time() * 1_000_000)
        with self._lock:
            slots = [(c.key, now // (c.period * 1_000_000)) for c in checks]
            used = [self._counts.get(s, 0) for s in slots]
            allowed = [u + c.cost <= c.limit for u, c in zip(used, checks, strict=True)]
            ok = all(allowed)
            decisions = []
            for slot, u, c, a in zip(slots, used, checks, allowed, strict=True):
                if ok:
                    u += c.cost
                    self._counts[slot] = u
                window_end = (slot[1] + 1) * c.period * 1_000_000
                left = (window_end - now) / 1_000_000
                decisions.append(
                    Decision(a, c.limit, max(0, c.limit - u), left, 0.0 if a else left)
                )
        return Evaluation(tuple(decisions), repaired_keys=self.repaired)

    def ping(self) -> float:
        self._check_mode()
        return 0.0001

    def scan(self, match: str) -> Iterator[str]:
        return iter(())

    def delete(self, keys: Iterable[str]) -> int:
        return 0

    def heartbeat(self, key: str, member: str, ttl: float) -> int:
        self._check_mode()
        with self._lock:
            members = self.heartbeats.setdefault(key, {})
            members[member] = ttl
            return len(members)

    def close(self) -> None:
        self.closed = True


def check(key: str = "ratelimit:{abc}:route:fixed_window", limit: int = 10, period: int = 60,
          cost: int = 1) -> Check:  # fmt: skip
    return Check(key=key, algorithm="fixed_window", limit=limit, period=period, cost=cost)


class Told(Instruments):
    """A metrics sink that keeps what it is told of each storage call: the calls that tell its
    latency (``storage_call``, or ``evaluated`` with its decisions) and the call's outcome."""

    def __init__(self) -> None:
        super().__init__({})
        self.calls: list[str] = []
        self.outcomes: list[str] = []

    def _counter(self, family: str, labels: dict[str, str]) -> Count:
        if family == "storage_latency":
            return lambda seconds: self.outcomes.append(labels["outcome"])
        return lambda amount: None

    def storage_call(self, seconds: float, outcome: str = "ok") -> None:
        self.calls.append("storage_call")
        super().storage_call(seconds, outcome)

    def evaluated(
        self,
        checks: Sequence[Check],
        evaluation: Evaluation,
        *,
        seconds: float | None = None,
        fallback: bool = False,
    ) -> None:
        if seconds is not None:
            self.calls.append("evaluated")
        super().evaluated(checks, evaluation, seconds=seconds, fallback=fallback)
