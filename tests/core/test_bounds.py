"""Bounded work per call (issue 10, finding 3): no request the library accepts makes one script
call do more than a bounded amount of work in Redis.

What cannot be bounded is refused when declared or at ``init_app``, with a message naming the
alternative. On a real redis-server, the worst accepted call of each algorithm is held to its
bound in Redis's own accounting (the commands the script runs, from ``INFO commandstats``, and
the members it writes and removes), never to a time: the machine is shared and noisy. The times
are in ``bench/bench_script_time.py`` (``docs/bench/script-time.md``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
from flask import Flask

from flask_distlimit import ConfigurationError, Limiter
from flask_distlimit.core.algorithms import MAX_LIMITS_PER_REQUEST, Algorithm, max_cost
from flask_distlimit.core.decision import Check
from flask_distlimit.core.limits import parse_rates
from flask_distlimit.engine.gcra import MAX_GCRA_RATE
from flask_distlimit.engine.scripts import SCRIPT_SOURCE, script_args
from flask_distlimit.engine.sliding_window_log import MAX_LOG_LIMIT, SWL_BATCH
from tests.distlimit_fixtures import QUIET
from tests.vectors import T0

DAY = 86_400
DAY_US = DAY * 1_000_000
#: The largest amount and period limits.py accepts.
HUGE, YEAR = 10**12, 366 * DAY
COUNTERS: tuple[Algorithm, ...] = ("fixed_window", "sliding_window_counter", "token_bucket", "gcra")
#: Commands the log's script runs per limit at most: evaluating, and in a Cluster refund (which
#: gives back, then evaluates again), while at most SWL_BATCH entries expired since the last
#: call; when more did, a search: an LLEN, a LINDEX per halving of the list (at most 2L
#: entries: L units and as many of debt) and one more.
LOG_COMMANDS, LOG_REFUND_COMMANDS = 6, 9
LOG_SEARCH = 2 + (2 * MAX_LOG_LIMIT).bit_length()


# -- refused when declared ----------------------------------------------------------------------


def test_a_100000_per_day_log_with_cost_100000_is_refused_when_declared() -> None:
    # it wrote 100,000 members in one script call (258 ms in Redis); now refused, with the
    # algorithms that hold such a limit in constant space named
    with pytest.raises(ConfigurationError) as info:
        Limiter().limit("100000/day", algorithm="sliding_window_log", cost=100_000)
    message = str(info.value)
    assert f"up to {MAX_LOG_LIMIT} per window" in message
    assert "sliding_window_counter" in message and "gcra" in message


def test_the_largest_log_limit_and_cost_are_accepted_and_one_more_is_not() -> None:
    Limiter().limit(f"{MAX_LOG_LIMIT}/day", algorithm="sliding_window_log", cost=MAX_LOG_LIMIT)
    with pytest.raises(ConfigurationError, match="sliding_window_counter"):
        Limiter().limit(f"{MAX_LOG_LIMIT + 1}/day", algorithm="sliding_window_log")


def test_a_large_log_limit_through_the_default_algorithm_is_refused_at_init_app() -> None:
    limiter = Limiter()
    app = Flask(__name__)
    app.config.update(QUIET, DISTLIMIT_ALGORITHM="sliding_window_log")

    @app.get("/export")
    @limiter.limit("5000/day")
    def export() -> str:
        return "ok"

    with pytest.raises(ConfigurationError, match="Use sliding_window_counter"):
        limiter.init_app(app)


@pytest.mark.parametrize(
    ("value", "cost", "named"),
    [
        ("10/minute", 11, "10/minute"),
        ("10/second;1000/hour", 50, "10/second"),  # each rate must admit it
        (f"{HUGE}/366 days", HUGE + 1, f"{HUGE}/366 days"),
        ("5/minute", 10**18, "5/minute"),  # passed decoration, then failed in the script
    ],
)
def test_a_cost_above_the_limit_is_refused_when_declared(value: str, cost: int, named: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        Limiter().limit(value, cost=cost)
    message = str(info.value)
    assert f"cost={cost}" in message and f"limit {named}" in message
    assert "never pass" in message and "at most" in message


def test_a_cost_up_to_the_limit_and_a_cost_function_are_accepted() -> None:
    limiter = Limiter()
    limiter.limit("10/second;1000/hour", cost=10)
    limiter.limit("10/second", cost=0)
    limiter.limit("10/second", cost=lambda: 11)  # its value is checked when it answers
    for algorithm in ("gcra", "fixed_window"):
        limiter.limit(f"{MAX_GCRA_RATE}/second", algorithm=algorithm, cost=MAX_GCRA_RATE)


def test_max_cost_is_the_limit_whatever_the_algorithm() -> None:
    for text in ("1/second", f"{MAX_LOG_LIMIT}/day", f"{HUGE}/366 days"):
        (rate,) = parse_rates(text)
        assert max_cost(rate) == rate.amount


def test_more_rates_in_one_declaration_than_a_request_may_carry_are_refused() -> None:
    rates = ";".join(f"{n}/{n} seconds" for n in range(1, MAX_LIMITS_PER_REQUEST + 2))
    with pytest.raises(ConfigurationError) as info:
        Limiter().limit(rates)
    message = str(info.value)
    assert f"make {MAX_LIMITS_PER_REQUEST + 1} limits for one request" in message
    assert f"at most {MAX_LIMITS_PER_REQUEST}" in message
    Limiter().limit(";".join(rates.split(";")[:MAX_LIMITS_PER_REQUEST]))


def _rates(n: int, unit: str) -> str:
    return ";".join(f"{k}/{k} {unit}" for k in range(1, n + 1))


def test_global_and_tier_limits_that_make_too_many_for_a_request_are_refused_at_init_app() -> None:
    app = Flask(__name__)
    app.config.update(
        QUIET,
        DISTLIMIT_GLOBAL_LIMITS=_rates(MAX_LIMITS_PER_REQUEST // 2 + 1, "seconds"),
        DISTLIMIT_TIERS={"anonymous": "", "pro": _rates(MAX_LIMITS_PER_REQUEST // 2, "hours")},
    )
    with pytest.raises(ConfigurationError) as info:
        Limiter(app)
    message = str(info.value)
    assert "DISTLIMIT_GLOBAL_LIMITS" in message and "'pro'" in message
    assert f"make {MAX_LIMITS_PER_REQUEST + 1} limits" in message


def test_a_route_whose_limits_make_too_many_with_the_global_ones_is_refused_at_init_app() -> None:
    limiter = Limiter()
    app = Flask(__name__)
    app.config.update(QUIET, DISTLIMIT_GLOBAL_LIMITS=_rates(2, "seconds"))

    @app.get("/search")
    @limiter.limit(_rates(4, "minutes"))
    @limiter.limit(_rates(MAX_LIMITS_PER_REQUEST - 6 + 1, "hours"))
    def search() -> str:
        return "ok"

    with pytest.raises(ConfigurationError) as info:
        limiter.init_app(app)
    message = str(info.value)
    assert "search" in message and f"make {MAX_LIMITS_PER_REQUEST + 1} limits" in message

    ok = Limiter()
    app = Flask(__name__)
    app.config.update(QUIET, DISTLIMIT_GLOBAL_LIMITS=_rates(2, "seconds"))

    @app.get("/search")
    @ok.limit(_rates(MAX_LIMITS_PER_REQUEST - 2, "minutes"))
    def search_ok() -> str:
        return "ok"

    ok.init_app(app)  # exactly the bound


def test_limits_declared_after_init_app_are_refused_where_they_are_declared() -> None:
    """As docs examples write it, Limiter(app) then the views: the decorator line raises, not
    every request of the app on its first one."""
    app = Flask(__name__)
    app.config.update(
        QUIET,
        DISTLIMIT_GLOBAL_LIMITS=_rates(2, "seconds"),
        DISTLIMIT_ALGORITHM="sliding_window_log",
    )
    limiter = Limiter(app)
    with pytest.raises(ConfigurationError, match=f"make {MAX_LIMITS_PER_REQUEST + 1} limits"):
        limiter.limit(_rates(MAX_LIMITS_PER_REQUEST - 1, "minutes"))(lambda: "ok")
    with pytest.raises(ConfigurationError, match="up to 1000 per window"):
        limiter.limit("5000/hour")(lambda: "ok")  # the app's default algorithm cannot
    with pytest.raises(ConfigurationError, match="lease= on"):
        limiter.limit("100/hour", lease=2)(lambda: "ok")

    @app.get("/search")
    @limiter.limit(_rates(MAX_LIMITS_PER_REQUEST - 3, "minutes"))
    def search() -> str:
        return "ok"

    with pytest.raises(ConfigurationError, match="limits on view"):  # two more on that view
        limiter.limit("1/day;2/day")(search)
    limiter.limit("5000/hour", algorithm="gcra")(lambda: "ok")  # an algorithm of its own
    assert app.test_client().get("/search").status_code == 200  # the refusals left no trace


# -- bounded in Redis's own accounting ----------------------------------------------------------

Run = Callable[..., object]


def _script(client: redis.Redis) -> Run:
    script = client.register_script(SCRIPT_SOURCE)

    def run(
        checks: list[Check],
        now: int,
        *,
        refund: bool = False,
        pipe: redis.client.Pipeline | None = None,
    ) -> object:
        keys, args = script_args(checks, now, refund=refund)
        return script(keys, args, client=pipe)

    script(["warm:{b}"], [f"{T0},0,1,1,1000000,0"])  # loaded before anything is counted
    return run


def _commands(client: redis.Redis, call: Callable[[], object]) -> dict[str, int]:
    """The commands one script call ran (INFO commandstats, reset just before it)."""
    client.config_resetstat()
    call()
    return {
        name.removeprefix("cmdstat_").upper(): int(stats["calls"])
        for name, stats in client.info("commandstats").items()
        if not name.startswith(("cmdstat_evalsha", "cmdstat_config", "cmdstat_info"))
    }


def _fill(run: Run, client: redis.Redis, key: str, costs: list[int], start: int) -> None:
    """One log request per cost, 1 us apart (pipelined)."""
    pipe = client.pipeline(transaction=False)
    for i, cost in enumerate(costs):
        run([Check(key, "sliding_window_log", MAX_LOG_LIMIT, DAY, cost)], start + i, pipe=pipe)
    pipe.execute()


def _log(key: str, cost: int, limit: int = MAX_LOG_LIMIT) -> Check:
    return Check(key, "sliding_window_log", limit, DAY, cost)


@pytest.mark.redis
def test_the_largest_log_request_writes_one_member(redis_client: redis.Redis) -> None:
    run = _script(redis_client)
    key = "b:{x}:log"
    ran = _commands(redis_client, lambda: run([_log(key, MAX_LOG_LIMIT)], T0))
    assert redis_client.llen(key) == 1  # was MAX_LOG_LIMIT members: one per unit
    assert ran.get("LPUSH") == 1 and sum(ran.values()) <= LOG_COMMANDS


@pytest.mark.redis
@pytest.mark.parametrize(
    ("state", "check_cost", "limit", "at", "allowed"),
    [
        ("full", 1, MAX_LOG_LIMIT, MAX_LOG_LIMIT, False),
        ("full", MAX_LOG_LIMIT, MAX_LOG_LIMIT, MAX_LOG_LIMIT, False),
        # half of it expired: removed in one call after a search, a retry among what is left
        ("half expired", MAX_LOG_LIMIT, MAX_LOG_LIMIT, DAY_US + MAX_LOG_LIMIT // 2, False),
        ("half expired", MAX_LOG_LIMIT // 2, MAX_LOG_LIMIT, DAY_US + MAX_LOG_LIMIT // 2, True),
        ("limit lowered to 1", 1, 1, MAX_LOG_LIMIT, False),
    ],
)
def test_a_full_log_is_decided_with_bounded_work(
    redis_client: redis.Redis, state: str, check_cost: int, limit: int, at: int, allowed: bool
) -> None:
    run = _script(redis_client)
    key = "b:{x}:log"
    _fill(run, redis_client, key, [1] * MAX_LOG_LIMIT, T0)  # the most members a log holds
    before = redis_client.llen(key)
    replies: list[object] = []
    ran = _commands(
        redis_client, lambda: replies.append(run([_log(key, check_cost, limit)], T0 + at))
    )
    (reply,) = replies
    assert isinstance(reply, bytes) and reply.split(b",")[1] == (b"1" if allowed else b"0")
    searched = at > DAY_US + SWL_BATCH
    assert sum(ran.values()) <= LOG_COMMANDS + searched * LOG_SEARCH, ran
    assert ran.get("LPUSH", 0) <= 1  # one entry written at most
    expired = max(0, at - DAY_US + 1)  # the entries of T0 .. T0 + at - DAY_US
    assert redis_client.llen(key) == before - expired + allowed  # every expired one removed


@pytest.mark.redis
def test_a_cluster_refund_on_a_busy_log_touches_a_bounded_number_of_members(
    redis_client: redis.Redis,
) -> None:
    run = _script(redis_client)
    key = "b:{x}:log"
    half = MAX_LOG_LIMIT // 2
    # a request of cost L/2, then L/2 requests of cost 1: the newest L/2 units are in L/2 members
    _fill(run, redis_client, key, [half] + [1] * half, T0)
    before = redis_client.llen(key)
    ran = _commands(redis_client, lambda: run([_log(key, half)], T0 + MAX_LOG_LIMIT, refund=True))
    assert sum(ran.values()) <= LOG_REFUND_COMMANDS, ran
    assert 0 < before - redis_client.llen(key) <= SWL_BATCH


@pytest.mark.redis
@pytest.mark.parametrize("algorithm", COUNTERS)
def test_the_counters_at_their_largest_limit_and_cost_run_a_few_commands(
    redis_client: redis.Redis, algorithm: Algorithm
) -> None:
    run = _script(redis_client)
    limit, period = (MAX_GCRA_RATE, 1) if algorithm == "gcra" else (HUGE, YEAR)
    check = Check(f"b:{{x}}:{algorithm}", algorithm, limit, period, limit)
    admitted = _commands(redis_client, lambda: run([check], T0))
    denied = _commands(redis_client, lambda: run([check], T0 + 1))  # spent: the retry's loops
    assert sum(admitted.values()) <= 3 and sum(denied.values()) <= 1, (admitted, denied)


@pytest.mark.redis
def test_the_most_limits_a_request_may_carry_in_their_worst_state_stay_bounded(
    redis_client: redis.Redis,
) -> None:
    run = _script(redis_client)
    keys = [f"b:{{x}}:log{i}" for i in range(MAX_LIMITS_PER_REQUEST)]
    for key in keys:
        _fill(run, redis_client, key, [1] * MAX_LOG_LIMIT, T0)
    checks = [_log(key, MAX_LOG_LIMIT) for key in keys]
    at = T0 + DAY_US + MAX_LOG_LIMIT // 2  # half of each log expired; each denies
    ran = _commands(redis_client, lambda: run(checks, at))
    assert sum(ran.values()) <= (LOG_COMMANDS + LOG_SEARCH) * MAX_LIMITS_PER_REQUEST, ran
    assert "LPUSH" not in ran  # all or nothing: denied, nothing written
    assert all(redis_client.llen(k) == MAX_LOG_LIMIT // 2 - 1 for k in keys)  # expired: gone
