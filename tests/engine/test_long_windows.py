"""``month`` and ``year`` windows (issue 26), as Flask-Limiter's ``limits`` counts them: a month is
30 days, a year 12 of those (360 days), never a calendar month.

Every algorithm, on the real Lua (a real redis-server) and on its Python twin (the memory storage,
which the local fallback uses too), decides the same integers across a whole window: the limit
admitted, the next refused with a wait that reaches the window's end, and admitted again once
the window has passed (the clock is injected: no test waits). The Redis keys live as long as the
window needs and no longer than the bound every key has (a key outliving its window by more
would hold memory for nothing; one dying early would hand out a fresh quota).
"""

from __future__ import annotations

import zlib

import limits
import pytest
import redis

from flask_distlimit import ALGORITHMS, Algorithm, Rate, parse_rates
from flask_distlimit.core.decision import Check, Decision
from flask_distlimit.resilience.fallback import LocalFallback
from flask_distlimit.storage.memory import MemoryStorage
from tests.engines import ENGINE_PARAMS, Engine, make_engine

MONTH = 30 * 86_400
YEAR = 12 * MONTH
_US = 1_000_000
#: a moment aligned with a year and a month (fixed windows start at multiples of the period)
T0 = (1_800_000_000 // YEAR + 1) * YEAR * _US


def test_month_and_year_are_what_flask_limiters_limits_counts() -> None:
    for text in ("7/month", "7 per month", "7/months", "7/year", "7 per 1 year", "7/2 months"):
        (ours,) = parse_rates(text)
        (theirs,) = [limits.parse(text)]
        assert (ours.amount, ours.period) == (theirs.amount, theirs.get_expiry()), text
    assert parse_rates("1/month;10/year") == (Rate(1, MONTH), Rate(10, YEAR))
    assert str(Rate(5, MONTH)) == "5/month" and str(Rate(5, YEAR)) == "5/year"
    assert str(Rate(5, 2 * MONTH)) == "5/2 months"
    for rate in (Rate(5, MONTH), Rate(5, YEAR), Rate(5, 2 * MONTH), Rate(5, 366 * 86_400)):
        assert parse_rates(str(rate)) == (rate,)


def test_a_period_longer_than_a_leap_year_is_refused_naming_the_units() -> None:
    with pytest.raises(ValueError, match="366 days") as info:
        parse_rates("1/2 years")
    assert "month (30 days)" in str(info.value) and "year (360 days)" in str(info.value)


@pytest.fixture(params=ENGINE_PARAMS)
def engine(request: pytest.FixtureRequest) -> Engine:
    return make_engine(request.param, request)


def _run(engine: Engine, algorithm: Algorithm, period: int, limit: int) -> list[Decision]:
    """Spend ``limit`` at T0, ask once more, ask again a second before that answer's wait ends,
    and once two whole windows have passed (the counter weighs the previous window too)."""
    key = f"long:{{{zlib.crc32(f'{algorithm}{period}'.encode())}}}:{algorithm}"

    def ask(at_us: int) -> Decision:
        (decision,) = engine.evaluate(
            [Check(key, algorithm, limit, period)], now_us=T0 + at_us
        ).decisions
        return decision

    got = [ask(0) for _ in range(limit)]
    refused = ask(1)
    got.append(refused)
    got.append(ask(int(refused.retry_after * _US) - _US))  # a second early: still refused
    got.append(ask(2 * period * _US + _US))
    return got


@pytest.mark.slow
@pytest.mark.parametrize("period", [MONTH, YEAR, 366 * 86_400], ids=["month", "year", "366d"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_counts_a_long_window(
    engine: Engine, algorithm: Algorithm, period: int
) -> None:
    limit = 3
    decisions = _run(engine, algorithm, period, limit)
    assert [d.allowed for d in decisions] == [True] * limit + [False, False, True]
    refused = decisions[limit]
    if algorithm == "fixed_window":  # clock-aligned: the window ends at a multiple of it
        ends_us = (T0 // (period * _US) + 1) * period * _US
        assert refused.retry_after == pytest.approx((ends_us - T0 - 1) / _US, abs=1e-5)
    elif algorithm == "sliding_window_log":  # the oldest entry leaves the window
        assert refused.retry_after == pytest.approx(period, abs=1e-5)
    else:  # a share of the window (refilled), or of two (the counter weighs the last one)
        assert 0 < refused.retry_after <= 2 * period
    assert all(0 <= d.reset_after <= 2 * period + 1 for d in decisions)


#: When the scaled scenario asks (fractions of the period after T0), one unit each.
_AT: tuple[float, ...] = (0, 0, 0, 0, 0.1, 0.5, 0.9, 1.05, 1.3, 1.3, 1.7, 2.5, 2.5, 2.5, 2.5)


def _scaled(engine: Engine, algorithm: Algorithm, period: int) -> list[Decision]:
    key = f"scaled:{{{period}}}:{algorithm}"
    return [
        engine.evaluate(
            [Check(key, algorithm, 4, period)], now_us=T0 + round(at * period * _US)
        ).decisions[0]
        for at in _AT
    ]


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_long_window_decides_as_a_short_one_scaled(engine: Engine, algorithm: Algorithm) -> None:
    """The same calls on a minute and on a month (or a year), at times scaled alike, get the
    same answers, scaled: no precision lost and no cap met on the way to a year."""
    short = _scaled(engine, algorithm, 60)
    assert {d.allowed for d in short} == {True, False}  # the scenario refuses and admits
    for period in (MONTH, YEAR):
        long = _scaled(engine, algorithm, period)
        assert [(d.allowed, d.remaining) for d in long] == [(d.allowed, d.remaining) for d in short]
        scale = period / 60
        # the log keeps same-moment entries a microsecond apart (a few in the short run):
        # scaled, a few times ``scale`` microseconds
        close = 1e-5 * scale
        for d_long, d_short in zip(long, short, strict=True):
            assert d_long.retry_after == pytest.approx(d_short.retry_after * scale, abs=close)
            assert d_long.reset_after == pytest.approx(d_short.reset_after * scale, abs=close)


def _decisions_on(engine: Engine) -> list[list[Decision]]:
    return [_run(engine, a, p, 4) for a in ALGORITHMS for p in (MONTH, YEAR)]


@pytest.mark.redis
def test_the_lua_and_its_python_twins_decide_long_windows_alike(
    redis_client: redis.Redis, request: pytest.FixtureRequest
) -> None:
    assert _decisions_on(make_engine("redis", request)) == _decisions_on(
        make_engine("memory", request)
    )


@pytest.mark.redis
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_long_windows_keys_outlive_every_refusal_and_at_most_two_windows(
    redis_client: redis.Redis, request: pytest.FixtureRequest, algorithm: Algorithm
) -> None:
    """A key that died while its state still refused would hand out a fresh quota; one that
    outlived two windows would hold memory for nothing."""
    engine = make_engine("redis", request)
    for period in (MONTH, YEAR):
        redis_client.flushdb()
        key = f"ttl:{{{period}}}:{algorithm}"
        engine.evaluate([Check(key, algorithm, 5, period, cost=5)], now_us=T0)
        (refused,) = engine.evaluate([Check(key, algorithm, 5, period)], now_us=T0).decisions
        assert not refused.allowed
        stored = redis_client.keys("*")
        assert stored, algorithm
        for name in stored:
            ttl_ms = redis_client.pttl(name)
            assert refused.retry_after * 1000 - 5_000 <= ttl_ms, (name, ttl_ms)
            assert ttl_ms <= 2 * period * 1000 + 5_000, (name, ttl_ms)


@pytest.mark.parametrize("period", [MONTH, YEAR], ids=["month", "year"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_local_fallback_counts_a_long_window_as_its_twin(
    algorithm: Algorithm, period: int
) -> None:
    """Under ``DISTLIMIT_FAILURE_POLICY = "local"`` a month is still a month: the fallback decides
    as the memory twin at the divided limit, over the whole window and after it."""
    fallback = LocalFallback()
    twin = MemoryStorage(clock=lambda: 0)
    key = f"ratelimit:{{c}}:r:{algorithm}"
    for at in _AT:
        now = T0 + round(at * period * _US)
        ours = fallback.evaluate([Check(key, algorithm, 8, period)], instances=2, now_us=now)
        theirs = twin.evaluate([Check(key, algorithm, 4, period)], now_us=now)
        assert ours == theirs, at
