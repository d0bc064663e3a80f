"""The local fallback: every algorithm of the memory twin, each limit divided by the instances;
where a key's local budget starts (LastKnown) and how long its local count holds."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flask_distlimit.core.algorithms import ALGORITHMS, Algorithm
from flask_distlimit.core.decision import Check, Decision, Evaluation
from flask_distlimit.resilience.fallback import LocalFallback, divided_limit
from flask_distlimit.resilience.last_known import LastKnown
from flask_distlimit.storage.memory import MemoryStorage
from tests.distlimit_fixtures import EXACT_ALGORITHMS
from tests.guard_helpers import FakeClock

NOW = 1_700_000_040_000_000  # on a whole minute, in microseconds


@given(st.integers(1, 10**9), st.integers(1, 10_000))
def test_divided_limit_is_the_floor_share_at_least_one(limit: int, instances: int) -> None:
    share = divided_limit(limit, instances)
    assert share >= 1
    assert share == max(1, limit // instances)
    assert share * instances <= limit or share == 1


def test_one_instance_keeps_the_limit() -> None:
    assert divided_limit(7, 1) == 7


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_enforces_the_share_in_process(algorithm: Algorithm) -> None:
    fallback = LocalFallback()
    checks = [Check(f"ratelimit:{{c}}:r:{algorithm}", algorithm, 10, 60)]
    evaluations = [fallback.evaluate(checks, instances=3, now_us=NOW) for _ in range(5)]
    assert [e.allowed for e in evaluations] == [True, True, True, False, False]
    assert {e.decisions[0].limit for e in evaluations} == {3}
    assert [e.decisions[0].remaining for e in evaluations[:3]] == [2, 1, 0]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_decides_exactly_as_the_memory_twin_at_the_reduced_limit(algorithm: Algorithm) -> None:
    fallback = LocalFallback()
    twin = MemoryStorage()
    steps = [(NOW + i * 1_700_000, 1 + i % 2) for i in range(40)]
    for now, cost in steps:
        ours = fallback.evaluate(
            [Check("ratelimit:{c}:r:x", algorithm, 20, 10, cost)], instances=4, now_us=now
        )
        theirs = twin.evaluate([Check("ratelimit:{c}:r:x", algorithm, 5, 10, cost)], now_us=now)
        assert ours == theirs


def test_all_or_nothing_across_checks() -> None:
    fallback = LocalFallback()
    tight = Check("ratelimit:{c}:ip:fixed_window", "fixed_window", 2, 60)
    loose = Check("ratelimit:{c}:tenant:fixed_window", "fixed_window", 100, 60)
    results = [fallback.evaluate([tight, loose], instances=2, now_us=NOW) for _ in range(3)]
    assert [r.allowed for r in results] == [True, False, False]
    # The denied requests consumed nothing from the loose limit either.
    assert results[-1].decisions[1].remaining == 49


def test_drop_forgets_every_local_count() -> None:
    fallback = LocalFallback()
    checks = [Check("ratelimit:{c}:r:gcra", "gcra", 2, 60)]
    fallback.evaluate(checks, instances=2, now_us=NOW)
    assert not fallback.evaluate(checks, instances=2, now_us=NOW).allowed
    assert fallback.active
    fallback.drop()
    assert not fallback.active
    assert fallback.evaluate(checks, instances=2, now_us=NOW).allowed


@pytest.mark.parametrize("algorithm", sorted(EXACT_ALGORITHMS))
def test_threads_never_exceed_the_share(algorithm: Algorithm) -> None:
    fallback = LocalFallback()
    checks = [Check(f"ratelimit:{{c}}:r:{algorithm}", algorithm, 40, 3600)]
    allowed: list[bool] = []

    def worker() -> None:
        for _ in range(25):
            allowed.append(fallback.evaluate(checks, instances=4, now_us=NOW).allowed)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert allowed.count(True) == 10


def _answer(remaining: int, reset_after: float, limit: int = 30) -> Evaluation:
    return Evaluation((Decision(True, limit, remaining, reset_after, 0.0),))


def test_last_known_holds_until_the_quota_is_whole_again() -> None:
    clock = FakeClock()
    known = LastKnown(clock=clock)
    check = Check("ratelimit:{c}:r:fixed_window", "fixed_window", 30, 60)
    assert known.reading(check) is None
    known.record([check], _answer(12, reset_after=20))
    assert known.reading(check) == (12, 0.0)
    assert known.reading(Check(check.key, "fixed_window", 40, 60)) is None  # another limit
    clock.advance(19.9)
    assert known.reading(check) == (12, pytest.approx(19.9))
    clock.advance(0.1)
    assert known.reading(check) is None  # whole again: the figure says nothing any more


def test_last_known_is_bounded_least_recently_answered_first() -> None:
    known = LastKnown(clock=FakeClock(), max_entries=3)
    checks = [Check(f"ratelimit:{{c{i}}}:r:gcra", "gcra", 30, 60) for i in range(5)]
    for check in checks:
        known.record([check], _answer(7, reset_after=60))
    known.record([checks[2]], _answer(6, reset_after=60))  # answered again: kept longest
    assert len(known) == 3
    assert [known.reading(c) for c in checks] == [None, None, (6, 0.0), (7, 0.0), (7, 0.0)]
    with pytest.raises(ValueError):
        LastKnown(max_entries=0)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_first_local_decision_starts_from_the_last_known_remaining(
    algorithm: Algorithm,
) -> None:
    clock = FakeClock()
    known = LastKnown(clock=clock)
    fallback = LocalFallback(clock=clock, last_known=known)
    checks = [Check(f"ratelimit:{{c}}:r:{algorithm}", algorithm, 30, 60)]
    known.record(checks, _answer(7, reset_after=30))  # 7 left for 3 processes: 2 here
    allowed = [fallback.evaluate(checks, instances=3, now_us=NOW).allowed for _ in range(4)]
    assert allowed == [True, True, False, False]


def test_charge_counts_what_redis_admits_and_refuses_past_the_share() -> None:
    clock = FakeClock()
    fallback = LocalFallback(clock=clock, settle=10)
    checks = [Check("ratelimit:{c}:r:fixed_window", "fixed_window", 6, 60)]
    redis_says = _answer(5, reset_after=20, limit=6)
    assert fallback.charge(checks, redis_says, instances=2, now_us=NOW) is None  # nothing held
    assert fallback.evaluate(checks, instances=2, now_us=NOW).allowed  # a failure: 1 of 3
    assert fallback.refusal(checks, instances=2, now_us=NOW) is None
    assert fallback.charge(checks, redis_says, instances=2, now_us=NOW) is None  # 2 of 3
    assert fallback.charge(checks, redis_says, instances=2, now_us=NOW) is None  # 3 of 3
    refused = fallback.charge(checks, redis_says, instances=2, now_us=NOW)
    assert refused is not None and not refused.allowed and refused.decisions[0].limit == 3
    peeked = fallback.refusal(checks, instances=2, now_us=NOW)
    assert peeked is not None and not peeked.allowed
    assert peeked.decisions[0].retry_after == peeked.decisions[0].reset_after > 0
    assert fallback.refusal([Check(checks[0].key, "fixed_window", 6, 60, 7)], instances=2,
                            now_us=NOW).decisions[0].impossible  # type: ignore[union-attr]  # fmt: skip


def test_a_forked_child_starts_its_own_local_count() -> None:
    fallback = LocalFallback()
    checks = [Check("ratelimit:{c}:r:gcra", "gcra", 2, 60)]
    fallback.evaluate(checks, instances=2, now_us=NOW)
    assert not fallback.evaluate(checks, instances=2, now_us=NOW).allowed
    fallback._after_fork()
    assert not fallback.active
    assert fallback.evaluate(checks, instances=2, now_us=NOW).allowed


# -- the bound under partial failure (docs/failure-modes.md, "The bound") ----------------------


def _at(clock: FakeClock, seconds: float) -> int:
    """Move the fallback's clock to ``seconds`` after NOW (a whole minute) and answer the
    storage's time then, in microseconds: the two clocks move together."""
    clock.now = 1000.0 + seconds
    return NOW + round(seconds * 1_000_000)


