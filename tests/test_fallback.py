"""The local fallback: every algorithm of the memory twin, each limit divided by the instances."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flask_distlimit.algorithms import ALGORITHMS, EXACT_ALGORITHMS, Algorithm
from flask_distlimit.decision import Check
from flask_distlimit.fallback import LocalFallback, divided_limit
from flask_distlimit.storage.memory import MemoryStorage

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
