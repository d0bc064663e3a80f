"""The circuit breaker's state machine, on a fake clock (no sleeping for reset timeouts)."""

from __future__ import annotations

import logging
import threading
import time

import pybreaker
import pytest

from flask_distlimit.errors import StorageUnavailable
from flask_distlimit.resilience.breaker import Breaker
from tests.guard_helpers import FakeClock

OUTAGE = StorageUnavailable("connection refused")


def make(fail_max: int = 3, reset_timeout: float = 30.0) -> tuple[Breaker, FakeClock]:
    clock = FakeClock()
    return Breaker(fail_max=fail_max, reset_timeout=reset_timeout, clock=clock), clock


def test_opens_after_fail_max_consecutive_outages() -> None:
    breaker, _ = make(fail_max=3)
    for _ in range(2):
        assert breaker.allow()
        breaker.failure(OUTAGE)
    assert breaker.state == "closed"
    assert breaker.failures == 2
    assert breaker.allow()
    breaker.failure(OUTAGE)
    assert breaker.state == "open"
    assert not breaker.allow()


def test_a_success_resets_the_consecutive_count() -> None:
    breaker, _ = make(fail_max=3)
    breaker.failure(OUTAGE)
    breaker.failure(OUTAGE)
    breaker.success()
    assert breaker.failures == 0
    breaker.failure(OUTAGE)
    breaker.failure(OUTAGE)
    assert breaker.state == "closed"


def test_calm_is_closed_with_no_outage_counted_whoever_moves_the_state() -> None:
    # The guard skips allow() and success() while calm: calm must never be True otherwise.
    breaker, clock = make(fail_max=2, reset_timeout=5)
    assert breaker.calm
    breaker.failure(OUTAGE)
    assert not breaker.calm and breaker.state == "closed"  # allow() and success() matter
    breaker.success()
    assert breaker.calm and breaker.failures == 0
    breaker.failure(OUTAGE)
    breaker.failure(OUTAGE)
    assert not breaker.calm and breaker.state == "open"
    clock.advance(5)
    assert breaker.allow() and not breaker.calm  # the trial
    breaker.success()
    assert breaker.calm and breaker.state == "closed"
    breaker.circuit_breaker.open()  # a change made on the pybreaker breaker itself
    assert not breaker.calm
    breaker.reset()
    assert breaker.calm


def test_half_open_trial_after_reset_timeout_and_success_closes() -> None:
    breaker, clock = make(fail_max=1, reset_timeout=30)
    breaker.failure(OUTAGE)
    clock.advance(29.9)
    assert not breaker.allow()
    clock.advance(0.2)
    assert breaker.allow()  # the trial
    assert breaker.state == "half-open"
    assert not breaker.allow()  # one trial at a time
    breaker.success()
    assert breaker.state == "closed"
    assert breaker.allow()


def test_failed_trial_opens_again_for_a_full_timeout() -> None:
    breaker, clock = make(fail_max=1, reset_timeout=10)
    breaker.failure(OUTAGE)
    clock.advance(10)
    assert breaker.allow()
    breaker.failure(OUTAGE)
    assert breaker.state == "open"
    clock.advance(9.9)
    assert not breaker.allow()
    clock.advance(0.1)
    assert breaker.allow()


def test_only_one_of_many_threads_gets_the_trial() -> None:
    breaker, clock = make(fail_max=1, reset_timeout=1)
    breaker.failure(OUTAGE)
    clock.advance(1)
    barrier = threading.Barrier(8)
    results: list[bool] = []

    def worker() -> None:
        barrier.wait()
        results.append(breaker.allow())

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(True) == 1


def test_a_trial_that_never_reports_is_given_up_after_the_timeout() -> None:
    breaker, clock = make(fail_max=1, reset_timeout=5)
    breaker.failure(OUTAGE)
    clock.advance(5)
    assert breaker.allow()  # this trial's thread dies without reporting
    clock.advance(4)
    assert not breaker.allow()
    clock.advance(1)
    assert breaker.allow()


