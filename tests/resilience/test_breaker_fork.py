"""Breaker._after_fork on pybreaker's public API: a child gets a new pybreaker breaker (its own
lock) on the same state storage and listeners, so the state and the hooks carry over."""

from __future__ import annotations

from flask_distlimit.errors import StorageUnavailable
from flask_distlimit.resilience.breaker import Breaker, BreakerState


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_forked_breaker_keeps_its_state_counter_and_listeners() -> None:
    clock = FakeClock()
    changes: list[BreakerState] = []
    breaker = Breaker(fail_max=2, reset_timeout=5, clock=clock, on_change=changes.append)
    breaker.failure(StorageUnavailable("down"))
    parent = breaker.circuit_breaker
    breaker._after_fork()
    assert breaker.circuit_breaker is not parent  # a new pybreaker breaker, a new lock
    assert breaker.failures == 1 and breaker.state == "closed"
    breaker.failure(StorageUnavailable("down"))
    assert breaker.state == "open" and changes == ["open"]  # the listener came along
    breaker._after_fork()
    assert breaker.state == "open" and not breaker.allow()
    clock.now += 5
    assert breaker.allow()  # the trial
    breaker.success()
    assert breaker.state == "closed"
    assert changes == ["open", "half-open", "closed"]
    assert breaker.circuit_breaker.fail_max == 2 and breaker.circuit_breaker.reset_timeout == 5