@pytest.mark.parametrize(("age", "admitted"), [(0.0, 2), (6.0, 2), (6.001, 0)])
def test_what_redis_said_is_trusted_for_a_tenth_of_the_period(age: float, admitted: int) -> None:
    clock = FakeClock()
    known = LastKnown(clock=clock)
    fallback = LocalFallback(clock=clock, settle=1, last_known=known)
    checks = [Check("ratelimit:{c}:r:fixed_window", "fixed_window", 30, 60)]
    known.record(checks, _answer(7, reset_after=60))  # 7 left: 7 // 3 = 2 for this process
    assert known.reading(checks[0]) == (7, 0.0)
    now_us = _at(clock, age)
    assert known.reading(checks[0]) == (7, pytest.approx(age))
    allowed = [fallback.evaluate(checks, instances=3, now_us=now_us).allowed for _ in range(3)]
    assert allowed.count(True) == admitted  # older than 6 s: the others may have spent it all


def test_a_stale_key_admits_nothing_here_until_its_quota_is_whole_again() -> None:
    clock = FakeClock()
    known = LastKnown(clock=clock)
    fallback = LocalFallback(clock=clock, settle=1, last_known=known)
    checks = [Check("ratelimit:{c}:r:fixed_window", "fixed_window", 30, 10)]  # share 10 of 3
    _at(clock, 1)
    known.record(checks, _answer(29, reset_after=9))  # early in the window: 29 left
    refused = fallback.evaluate(checks, instances=3, now_us=_at(clock, 3))  # 2 s later: stale
    assert not refused.allowed and refused.decisions[0].retry_after == 7  # the window's end
    assert not fallback.evaluate(checks, instances=3, now_us=_at(clock, 9.9)).allowed
    next_window = [fallback.evaluate(checks, instances=3, now_us=_at(clock, 10)) for _ in range(11)]
    assert [e.allowed for e in next_window] == [True] * 10 + [False]  # a whole share again