def test_release_frees_the_trial_slot_without_deciding() -> None:
    breaker, clock = make(fail_max=1, reset_timeout=5)
    breaker.failure(OUTAGE)
    clock.advance(5)
    assert breaker.allow()
    breaker.release()
    assert breaker.state == "half-open"
    assert breaker.allow()


def test_state_lives_in_pybreaker_and_its_listeners_see_changes() -> None:
    breaker, clock = make(fail_max=1, reset_timeout=1)
    seen: list[str] = []

    class Listener(pybreaker.CircuitBreakerListener):
        def state_change(self, cb: object, old: object, new: pybreaker.CircuitBreakerState) -> None:
            seen.append(new.name)

    breaker.circuit_breaker.add_listener(Listener())
    breaker.failure(OUTAGE)
    assert breaker.circuit_breaker.current_state == pybreaker.STATE_OPEN
    clock.advance(1)
    breaker.allow()
    breaker.success()
    assert seen == ["open", "half-open", "closed"]


def test_opening_logs_a_warning_and_closing_an_info(caplog: pytest.LogCaptureFixture) -> None:
    breaker, clock = make(fail_max=2, reset_timeout=1)
    caplog.set_level(logging.INFO, logger="flask_distlimit.breaker")
    breaker.failure(OUTAGE)
    breaker.failure(OUTAGE)
    opened = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(opened) == 1
    assert "opened" in opened[0].getMessage()
    assert "connection refused" in opened[0].getMessage()
    clock.advance(1)
    breaker.allow()
    breaker.success()
    closed = [r for r in caplog.records if "closed" in r.getMessage()]
    assert [r.levelno for r in closed] == [logging.INFO]
    assert "after 2 consecutive failure(s)" in opened[0].getMessage()
    breaker.failure(OUTAGE)
    breaker.failure(OUTAGE)
    clock.advance(1)
    breaker.allow()
    breaker.failure(OUTAGE)  # its one trial: not two failures in a row
    again = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING][-1]
    assert "after its trial call failed: circuit breaker" in again


def test_on_change_hook_gets_every_transition() -> None:
    changes: list[str] = []
    clock = FakeClock()
    breaker = Breaker(fail_max=1, reset_timeout=1, clock=clock, on_change=changes.append)
    breaker.failure(OUTAGE)
    clock.advance(1)
    breaker.allow()
    breaker.failure(OUTAGE)
    clock.advance(1)
    breaker.allow()
    breaker.success()
    assert changes == ["open", "half-open", "open", "half-open", "closed"]


def test_reset_closes_and_forgets() -> None:
    breaker, _ = make(fail_max=1)
    breaker.failure(OUTAGE)
    breaker.reset()
    assert breaker.state == "closed"
    assert breaker.failures == 0


@pytest.mark.parametrize("bad", [{"fail_max": 0}, {"reset_timeout": -1}])
def test_rejects_nonsense_settings(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Breaker(**bad)  # type: ignore[arg-type]


def test_open_breaker_answers_in_microseconds() -> None:
    breaker, _ = make(fail_max=1, reset_timeout=60)
    breaker.failure(OUTAGE)
    n = 100_000
    started = time.perf_counter()
    for _ in range(n):
        breaker.allow()
    per_call = (time.perf_counter() - started) / n
    # Typically ~0.3 us here; the bound is loose for a noisy shared machine.
    assert per_call < 20e-6


def test_calls_overlap_outside_the_breaker_lock_unlike_pybreaker_call() -> None:
    """Two threads each blocked 100 ms in a protected call finish in ~100 ms, not ~200 ms."""
    block = 0.1
    breaker, _ = make()

    def ours() -> None:
        assert breaker.allow()
        time.sleep(block)
        breaker.success()

    cb = pybreaker.CircuitBreaker()

    def pybreakers_call() -> None:
        cb.call(time.sleep, block)

    def elapsed(fn: object, threads: int) -> float:
        ts = [threading.Thread(target=fn) for _ in range(threads)]  # type: ignore[arg-type]
        started = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return time.perf_counter() - started

    single = elapsed(ours, 1)
    assert elapsed(ours, 2) < 1.6 * single
    # The same measurement detects serialization: pybreaker's call() holds its lock throughout.
    assert elapsed(pybreakers_call, 2) >= 2 * block
