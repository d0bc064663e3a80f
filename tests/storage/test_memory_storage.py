"""``memory://``: the twin's own guarantees (its agreement with the Lua is in test_vectors and
test_properties)."""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flask_distlimit.core.algorithms import ALGORITHMS, Algorithm
from flask_distlimit.core.decision import NEVER, Check
from flask_distlimit.errors import StorageResponseError
from flask_distlimit.storage.memory import MemoryStorage, system_clock_us
from tests.distlimit_fixtures import EXACT_ALGORITHMS
from tests.engines import NeverExpires
from tests.vectors import T0

S = 1_000_000

limit_st = st.tuples(
    st.sampled_from(ALGORITHMS),
    st.sampled_from([1, 2, 3, 5, 7, 10, 100]),
    st.sampled_from([1, 2, 3, 7, 10, 60]),
)
steps_st = st.lists(
    st.tuples(
        st.one_of(
            st.just(0),
            st.integers(0, 3_000),
            st.integers(0, 3_000_000),
            st.integers(0, 200_000_000),
        ),
        st.integers(0, 12),
    ),
    min_size=1,
    max_size=40,
)


def _checks(limits: Sequence[tuple[Algorithm, int, int]], cost: int) -> list[Check]:
    return [
        Check(f"m:{{t}}:{i}:{a}", a, lim, period, cost if i == 0 else min(cost, 1))
        for i, (a, lim, period) in enumerate(limits)
    ]


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(limits=st.lists(limit_st, min_size=1, max_size=3), steps=steps_st)
def test_expiry_never_changes_a_decision(
    limits: list[tuple[Algorithm, int, int]], steps: list[tuple[int, int]]
) -> None:
    """Dropping a key when its TTL ends decides exactly as keeping it forever: every TTL is long
    enough (and Redis, which expires the same keys at the same TTLs, is safe too)."""
    expiring, forever = MemoryStorage(clock=lambda: 0), NeverExpires(clock=lambda: 0)
    now = T0 + 123_456_789
    for delta, cost in steps:
        now += delta
        checks = _checks(limits, cost)
        assert expiring.evaluate(checks, now_us=now) == forever.evaluate(checks, now_us=now)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(limit=limit_st, steps=steps_st)
