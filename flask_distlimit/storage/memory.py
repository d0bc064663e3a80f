"""``memory://``: the algorithms' Python twins, run in this process.

:class:`MemoryStorage` is thread-safe, takes an injected clock (microseconds since the epoch) and
runs no thread. Memory stays bounded by the keys alive within their TTL, and no call pays for a
sweep of the whole store. Design: docs/design-notes.md, "The in-process store".
"""

from __future__ import annotations

import fnmatch
import heapq
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import cast

from flask_distlimit.core.algorithms import Algorithm
from flask_distlimit.core.decision import NEVER, Check, Decision, Evaluation
from flask_distlimit.engine.common import KEEP_TTL, US, State, Step
from flask_distlimit.engine.registry import REGISTRY
from flask_distlimit.errors import StorageResponseError
from flask_distlimit.storage.base import GiveBack, Storage


def system_clock_us() -> int:
    """Microseconds since the epoch from this machine's clock (the default clock)."""
    return time.time_ns() // 1000


def _validate(checks: Sequence[Check], now: int) -> None:
    if now < 0:
        raise StorageResponseError(f"distlimit: bad time {now!r}: microseconds since the epoch")
    for i, c in enumerate(checks, 1):
        if c.algorithm not in REGISTRY or c.limit < 1 or c.period < 1 or c.cost < 0:
            raise StorageResponseError(
                f"distlimit: bad arguments for check {i} ({c!r}): a known algorithm, "
                "limit >= 1, period >= 1 and cost >= 0 are required"
            )
        refusal = REGISTRY[c.algorithm].refusal(c.limit, c.period * US, now)
        if refusal:
            raise StorageResponseError(f"distlimit: check {i}: {refusal}")


@dataclass(slots=True)
class _Entry:
    algorithm: str
    state: object
    expires: int


