"""The local fallback's memory is bounded in every fault (issue 24, finding 5 and item 5): it
forgets a key once its local count has expired (and, for a key decided here, once the window
that contains two settling periods after its last decision has ended), so an outage of any
length holds the keys of its last minutes, never every identity it met.

The outage is injected in front of a real redis-server (:class:`tests.faults.FailingStorage`);
100,000 identities log in once each, 100 a second on a fake clock. docs/failure-modes.md
("Memory") states the bound; ``bench/fallback_memory.py`` measures the bytes per key.
"""

from __future__ import annotations

import pytest

from flask_distlimit.core.decision import Check
from flask_distlimit.resilience.guard import Guard
from flask_distlimit.storage.redis import RedisStorage
from tests.distlimit_fixtures import redis_storage
from tests.faults import FailingStorage, Switch
from tests.guard_helpers import FakeClock

__all__ = ["redis_storage"]  # fixtures used below

RESET_TIMEOUT = 30.0
PERIOD = 60
RATE = 100  # new identities a second


def _login(i: int) -> list[Check]:
    key = f"ratelimit:{{user-{i:06d}}}:r:login:5/60:fixed_window"
    return [Check(key, "fixed_window", 5, PERIOD)]


@pytest.mark.slow
def test_an_outage_holds_the_keys_of_its_last_minutes_not_every_identity(
    redis_storage: RedisStorage,
) -> None:
    clock = FakeClock(1_700_000_040.0)
    switch = Switch(down=True)
    guard = Guard(
        FailingStorage(redis_storage, switch),
        policy="local",
        clock=clock,
        reset_timeout=RESET_TIMEOUT,
    )
    # decided here in the last 2 x 30 s, or within a window that ends by then: <= 2 minutes
    live = RATE * (2 * RESET_TIMEOUT + PERIOD)
    most_held = 0
    for i in range(100_000):
        clock.advance(1 / RATE)
        outcome = guard.evaluate(_login(i), now_us=round(clock() * 1_000_000))
        assert outcome.degraded and outcome.evaluation is not None
        assert outcome.evaluation.allowed  # each identity's first login: within its share
        if i % 5_000 == 4_999:
            held = guard.fallback.held()
            most_held = max(most_held, held)
            assert held <= live, (i, held)  # before: every identity of the outage (i + 1)
    assert most_held >= RATE * 2 * RESET_TIMEOUT  # the recent ones are held
    switch.down = False  # Redis is back: everything is handed back, the store dropped
    clock.advance(RESET_TIMEOUT + 1)
    for i in range(3):
        clock.advance(RESET_TIMEOUT + PERIOD)
        assert not guard.evaluate(_login(i), now_us=round(clock() * 1_000_000)).degraded
    assert guard.health()["fallback_held_keys"] == 0
    assert not guard.fallback.holding
