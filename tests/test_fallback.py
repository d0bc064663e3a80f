"""The local fallback: every algorithm of the memory twin, each limit divided by the instances;
where a key's local budget starts (LastKnown) and how long its local count holds."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flask_distlimit.algorithms import ALGORITHMS, EXACT_ALGORITHMS, Algorithm
from flask_distlimit.decision import Check, Decision, Evaluation
from flask_distlimit.fallback import LocalFallback, divided_limit
from flask_distlimit.last_known import LastKnown
from flask_distlimit.storage.memory import MemoryStorage
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
    assert known.remaining(check) is None
    known.record([check], _answer(12, reset_after=20))
    assert known.remaining(check) == 12
    assert known.remaining(Check(check.key, "fixed_window", 40, 60)) is None  # another limit
    clock.advance(19.9)
    assert known.remaining(check) == 12
    clock.advance(0.1)
    assert known.remaining(check) is None  # whole again: the figure says nothing any more


def test_last_known_is_bounded_least_recently_answered_first() -> None:
    known = LastKnown(clock=FakeClock(), max_entries=3)
    checks = [Check(f"ratelimit:{{c{i}}}:r:gcra", "gcra", 30, 60) for i in range(5)]
    for check in checks:
        known.record([check], _answer(7, reset_after=60))
    known.record([checks[2]], _answer(6, reset_after=60))  # answered again: kept longest
    assert len(known) == 3
    assert [known.remaining(c) for c in checks] == [None, None, 6, 7, 7]
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