class MemoryStorage(Storage):
    """The five algorithms in this process: thread-safe, injected clock, no background thread.

    ``clock`` returns microseconds since the epoch (default: this machine's clock).
    """

    scheme = "memory"

    def __init__(
        self, *, clock: Callable[[], int] = system_clock_us, sweep_batch: int = 32
    ) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._data: dict[str, _Entry] = {}
        self._sweep_batch = sweep_batch
        # (expiry as last queued, key): at most one entry per key, which `_queued` tracks
        self._heap: list[tuple[int, str]] = []
        self._queued: set[str] = set()

    # -- internals (lock held) --

    def _get(self, key: str, now: int) -> _Entry | None:
        entry = self._data.get(key)
        if entry is not None and entry.expires <= now:
            del self._data[key]
            return None
        return entry

    def _tick(self, now: int) -> None:
        """Drop up to ``sweep_batch`` expired keys (a key whose TTL was extended is requeued)."""
        heap = self._heap
        for _ in range(self._sweep_batch):
            if not heap or heap[0][0] > now:
                return
            _, key = heapq.heappop(heap)
            entry = self._data.get(key)
            if entry is not None and entry.expires > now:
                heapq.heappush(heap, (entry.expires, key))
                continue
            self._queued.discard(key)
            self._data.pop(key, None)

    def _set(self, key: str, entry: _Entry) -> None:
        self._data[key] = entry
        if key not in self._queued:
            self._queued.add(key)
            heapq.heappush(self._heap, (entry.expires, key))

    def _put(self, key: str, algorithm: str, state: object, ttl_us: int, now: int) -> None:
        if ttl_us == KEEP_TTL:  # a write into the window the key holds (it holds one)
            self._set(key, _Entry(algorithm, state, self._data[key].expires))
        elif state is None or ttl_us <= 0:
            self._data.pop(key, None)
        else:
            # as the scripts set a TTL: whole ms, rounded up, plus the 1 ms margin against
            # Redis's truncated clock (``expire_in`` in ``lua/common.lua``)
            self._set(key, _Entry(algorithm, state, now + (ttl_us + 1999) // 1000 * 1000))

    def _state(self, check: Check, now: int) -> tuple[State | None, bool]:
        """(the key's state, whether it was unusable and reset: another algorithm's state, or
        state from too far in the future, as the script judges it)."""
        entry = self._get(check.key, now)
        if entry is None:
            return None, False
        spec = REGISTRY[check.algorithm]
        bad = not spec.twin.plausible(entry.state, check.limit, check.period * US, now)
        if bad or spec.empty(entry.state):
            del self._data[check.key]
            return None, bad
        return entry.state, False

    # -- Storage --

    def evaluate(self, checks: Sequence[Check], *, now_us: int | None = None) -> Evaluation:
        return self._run(checks, now_us, refund_=False)

    def refund(self, checks: Sequence[Check], *, now_us: int | None = None) -> Evaluation:
        """Give back the costs of ``checks`` consumed earlier and report each as a peek (the
        script's refund mode)."""
        return self._run(checks, now_us, refund_=True)

    def _run(self, checks: Sequence[Check], now_us: int | None, *, refund_: bool) -> Evaluation:
        with self._lock:
            now = self._clock() if now_us is None else now_us
            _validate(checks, now)
            self._tick(now)
            steps: list[Step] = []
            repaired: list[str] = []
            charged: list[tuple[Check, Step]] = []  # what an admitted request writes
            for check in checks:
                spec = REGISTRY[check.algorithm]
                state, bad = self._state(check, now)
                cost, period = check.cost, check.period * US
                # the refund of a meta check: a request refused elsewhere, a breach (below)
                elsewhere = check.meta and refund_
                if not elsewhere and (refund_ or check.release or check.debt):
                    units = check.token or cost  # a concurrency slot is given back by its token
                    if check.debt:  # charged past the limit: a twin's refund of a negative cost
                        units = -units
                    new, ttl = spec.twin.refund(state, check.limit, period, units, now)
                    if ttl >= 0:
                        self._put(check.key, check.algorithm, new, ttl, now)
                    state, _ = self._state(check, now)
                    cost = 0
                units = (check.token or cost) if cost else 0  # a slot's token: the cost of 1
                s = spec.twin.step(state, check.limit, period, units, now)
                if elsewhere and s.allowed and cost > 0:  # exhausted: no write
                    self._put(check.key, check.algorithm, s.state, s.ttl_us, now)
                if check.release or check.debt or elsewhere:  # never denies
                    s = s._replace(allowed=True, retry_us=0)
                if state is not None and spec.empty(state):
                    self._data.pop(check.key, None)  # pruned to nothing (the log)
                steps.append(s)
                if cost > 0:  # not a release's or a debt's: settled above
                    charged.append((check, s))
                if bad:
                    repaired.append(check.key)
            # A shadow check never denies the request; one that would is not written.
            admitted = all(s.allowed or c.shadow for c, s in zip(checks, steps, strict=True))
            # A meta check is written only for a breach: denied by another check (the script's).
            breach = not admitted and all(
                s.allowed for c, s in zip(checks, steps, strict=True) if c.meta
            )
            if (admitted or breach) and not refund_:
                for check, s in charged:
                    if s.allowed and check.meta == breach:
                        self._put(check.key, check.algorithm, s.state, s.ttl_us, now)
        # A denied request reports every limit as it stands, without the consumption that did
        # not happen (so does a shadow check that would deny).
        return Evaluation(
            tuple(
                Decision(
                    s.allowed or c.shadow,
                    c.limit,
                    s.remaining if admitted and s.allowed and not c.meta else s.remaining_now,
                    (s.reset_us if admitted and s.allowed and not c.meta else s.reset_now_us) / US,
                    NEVER if s.retry_us < 0 else s.retry_us / US,
                    c.shadow and not s.allowed,
                )
                for c, s in zip(checks, steps, strict=True)
            ),
            tuple(repaired),
            now,
        )

    def _give_back(self, back: GiveBack) -> int:
        """As the Redis storages' script (:mod:`.give_back`) does."""
        key, algorithm, period, window, units, now_us = back
        with self._lock:
            now = self._clock() if now_us is None else now_us
            if math.floor(now / (period * US)) != window or units < 1:
                return 0
            entry = self._get(key, now)
            spec = REGISTRY.get(cast("Algorithm", algorithm))
            if entry is None or spec is None or spec.counted is None:
                return 0
            state = entry.state
            if not isinstance(state, spec.counted) or state.window != window or state.used < 1:
                return 0
            taken = min(units, state.used)
            entry.state = state._replace(used=state.used - taken)  # its key's TTL stands
            return taken

    def __len__(self) -> int:
        """Keys held, including expired ones not yet dropped (memory use, for tests)."""
        return max(len(self._data), len(self._heap))

    def expires_at(self, key: str) -> int | None:
        """When ``key`` expires, in us on this storage's clock (``None``: no such key)."""
        with self._lock:
            entry = self._data.get(key)
            return None if entry is None else entry.expires

    def ping(self) -> float:
        return 0.0

    def scan(self, match: str) -> Iterator[str]:
        with self._lock:
            now = self._clock()
            keys = [k for k, e in self._data.items() if e.expires > now]
        return iter([k for k in keys if fnmatch.fnmatchcase(k, match)])

    def delete(self, keys: Iterable[str]) -> int:
        with self._lock:
            now = self._clock()
            found = 0
            for key in keys:
                if self._get(key, now) is not None:
                    del self._data[key]
                    found += 1
            return found

    def heartbeat(self, key: str, member: str, ttl: float) -> int:
        with self._lock:
            now = self._clock()
            self._tick(now)
            entry = self._get(key, now)
            members: dict[str, int] = {}
            if entry is not None and entry.algorithm == "heartbeat":
                members = {m: t for m, t in entry.state.items() if t > now}  # type: ignore[attr-defined]
            members[member] = now + math.ceil(ttl * US)
            self._set(key, _Entry("heartbeat", members, max(members.values())))
            return len(members)
