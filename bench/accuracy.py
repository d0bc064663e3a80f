"""Accuracy of the sliding window counter against the exact sliding window log.

    python bench/accuracy.py                    # memory:// twin, injected clock: ~2 minutes
    python bench/accuracy.py --confirm-redis    # also replays a sample on a private redis-server

Each scenario generates the requests of many independent clients (seeded, deterministic) against
one limit of L units per W seconds and drives ``MemoryStorage`` -- the in-process twin that decides
exactly as the Lua scripts do -- with the request times injected (``now_us``), so an hour of traffic
runs in seconds and every run gives the same numbers.

For every request the counter's decision is compared with the exact rule applied to the same
history: "allow when the units the counter actually admitted in the sliding window (t - W, t], plus
this request, stay within L". A request the counter allowed and the exact rule would have denied is
*wrongly allowed*; the reverse is *wrongly denied*. Both are reported as a percentage of all
requests, with the worst overshoot: the most units the counter admitted in any window of W seconds
for one client, over L. The same traffic also runs through the sliding window log itself
(``memory://``), which must never overshoot.

``--confirm-redis`` replays the first clients of every scenario against a real redis-server (the
Lua scripts, same injected times) and checks that every decision is identical to the twin's.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from flask_distlimit.core.decision import Check
from flask_distlimit.declare.keys import limit_key
from flask_distlimit.identity.digests import IdentityTags, tag_secret
from flask_distlimit.storage.base import Storage
from flask_distlimit.storage.memory import MemoryStorage

#: Keys need well-formed tags only: any fixed digest key will do.
TAGS = IdentityTags(tag_secret(b"accuracy"))

ROOT = Path(__file__).resolve().parent.parent

US = 1_000_000
#: Windows start at multiples of W since the epoch; start well inside one.
T0_US = 1_700_000_040 * US

Traffic = Callable[[random.Random, int, int, int], list[int]]


def poisson(rate_factor: float) -> Traffic:
    """Independent arrivals at ``rate_factor`` times the limit's rate."""

    def generate(rng: random.Random, limit: int, window: int, duration: int) -> list[int]:
        rate = rate_factor * limit / window  # requests per second
        t, out = rng.uniform(0, window), []
        while t < duration:
            out.append(int(t * US))
            t += rng.expovariate(rate)
        return out

    return generate


