"""Property: the Lua scripts on a real Redis and the Python twin decide identically.

Random sequences of (time step, costs, kind: evaluate, refund, release or debt checks) over 1 to 3
limits of any algorithms, with an injected, non-decreasing time. Redis expires keys on its own
clock, not the injected one, so each script call runs in a MULTI with ``PTTL`` (every key the
script left must carry a TTL, after peeks and denials too) and ``PERSIST`` (so no key vanishes
in real time while it still matters in injected time). The twin expires its keys on the injected
clock; that this never changes a decision is proved in ``test_memory_storage.py``.

``PROPERTY_SCALE=10 python -m pytest tests/engine/test_properties.py`` runs ten times as many
examples (by hand, after changing a script or a twin).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flask_distlimit.core.algorithms import ALGORITHMS, Algorithm
from flask_distlimit.core.decision import Check, Evaluation
from flask_distlimit.engine.scripts import SCRIPT_SOURCE, parse_reply, script_args
from flask_distlimit.storage.memory import MemoryStorage
from tests.engines import NeverExpires
from tests.vectors import T0

#: Examples run = the count in each test's settings x this (1 in the suite).
_SCALE = int(os.environ.get("PROPERTY_SCALE", "1"))

Limit = tuple[Algorithm, int, int]  # algorithm, limit, period (s)
Step = tuple[int, list[int], int]  # time step (us), costs, kind (_KINDS)
#: What a step's call is: a refund of its checks, release checks or debt checks (the settlement
#: of a reservation, request/deduction.py), else an evaluation.
_KINDS = {0: "refund", 1: "release", 2: "debt"}

limits_st = st.tuples(
    st.sampled_from(ALGORITHMS),
    st.sampled_from([1, 2, 3, 5, 7, 10, 12, 100, 1000]),
    st.sampled_from([1, 2, 3, 7, 10, 60, 3600]),
)
time_step_st = st.one_of(
    st.just(0),
    st.integers(0, 2_000),
    st.integers(0, 1_500_000),
    st.integers(0, 15_000_000),
    st.integers(0, 4_000_000_000),
)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[Limit], list[Step], int]:
    limits = draw(st.lists(limits_st, min_size=1, max_size=3))
    cost_st = st.one_of(st.integers(0, 3), st.integers(0, 14), st.integers(0, 1001))
    steps = draw(
        st.lists(
            st.tuples(
                time_step_st,
                st.lists(cost_st, min_size=len(limits), max_size=len(limits)),
                st.integers(0, 13),
            ),
            min_size=1,
            max_size=25,
        )
    )
    start = draw(st.integers(0, 10**11))  # anywhere in a day-ish, off any window boundary
    return limits, steps, start


def _checks(limits: Sequence[Limit], costs: Sequence[int], kind: str = "") -> list[Check]:
    return [
        Check(
            f"prop:{{t}}:{i}:{algorithm}", algorithm, limit, period, cost,
            release=kind == "release", debt=kind == "debt",
        )
        for i, ((algorithm, limit, period), cost) in enumerate(zip(limits, costs, strict=True))
    ]  # fmt: skip


@pytest.mark.redis
@settings(
    max_examples=150 * _SCALE,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@pytest.mark.slow
@given(scenario=scenarios())
def test_lua_on_redis_and_the_twin_agree(
    redis_client: redis.Redis, scenario: tuple[list[Limit], list[Step], int]
) -> None:
    limits, steps, start = scenario
    redis_client.flushall()
    script = redis_client.register_script(SCRIPT_SOURCE)
    twin = MemoryStorage(clock=lambda: 0)
    now = T0 + start
    try:
        for n, (delta, costs, code) in enumerate(steps):
            kind = _KINDS.get(code, "")
            refund = kind == "refund"
            now += delta
            checks = _checks(limits, costs, kind)
            keys, args = script_args(checks, now, refund=refund)
            before = [twin.expires_at(key) for key in keys]
            pipe = redis_client.pipeline(transaction=True)
            script(keys, args, client=pipe)
            for key in keys:
                pipe.pttl(key)
            for key in keys:
                pipe.pexpire(key, _PINNED_MS)
            reply, *ttls = pipe.execute()[: 1 + len(keys)]
            lua = parse_reply(reply, checks)
            py: Evaluation = (twin.refund if refund else twin.evaluate)(checks, now_us=now)
            where = f"step {n}: +{delta} us, costs {costs}, {kind or 'evaluate'}"
            assert lua == py, where
            for key, ttl, old in zip(keys, ttls, before, strict=True):
                assert ttl != -1, f"{where}: {key} has no TTL"
                new = twin.expires_at(key)
                if new is not None and new != old:  # written by this call: the same TTL
                    # (less the real time that passed inside the MULTI on a busy machine)
                    expected_ms = (new - now) // 1000
                    assert expected_ms - _SLACK_MS <= ttl <= expected_ms, (where, key, ttl)
    finally:
        redis_client.flushall()


#: Real milliseconds that may pass between the script's PEXPIRE and the PTTL after it.
_SLACK_MS = 200
#: What the test sets every key's TTL to after checking it (longer than any example runs).
_PINNED_MS = 10**10


@pytest.mark.redis
@settings(
    max_examples=100 * _SCALE,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    limits=st.lists(limits_st, min_size=1, max_size=3),
    steps=st.lists(
        st.tuples(
            st.one_of(st.integers(-2_000, 2_000), st.integers(-70_000_000, 70_000_000)),
            st.lists(st.integers(0, 12), min_size=3, max_size=3),
        ),
        min_size=1,
        max_size=25,
    ),
)
@pytest.mark.slow
def test_time_going_backwards_agrees_and_stays_sane(
    redis_client: redis.Redis, limits: list[Limit], steps: list[tuple[int, list[int]]]
) -> None:
    """A clock that jumps back (a failover to a server whose clock is behind) neither breaks the
    script nor makes it and the twin disagree; state more than a period ahead is reset."""
    redis_client.flushall()
    script = redis_client.register_script(SCRIPT_SOURCE)
    twin = NeverExpires(clock=lambda: 0)  # Redis keys are pinned: neither side expires anything
    now = T0 + 10**11
    try:
        for n, (delta, costs) in enumerate(steps):
            now += delta
            checks = _checks(limits, costs[: len(limits)])
            keys, args = script_args(checks, now)
            pipe = redis_client.pipeline(transaction=True)
            script(keys, args, client=pipe)
            for key in keys:
                pipe.pexpire(key, _PINNED_MS)
            lua = parse_reply(pipe.execute()[0], checks)
            assert lua == twin.evaluate(checks, now_us=now), f"step {n}: {delta:+} us, {costs}"
            for d, check in zip(lua.decisions, checks, strict=True):
                assert 0 <= d.remaining <= check.limit
                assert d.reset_after >= 0 and (d.retry_after >= 0 or d.impossible)
    finally:
        redis_client.flushall()


@st.composite
def log_histories(draw: st.DrawFn) -> tuple[int, list[tuple[int, int, int, bool, int]]]:
    """Long histories on one log key: bursts of more entries than one call may remove, clocks
    that jump forward past the window and back, refunds, and a limit that changes. A step is
    (time step in us, limit, cost, refund, how many times the call is repeated at that time)."""
    period = draw(st.sampled_from([1, 10, 60]))
    usual = draw(st.sampled_from([40, 100, 1000]))
    limit_st = st.tuples(st.integers(0, 9), st.sampled_from([3, 40, 1000])).map(
        lambda x: x[1] if x[0] == 0 else usual  # now and then, the limit changes
    )
    steps = draw(
        st.lists(
            st.tuples(
                st.one_of(
                    st.just(0),
                    st.integers(0, 50),
                    st.integers(0, 300_000),
                    st.integers(-3_000_000, 3_000_000),
                    st.integers(0, 2 * period * 1_000_000),
                    st.integers(period * 1_000_000 - 100, period * 1_000_000 + 100),
                ),
                limit_st,
                st.one_of(st.integers(0, 2), st.integers(0, 60)),
                st.integers(0, 5).map(lambda x: x == 0),
                st.sampled_from([1, 1, 2, 5, 40, 90]),
            ),
            min_size=5,
            max_size=40,
        )
    )
    return period, steps


@pytest.mark.redis
@settings(
    max_examples=100 * _SCALE,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@pytest.mark.slow
@given(history=log_histories())
def test_the_log_bounded_per_call_agrees_with_its_twin(
    redis_client: redis.Redis, history: tuple[int, list[tuple[int, int, int, bool, int]]]
) -> None:
    """The log removes every expired entry on each evaluation (from the old end, or after a
    binary search) and at most SWL_BATCH whole entries in a give-back: the script and the twin
    keep the same entries, so they agree after bursts, jumps and refunds, and when the clock
    goes back over entries not yet removed."""
    period, steps = history
    redis_client.flushall()
    script = redis_client.register_script(SCRIPT_SOURCE)
    twin = NeverExpires(clock=lambda: 0)  # Redis keys are pinned: neither side expires anything
    now = T0 + 10**11
    key = "log:{t}:0:sliding_window_log"
    try:
        for n, (delta, limit, cost, refund, repeat) in enumerate(steps):
            now += delta
            checks = [Check(key, "sliding_window_log", limit, period, cost)]
            keys, args = script_args(checks, now, refund=refund)
            for i in range(repeat):
                before = twin.expires_at(key)
                pipe = redis_client.pipeline(transaction=True)
                script(keys, args, client=pipe)
                pipe.pttl(key)
                pipe.pexpire(key, _PINNED_MS)
                reply, ttl = pipe.execute()[:2]
                lua = parse_reply(reply, checks)
                py = (twin.refund if refund else twin.evaluate)(checks, now_us=now)
                where = f"step {n}.{i}: {delta:+} us, limit {limit}, cost {cost}, refund {refund}"
                assert lua == py, where
                assert ttl != -1, f"{where}: no TTL"
                new = twin.expires_at(key)
                if new is not None and new != before:
                    expected_ms = (new - now) // 1000
                    assert expected_ms - _SLACK_MS <= ttl <= expected_ms, (where, ttl)
                assert redis_client.llen(key) == len(twin.state_of(key)), where
    finally:
        redis_client.flushall()
