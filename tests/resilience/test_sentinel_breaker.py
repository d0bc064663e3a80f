"""A breaker per Sentinel-discovered master: after the master is killed and the Sentinels fail
over, the guard moves to the new master's breaker (closed) within a second, instead of waiting
out the old master's reset timeout (30 s of a fake clock that the test never advances that far).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from flask_distlimit.core.decision import Check
from flask_distlimit.resilience.guard import Guard
from flask_distlimit.resilience.guard_core import REDISCOVER_INTERVAL
from flask_distlimit.storage import from_url
from tests.faults import kind_of
from tests.guard_helpers import FakeClock
from tests.servers import SentinelServers

pytestmark = [pytest.mark.redis, pytest.mark.sentinel, pytest.mark.slow]

RESET = 30.0


def kinds(guard: Guard, key: str, times: int) -> list[str]:
    checks = [Check(key, "gcra", 3, 3600)]
    return [kind_of(guard.evaluate(checks)) for _ in range(times)]


def test_the_new_master_is_used_without_waiting_for_the_old_breaker(
    sentinel_factory: Callable[..., SentinelServers],
) -> None:
    group = sentinel_factory(down_after_ms=500, failover_timeout_ms=2000)
    storage = from_url(group.url, timeout=0.2)
    clock = FakeClock()
    guard = Guard(storage, policy="closed", fail_max=1, reset_timeout=RESET, clock=clock)
    try:
        assert kinds(guard, "t:{before}:ip:gcra", 1) == ["allowed"]
        old = group.current_master()
        old.stop()  # kill -9
        assert kinds(guard, "t:{during}:ip:gcra", 2) == ["unavailable"] * 2
        assert guard.breaker.state == "open"
        assert guard.breaker.name.endswith(f"@127.0.0.1:{old.port}")
        new = group.wait_for_failover(old)
        clock.advance(REDISCOVER_INTERVAL)  # a thirtieth of the reset timeout
        assert kinds(guard, "t:{after}:ip:gcra", 4) == ["allowed"] * 3 + ["denied"]
        health = guard.health()
        assert health["breakers"] == {f"127.0.0.1:{new.port}": "closed"}
        assert health["breaker"] == "closed"
    finally:
        storage.close()
