"""Policy ``local`` keeps its promise while Redis fails only in part.

Several guards stand for the processes of one deployment; they share one real redis-server,
each through a :class:`~tests.faults.FailingStorage` that fails the calls a scenario picks. Time
is a fake clock: the guards' monotonic clock and the storage's ``now_us`` move together, one
request every 5 ms, so every run decides the same.

The traffic is the fault harness's (issue 11): 4 clients, each at 50 requests a second spread
evenly over 3 processes, against ``30/second`` per client, so a process's share is 10.

The promise (docs/failure-modes.md, "The bound"): in every window, the fleet admits at most
1.1 x the limit for each client, and each process at most its share + 1.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable

import pytest
import redis

from flask_distlimit.core.algorithms import Algorithm
from flask_distlimit.core.decision import Check
from flask_distlimit.resilience.guard import Guard
from flask_distlimit.storage.urls import from_url
from tests.faults import FailingStorage, opened
from tests.guard_helpers import FakeClock
from tests.servers import RedisProcess

pytestmark = pytest.mark.redis

EPOCH_US = 1_700_000_000 * 1_000_000  # a whole second: windows start on whole seconds
LIMIT = 30  # per client and second
PERIOD = 1
PROCESSES = 3
SHARE = LIMIT // PROCESSES
CLIENTS = 4
STEP_US = 5_000  # one request every 5 ms: 200 a second, 50 per client
SECONDS = 6
RESET = 0.5  # the breaker's reset timeout, seconds

#: A scenario: ``(process, now_us) -> fails(call number)``, where ``now_us()`` is the test's time.
Scenario = Callable[[int, Callable[[], int]], Callable[[int], bool]]


def _every_other_call(process: int, now_us: Callable[[], int]) -> Callable[[int], bool]:
    return lambda n: n % 2 == 1


def _bursts(process: int, now_us: Callable[[], int]) -> Callable[[int], bool]:
    # Down 300 ms of every 700 ms, for every process at once (one Redis); the breaker opens.
    return lambda n: (now_us() - EPOCH_US) % 700_000 < 300_000


def _flapping(process: int, now_us: Callable[[], int]) -> Callable[[int], bool]:
    return lambda n: (now_us() // 11_000) % 2 == 1  # up 11 ms, down 11 ms


def _half_time_out(process: int, now_us: Callable[[], int]) -> Callable[[int], bool]:
    # Redis answering in 50-150 ms against a 100 ms timeout: about every other call, at random.
    rng = random.Random(process)
    return lambda n: rng.random() < 0.5


def _down_from_mid_window(process: int, now_us: Callable[[], int]) -> Callable[[int], bool]:
    # Healthy, then down from 1.5 s to 4 s: what Redis counted before the outage and what the
    # processes admit locally fall in the same window.
    return lambda n: 1_500_000 <= now_us() - EPOCH_US < 4_000_000


SCENARIOS: dict[str, Scenario] = {
    "every-other-call": _every_other_call,
    "bursts": _bursts,
    "flapping": _flapping,
    "half-time-out": _half_time_out,
    "down-mid-window": _down_from_mid_window,
}


def run_fleet(
    server: RedisProcess, scenario: Scenario, algorithm: Algorithm
) -> tuple[dict[tuple[int, int], list[int]], int, int]:
    """Admissions per (window, client) and process; the count of degraded and of Redis answers."""
    clock = FakeClock(start=0.0)
    now = [EPOCH_US]
    guards = []
    for process in range(PROCESSES):
        inner = from_url(server.url, timeout=1.0)
        opened(inner)
        storage = FailingStorage(inner, scenario(process, lambda: now[0]))
        guards.append(
            Guard(storage, policy="local", instances=PROCESSES, fail_max=5,
                  reset_timeout=RESET, clock=clock)
        )  # fmt: skip
    checks = [
        [Check(f"ratelimit:{{client-{c}}}:r:{algorithm}", algorithm, LIMIT, PERIOD)]
        for c in range(CLIENTS)
    ]
    admitted: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0] * PROCESSES)
    degraded = answered = 0
    for i in range(SECONDS * 1_000_000 // STEP_US):
        now[0] = EPOCH_US + i * STEP_US
        clock.now = i * STEP_US / 1_000_000
        client, process = i % CLIENTS, (i // CLIENTS) % PROCESSES
        outcome = guards[process].evaluate(checks[client], now_us=now[0])
        assert outcome.evaluation is not None and not outcome.unavailable
        if outcome.degraded:
            degraded += 1
        else:
            answered += 1
        if outcome.evaluation.allowed:
            admitted[(now[0] // (PERIOD * 1_000_000), client)][process] += 1
    return admitted, degraded, answered


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["fixed_window", "sliding_window_log"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_local_stays_within_the_limit_fleet_wide_and_per_process(
    redis_server: RedisProcess, redis_client: redis.Redis, name: str, algorithm: Algorithm
) -> None:
    admitted, degraded, answered = run_fleet(redis_server, SCENARIOS[name], algorithm)
    assert degraded > 50 and answered > 50  # the scenario exercised both sides
    fleet = [sum(per_process) for per_process in admitted.values()]
    worst_process = max(max(per_process) for per_process in admitted.values())
    print(  # shown with pytest -s; the figures go to the closing note
        f"\n[{name}, {algorithm}] per client-window: fleet max {max(fleet)} (limit {LIMIT}), "
        f"min {min(fleet)}; per process max {worst_process} (share {SHARE}); "
        f"{degraded} degraded, {answered} from Redis"
    )
    assert max(fleet) <= 1.1 * LIMIT
    assert worst_process <= SHARE + 1