def test_ttl_is_the_time_until_the_quota_is_whole(
    limit: tuple[Algorithm, int, int], steps: list[tuple[int, int]]
) -> None:
    """After an admitted request, the key lives reset_after and the 1 ms margin, less than 1 ms
    more (TTLs are whole ms, rounded up, plus 1 ms against Redis's truncated clock; the fixed
    window and the counter set theirs when the window starts, so its rounding was done then; the
    log's is a step of its period longer at most): no shorter, no longer than it needs; and at
    now + reset_after a peek finds the whole quota."""
    storage = MemoryStorage(clock=lambda: 0)
    now = T0 + 987_654_321
    for delta, cost in steps:
        now += delta
        (check,) = _checks([limit], cost)
        result = storage.evaluate([check], now_us=now)
        decision = result.decisions[0]
        if decision.allowed and cost > 0:
            reset_us = round(decision.reset_after * S)
            expires = storage.expires_at(check.key)
            assert expires is not None
            # the log's TTL moves a step of P / 8 (at most 1 s) at a time: up to a step more
            step = (
                min(-(-check.period * S // 8), S) if check.algorithm == "sliding_window_log" else 0
            )
            assert 1000 <= (expires - now) - reset_us < 2000 + step
            # replay a copy later, without side effects (the log prunes its list in place)
            probe = MemoryStorage(clock=lambda: 0)
            probe._data = copy.deepcopy(storage._data)
            whole = probe.evaluate([dataclasses.replace(check, cost=0)], now_us=now + reset_us)
            assert whole.decisions[0].remaining == check.limit


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(limit=limit_st, steps=steps_st)
def test_retry_after_is_the_first_moment_the_request_passes(
    limit: tuple[Algorithm, int, int], steps: list[tuple[int, int]]
) -> None:
    storage = MemoryStorage(clock=lambda: 0)
    now = T0 + 555_555_555
    for delta, cost in steps:
        now += delta
        checks = _checks([limit], cost)
        decision = storage.evaluate(checks, now_us=now).decisions[0]
        if decision.allowed:
            assert decision.retry_after == 0
            continue
        if cost > limit[1]:
            assert decision.retry_after == NEVER
            continue
        retry_us = round(decision.retry_after * S)
        assert retry_us >= 1
        # a microsecond earlier it is still denied (and a denial changes nothing) ...
        assert not storage.evaluate(checks, now_us=now + retry_us - 1).allowed
        # ... and at retry_after it passes
        now += retry_us
        assert storage.evaluate(checks, now_us=now).allowed


@pytest.mark.parametrize("algorithm", sorted(EXACT_ALGORITHMS))
def test_threads_admit_exactly_the_limit(algorithm: Algorithm) -> None:
    storage = MemoryStorage(clock=lambda: T0)
    check = Check(f"race:{{x}}:{algorithm}", algorithm, 100, 86_400)
    admitted = [0] * 8
    start = threading.Barrier(8)

    def hammer(n: int) -> None:
        start.wait()
        for _ in range(40):
            if storage.evaluate([check]).allowed:
                admitted[n] += 1

    threads = [threading.Thread(target=hammer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(admitted) == 100


def test_the_injected_clock_is_used_and_the_default_is_the_system_clock() -> None:
    now = [T0]
    storage = MemoryStorage(clock=lambda: now[0])
    check = Check("c:{x}:1:fixed_window", "fixed_window", 1, 10)
    assert storage.evaluate([check]).allowed
    assert not storage.evaluate([check]).allowed
    now[0] += 10 * S
    assert storage.evaluate([check]).allowed
    before = time.time_ns() // 1000
    assert before <= system_clock_us() <= time.time_ns() // 1000
    assert MemoryStorage().evaluate([check]).allowed


def test_expired_keys_are_swept_so_memory_stays_bounded() -> None:
    now = [T0]
    storage = MemoryStorage(clock=lambda: now[0], sweep_batch=10)
    for n in range(1_000):
        storage.evaluate([Check(f"s:{{{n}}}:1:gcra", "gcra", 10, 1)])
    assert len(storage) == 1_000
    now[0] += 2 * S  # every key is past its TTL; each call drops at most 10 of them
    storage.evaluate([Check("s:{last}:1:gcra", "gcra", 10, 1, cost=0)])
    assert len(storage) == 990
    for _ in range(99):
        storage.evaluate([Check("s:{last}:1:gcra", "gcra", 10, 1, cost=0)])
    assert len(storage) == 0
    assert list(storage.scan("*")) == []


def test_a_hot_key_keeps_one_queue_entry() -> None:
    now = [T0]
    storage = MemoryStorage(clock=lambda: now[0])
    check = Check("hot:{x}:1:token_bucket", "token_bucket", 10**6, 60)
    for _ in range(5_000):
        now[0] += 1_000
        assert storage.evaluate([check]).allowed
    assert len(storage._heap) == 1 and len(storage) == 1


def test_scan_delete_ping() -> None:
    storage = MemoryStorage(clock=lambda: T0)
    keys = ["rl:{a}:1:fixed_window", "rl:{a}:2:token_bucket", "rl:{b}:1:fixed_window"]
    storage.evaluate([Check(k, k.rsplit(":", 1)[1], 5, 60) for k in keys])  # type: ignore[arg-type]
    assert sorted(storage.scan("rl:{a}:*")) == keys[:2]
    assert sorted(storage.scan("*")) == sorted(keys)
    assert storage.delete([keys[0], "rl:{nope}:1:gcra"]) == 1
    assert sorted(storage.scan("*")) == keys[1:]
    assert storage.ping() == 0.0
    assert storage.scripts_loaded()
    assert storage.scheme == "memory"


def test_heartbeat_counts_live_members() -> None:
    now = [T0]
    storage = MemoryStorage(clock=lambda: now[0])
    assert storage.heartbeat("hb", "a", 10) == 1
    assert storage.heartbeat("hb", "b", 10) == 2
    assert storage.heartbeat("hb", "a", 10) == 2
    now[0] += 5 * S
    assert storage.heartbeat("hb", "c", 10) == 3
    now[0] += 6 * S  # b expired (a was renewed at 0, expired too)
    assert storage.heartbeat("hb", "c", 10) == 1
    assert list(storage.scan("hb")) == ["hb"]
    now[0] += 11 * S
    assert list(storage.scan("hb")) == []


def test_a_key_of_another_algorithm_is_reported_repaired_and_starts_fresh() -> None:
    storage = MemoryStorage(clock=lambda: T0)
    storage.evaluate([Check("k", "fixed_window", 1, 60)])
    result = storage.evaluate([Check("k", "gcra", 1, 60)])
    assert result.allowed and result.repaired_keys == ("k",)


@pytest.mark.parametrize(
    "check",
    [
        Check("k", "fixed_window", 0, 60),
        Check("k", "fixed_window", 1, 0),
        Check("k", "fixed_window", 1, 60, cost=-1),
        Check("k", "banana", 1, 60),  # type: ignore[arg-type]
    ],
)
def test_bad_checks_raise_like_the_script(check: Check) -> None:
    with pytest.raises(StorageResponseError, match="bad arguments for check 1"):
        MemoryStorage(clock=lambda: T0).evaluate([check])


def test_refund_gives_units_back() -> None:
    storage = MemoryStorage(clock=lambda: T0)
    checks = [Check("r:{x}:1:token_bucket", "token_bucket", 5, 60, cost=3)]
    assert storage.evaluate(checks).decisions[0].remaining == 2
    assert storage.refund(checks).decisions[0].remaining == 5
    assert storage.evaluate(checks).decisions[0].remaining == 2