def bursty(rate_factor: float) -> Traffic:
    """On/off traffic: bursts of L/5 .. L requests 20 ms apart, exponential gaps between them,
    averaging ``rate_factor`` times the limit's rate."""

    def generate(rng: random.Random, limit: int, window: int, duration: int) -> list[int]:
        mean_burst = 0.6 * limit
        gap = mean_burst / (rate_factor * limit / window)  # seconds between burst starts
        t, out = rng.uniform(0, window), []
        while t < duration:
            size = rng.randint(max(1, limit // 5), limit)
            for i in range(size):
                out.append(int((t + 0.02 * i) * US))
            t += rng.expovariate(1 / gap)
        return sorted(x for x in out if x < duration * US)

    return generate


def boundary_attack(rng: random.Random, limit: int, window: int, duration: int) -> list[int]:
    """The counter's worst case: L requests in the last second of every other window (they stay
    in the true sliding window, but the counter discounts them as the next window goes on), then
    a retry every W / (4L) seconds through the following window."""
    out: list[int] = []
    start = 0
    while start + 2 * window <= duration:
        end = start + window
        out += [int((end - 1 + i / limit) * US) for i in range(limit)]
        step = window / (4 * limit)
        out += [int((end + k * step) * US) for k in range(int(window / step))]
        start += 2 * window
    return out


def mixed(rng: random.Random, limit: int, window: int, duration: int) -> list[int]:
    """A realistic population: 97% of clients well under the limit (0.05x to 0.5x), 3% abusive
    (2x to 5x), each with Poisson arrivals -- the kind of traffic Cloudflare measured."""
    factor = rng.uniform(2.0, 5.0) if rng.random() < 0.03 else rng.uniform(0.05, 0.5)
    return poisson(factor)(rng, limit, window, duration)


SCENARIOS: dict[str, Traffic] = {
    "mixed: 97% under the limit, 3% at 2-5x": mixed,
    "uniform, 0.8x the limit": poisson(0.8),
    "uniform, 1x": poisson(1.0),
    "uniform, 1.5x": poisson(1.5),
    "uniform, 3x": poisson(3.0),
    "bursty, 1x": bursty(1.0),
    "bursty, 2x": bursty(2.0),
    "boundary attack": boundary_attack,
}


@dataclass
class Tally:
    requests: int = 0
    allowed: int = 0
    wrongly_allowed: int = 0
    wrongly_denied: int = 0
    rate_error: float = 0.0  # sum over requests of |estimate - true count| / L
    worst_window: int = 0  # most units the counter admitted in one window of W, any client
    log_allowed: int = 0
    log_worst_window: int = 0

    HEADER = (
        "| traffic | requests | allowed: counter | allowed: log | wrongly allowed | "
        "wrongly denied | mean rate error | worst window / L: counter | log |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )

    def merge(self, other: Tally) -> None:
        for name in (
            "requests",
            "allowed",
            "wrongly_allowed",
            "wrongly_denied",
            "rate_error",
            "log_allowed",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.worst_window = max(self.worst_window, other.worst_window)
        self.log_worst_window = max(self.log_worst_window, other.log_worst_window)

    def row(self, name: str, limit: int) -> str:
        pct = 100 / max(1, self.requests)
        return (
            f"| {name} | {self.requests:,} | {self.allowed * pct:.2f}% | "
            f"{self.log_allowed * pct:.2f}% | {self.wrongly_allowed * pct:.3f}% | "
            f"{self.wrongly_denied * pct:.3f}% | {self.rate_error * pct:.2f}% | "
            f"{self.worst_window / limit:.2f} | {self.log_worst_window / limit:.2f} |"
        )


def max_in_window(times: list[int], window_us: int) -> int:
    """Most timestamps inside any half-open interval (t - W, t]."""
    best = 0
    for i, t in enumerate(times):
        j = bisect.bisect_right(times, t - window_us)
        best = max(best, i - j + 1)
    return best


def decide(
    storage: Storage, key: str, algorithm: str, limit: int, window: int, times: list[int]
) -> Iterator[bool]:
    for t in times:
        check = Check(key, algorithm, limit, window, 1)  # type: ignore[arg-type]
        yield storage.evaluate([check], now_us=T0_US + t).allowed


def run_client(
    storage: Storage, client: str, limit: int, window: int, times: list[int], tally: Tally
) -> list[bool]:
    window_us = window * US
    counter_key = limit_key("accuracy", client, "limit", "sliding_window_counter", TAGS)
    log_key = limit_key("accuracy", client, "limit", "sliding_window_log", TAGS)
    admitted: collections.deque[int] = collections.deque()  # the counter's admitted times
    admitted_all: list[int] = []
    per_window: collections.Counter[int] = collections.Counter()  # admitted per fixed window
    decisions = list(decide(storage, counter_key, "sliding_window_counter", limit, window, times))
    for t, allowed in zip(times, decisions, strict=True):
        while admitted and admitted[0] <= t - window_us:
            admitted.popleft()
        exact = len(admitted) + 1 <= limit
        k, elapsed = divmod(T0_US + t, window_us)
        estimate = per_window[k - 1] * (window_us - elapsed) / window_us + per_window[k]
        tally.rate_error += abs(estimate - len(admitted)) / limit
        tally.requests += 1
        if allowed:
            tally.allowed += 1
            admitted.append(t)
            admitted_all.append(t)
            per_window[k] += 1
            if not exact:
                tally.wrongly_allowed += 1
        elif exact:
            tally.wrongly_denied += 1
    tally.worst_window = max(tally.worst_window, max_in_window(admitted_all, window_us))
    log = list(decide(storage, log_key, "sliding_window_log", limit, window, times))
    log_times = [t for t, ok in zip(times, log, strict=True) if ok]
    tally.log_allowed += len(log_times)
    tally.log_worst_window = max(tally.log_worst_window, max_in_window(log_times, window_us))
    return decisions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=100, help="L, units per window (100)")
    parser.add_argument("--window", type=int, default=60, help="W, seconds (60)")
    parser.add_argument("--clients", type=int, default=200, help="clients per scenario (200)")
    parser.add_argument("--windows", type=int, default=20, help="windows of traffic each (20)")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument(
        "--confirm-redis",
        action="store_true",
        help="replay a sample on a private redis-server and compare decisions",
    )
    parser.add_argument("--sample", type=int, default=5, help="clients replayed on Redis (5)")
    args = parser.parse_args(argv)

    limit, window, duration = args.limit, args.window, args.window * args.windows
    redis_storage = server = None
    if args.confirm_redis:
        from flask_distlimit.storage.urls import from_url

        sys.path.insert(0, str(ROOT))  # tests.servers starts and stops redis-server by PID
        from tests.servers import start_redis

        server = start_redis()
        redis_storage = from_url(server.url, timeout=2.0)
    started = time.perf_counter()
    print(
        f"Limit {limit} per {window} s, {args.clients} clients x {args.windows} windows of "
        f"traffic per scenario, seed {args.seed}.\n"
    )
    print(Tally.HEADER)
    compared = mismatched = 0
    try:
        for name, traffic in SCENARIOS.items():
            storage = MemoryStorage()
            tally, under, over = Tally(), Tally(), Tally()
            rng = random.Random(f"{args.seed}:{name}")
            for c in range(args.clients):
                times = traffic(rng, limit, window, duration)
                part = under if len(times) <= limit * args.windows else over
                decisions = run_client(storage, f"{name}:{c}", limit, window, times, part)
                if redis_storage is not None and c < args.sample:
                    key = limit_key(
                        "accuracy", f"{name}:{c}", "limit", "sliding_window_counter", TAGS
                    )
                    on_redis = list(
                        decide(redis_storage, key, "sliding_window_counter", limit, window, times)
                    )
                    compared += len(times)
                    mismatched += sum(a != b for a, b in zip(decisions, on_redis, strict=True))
            tally.merge(under)
            tally.merge(over)
            print(tally.row(name, limit), flush=True)
            if name.startswith("mixed"):
                print(under.row("... its clients under the limit", limit))
                print(over.row("... its clients over the limit", limit), flush=True)
    finally:
        if redis_storage is not None:
            redis_storage.close()
        if server is not None:
            server.stop()
    print(f"\n({time.perf_counter() - started:.1f} s)")
    if redis_storage is not None:
        print(
            f"Redis confirmation: {compared:,} decisions replayed on redis-server, "
            f"{mismatched} differ from the memory twin."
        )
        return 1 if mismatched else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