def test_a_key_redis_never_answered_here_starts_from_a_whole_share() -> None:
    clock = FakeClock()
    fallback = LocalFallback(clock=clock, last_known=LastKnown(clock=clock))
    checks = [Check("ratelimit:{new}:r:fixed_window", "fixed_window", 30, 60)]
    allowed = [fallback.evaluate(checks, instances=3, now_us=NOW).allowed for _ in range(11)]
    assert allowed == [True] * 10 + [False]


def test_the_first_success_after_a_failure_engages_for_another_reset_timeout() -> None:
    """Redis is back for this process at its first success, but a breaker that opened before
    then may stay open up to a reset timeout longer: count everything here until then."""
    clock = FakeClock()
    fallback = LocalFallback(clock=clock, settle=2)
    failed = [Check("ratelimit:{a}:r:fixed_window", "fixed_window", 100, 60)]
    answered = [Check("ratelimit:{b}:r:fixed_window", "fixed_window", 100, 60)]
    fallback.evaluate(failed, instances=2, now_us=_at(clock, 0))  # engaged until 2
    kept = fallback.charge(answered, _answer(90, 60, 100), instances=2, now_us=_at(clock, 1.5))
    assert kept is None
    _at(clock, 2.5)
    assert fallback.engaged  # until 1.5 + 2
    kept = fallback.charge(answered, _answer(89, 60, 100), instances=2, now_us=_at(clock, 3))
    assert kept is None
    _at(clock, 3.5)
    assert not fallback.engaged  # only the first success after a failure engages


def test_a_success_long_after_the_last_failure_engages_too() -> None:
    """A process that had no request for longer than the settling period after its failure
    (its breaker stayed open) meets Redis again while others may still admit locally."""
    clock = FakeClock()
    fallback = LocalFallback(clock=clock, settle=2)
    checks = [Check("ratelimit:{a}:r:gcra", "gcra", 100, 60)]
    fallback.evaluate(checks, instances=2, now_us=_at(clock, 0))
    kept = fallback.charge(checks, _answer(90, 60, 100), instances=2, now_us=_at(clock, 100))
    assert kept is None
    assert fallback.engaged and fallback.held() == 1


def test_a_key_decided_here_counts_until_the_end_of_the_window_its_engagement_ends_in() -> None:
    """Decided locally 8.5 s into a 10 s window, first success at 9 s: engaged until 11 s, in
    the next window, where a process whose breaker is still open may admit locally: this one
    stays within its share until that window ends (20 s)."""
    clock = FakeClock()
    fallback = LocalFallback(clock=clock, settle=2)
    checks = [Check("ratelimit:{c}:r:fixed_window", "fixed_window", 20, 10)]  # share 10 of 2
    redis_says = _answer(15, reset_after=10, limit=20)
    assert fallback.evaluate(checks, instances=2, now_us=_at(clock, 8.5)).allowed
    assert fallback.charge(checks, redis_says, instances=2, now_us=_at(clock, 9)) is None
    _at(clock, 11)
    assert not fallback.engaged and fallback.held() == 1
    charged = [fallback.charge(checks, redis_says, instances=2, now_us=_at(clock, 12 + i / 100))
               for i in range(11)]  # fmt: skip
    assert [c is None for c in charged] == [True] * 10 + [False]  # its share of the window 10-20
    _at(clock, 19.99)
    assert fallback.active
    assert fallback.charge(checks, redis_says, instances=2, now_us=_at(clock, 20)) is None
    assert not fallback.active  # handed back: Redis alone is exact from this window on


def test_a_sliding_key_decided_here_counts_one_period_after_the_engagement() -> None:
    clock = FakeClock()
    fallback = LocalFallback(clock=clock, settle=2)
    checks = [Check("ratelimit:{c}:r:sliding_window_log", "sliding_window_log", 20, 10)]
    fallback.evaluate(checks, instances=2, now_us=_at(clock, 0))
    fallback.charge(checks, _answer(15, 10, 20), instances=2, now_us=_at(clock, 1))  # until 3
    _at(clock, 12.9)
    assert fallback.held() == 1  # its local admissions may be in Redis's window until 13
    _at(clock, 13)
    assert fallback.held() == 0 and not fallback.active


def test_a_key_only_answered_by_redis_is_handed_back_when_the_engagement_ends() -> None:
    clock = FakeClock()
    fallback = LocalFallback(clock=clock, settle=2)
    failed = [Check("ratelimit:{a}:r:fixed_window", "fixed_window", 20, 10)]
    answered = [Check("ratelimit:{b}:r:fixed_window", "fixed_window", 20, 10)]
    fallback.evaluate(failed, instances=2, now_us=_at(clock, 8.5))
    fallback.charge(answered, _answer(15, 10, 20), instances=2, now_us=_at(clock, 9))
    assert fallback.held() == 2
    _at(clock, 11)
    assert fallback.held() == 1  # {a} counts to the end of the window (20 s), {b} is Redis's
