"""The script contract on a real Redis: wire layout, one round trip, garbage keys repaired,
bad arguments refused, large numbers."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import pytest
import redis

from flask_distlimit.core.algorithms import ALGORITHMS, Algorithm
from flask_distlimit.core.decision import NEVER, Check, Decision, Evaluation
from flask_distlimit.engine.scripts import SCRIPT_SOURCE, parse_reply, script_args
from flask_distlimit.engine.sliding_window_log import SWL_BATCH
from flask_distlimit.errors import StorageResponseError
from flask_distlimit.storage.memory import MemoryStorage
from flask_distlimit.storage.redis import RedisStorage
from tests.vectors import T0

pytestmark = pytest.mark.redis


def test_script_args_layout() -> None:
    checks = [
        Check("a", "fixed_window", 10, 60, 1),
        Check("b", "gcra", 5, 1, 0),
    ]
    # one ARGV string: now, mode, then algorithm, limit, period (us), cost per check
    assert script_args(checks) == (["a", "b"], ["-1,0,1,10,60000000,1,5,5,1000000,0"])
    assert script_args(checks, 123, refund=True) == (
        ["a", "b"],
        ["123,1,1,10,60000000,1,5,5,1000000,0"],
    )


def test_parse_reply() -> None:
    checks = [Check("a", "fixed_window", 10, 60), Check("b", "gcra", 5, 1, 9)]
    good = f"{T0},1,10,9,60000000,0,0,0,5,5,0,-1,1"
    expected = Evaluation(
        (Decision(True, 10, 9, 60.0, 0.0), Decision(False, 5, 5, 0.0, NEVER)), ("b",)
    )
    assert parse_reply(good.encode(), checks) == expected
    assert parse_reply(good, checks) == expected  # a client with decode_responses=True
    assert expected.decisions[1].impossible
    # exact: integers above 2^53 survive (no float on the way)
    big = parse_reply(f"{2**60},1,{2**60 + 1},0,0,0,0".encode(), checks[:1])
    assert big.decisions[0].limit == 2**60 + 1
    for bad in (
        None,
        b"OK",
        b"",
        [T0, 1, 10, 9, 60_000_000, 0, 0, 0, 5, 5, 0, -1, 1],  # the old array reply
        f"{T0},1,10".encode(),  # too short
        (good + ",0").encode(),  # too long
        good.replace(",9,", ",x,").encode(),  # not a number
        good.replace(",9,", ",9.5,").encode(),  # not an integer
        good.replace(",9,", ",,").encode(),  # an empty field
        good.replace(",9,", ", 9,").encode(),  # int() would accept it; the contract does not
        good.replace(",9,", ",+9,").encode(),
        good.replace(",9,", ",9_0,").encode(),
        (good + ",").encode(),
        T0,
        # integers of hundreds of digits: no time in seconds as a float (not OverflowError)
        good.replace(",60000000,", f",{'9' * 320},").encode(),  # reset_after
        good.replace(",-1,", f",{'9' * 320},").encode(),  # retry_after
        bytearray(good.encode()),
        "\u0661" + good,  # a non-ASCII digit (ARABIC-INDIC ONE) int() would read
        redis.ResponseError("ERR garbage"),  # an error reply handed over, not raised
    ):
        with pytest.raises(StorageResponseError, match="SCRIPT FLUSH"):
            parse_reply(bad, checks)
    huge = "9" * 320
    for bad in (  # the one-check reply, read apart
        f"{T0},1,10,9,{huge},0,0".encode(),
        f"{T0},1,10,9,0,{huge},0".encode(),
        f"{T0},1,10,9,0,{'9' * 5000},0".encode(),  # past int()'s digit limit
        f"{T0},1,10,9,0,0".encode(),
    ):
        with pytest.raises(StorageResponseError, match="SCRIPT FLUSH"):
            parse_reply(bad, checks[:1])


class CountingRedis(redis.Redis):
    """Counts the commands the client sends (each one a round trip)."""

    sent = 0

    def execute_command(self, *args: Any, **options: Any) -> Any:
        type(self).sent += 1
        return super().execute_command(*args, **options)  # type: ignore[no-untyped-call]


def test_one_round_trip_whatever_the_number_of_limits(redis_client: redis.Redis) -> None:
    port = redis_client.connection_pool.connection_kwargs["port"]
    client = CountingRedis(host="127.0.0.1", port=port)
    storage = RedisStorage(client)
    checks = [Check(f"rt:{{x}}:{i}:{a}", a, 10, 60) for i, a in enumerate(ALGORITHMS)]
    storage.evaluate(checks[:1])  # loads the script (NOSCRIPT, then SCRIPT LOAD once)
    redis_client.config_resetstat()
    CountingRedis.sent = 0
    for n in (1, 3, 5):
        storage.evaluate(checks[:n])
    assert CountingRedis.sent == 3
    assert redis_client.info("commandstats")["cmdstat_evalsha"]["calls"] == 3
    client.close()


# (algorithm, how to spoil the key) -> the key must come back repaired, fresh, with a TTL
GARBAGE: list[tuple[Algorithm, Callable[[redis.Redis, str], object]]] = [
    ("fixed_window", lambda r, k: r.set(k, "x")),
    ("fixed_window", lambda r, k: r.hset(k, mapping={"w": "abc", "n": "1"})),
    ("fixed_window", lambda r, k: r.hset(k, mapping={"w": "1", "n": "nan"})),
    ("fixed_window", lambda r, k: r.hset(k, mapping={"w": "1", "n": "1e300"})),
    ("fixed_window", lambda r, k: r.hset(k, mapping={"w": str(10**12), "n": "1"})),  # future
    ("fixed_window", lambda r, k: r.hset(k, mapping={"w": "1.5", "n": "-1"})),
    ("sliding_window_log", lambda r, k: r.hset(k, "a", "b")),
    ("sliding_window_log", lambda r, k: r.lpush(k, "x")),
    ("sliding_window_log", lambda r, k: r.lpush(k, f"{T0}:0:1e3")),
    ("sliding_window_log", lambda r, k: r.lpush(k, f"{T0 + 10**12}:0:1")),  # far in the future
    ("sliding_window_log", lambda r, k: r.lpush(k, f"{T0 - 5}:0:1", "junk")),
    # a log written by a version that kept a sorted set: one member per request, by its time
    ("sliding_window_log", lambda r, k: r.zadd(k, {"0:1": T0 - 5, "1:2": T0 - 4})),
    ("sliding_window_counter", lambda r, k: r.rpush(k, "x")),
    ("sliding_window_counter", lambda r, k: r.hset(k, mapping={"w": "1", "c": "x", "p": "0"})),
    ("sliding_window_counter", lambda r, k: r.hset(k, "c", "inf")),
    ("token_bucket", lambda r, k: r.sadd(k, "x")),
    ("token_bucket", lambda r, k: r.hset(k, mapping={"t": "nan", "s": "1"})),
    ("token_bucket", lambda r, k: r.hset(k, mapping={"t": "-1e9", "s": "1"})),  # past any debt
    ("token_bucket", lambda r, k: r.hset(k, mapping={"t": "1", "s": "9e18"})),
    ("gcra", lambda r, k: r.hset(k, "a", "b")),
    ("gcra", lambda r, k: r.set(k, "banana")),
    ("gcra", lambda r, k: r.set(k, "nan")),
    ("gcra", lambda r, k: r.set(k, "-inf")),
    ("gcra", lambda r, k: r.set(k, "1e300")),
]


@pytest.mark.parametrize(("algorithm", "spoil"), GARBAGE)
def test_garbage_is_repaired_and_reported(
    redis_client: redis.Redis, algorithm: Algorithm, spoil: Callable[[redis.Redis, str], object]
) -> None:
    storage = RedisStorage(redis_client)
    key = f"g:{{x}}:1:{algorithm}"
    other = Check("g:{x}:2:fixed_window", "fixed_window", 1, 60)
    spoil(redis_client, key)  # no TTL either
    check = Check(key, algorithm, 5, 60, cost=2)
    # denied by the other limit: the garbage key is still repaired (deleted) and reported
    storage.evaluate([other], now_us=T0)
    denied = storage.evaluate([check, other], now_us=T0)
    assert not denied.allowed and denied.repaired_keys == (key,)
    assert denied.decisions[0] == Decision(True, 5, 5, 0.0, 0.0)
    assert redis_client.exists(key) == 0
    # spoiled again, then admitted: fresh state, written with a TTL
    spoil(redis_client, key)
    admitted = storage.evaluate([check], now_us=T0)
    assert admitted.repaired_keys == (key,)
    assert admitted.decisions[0].remaining == 3
    assert redis_client.pttl(key) > 0
    assert storage.evaluate([check], now_us=T0).repaired_keys == ()


@pytest.mark.parametrize("score", [float("inf"), 1e30, T0 + 10**12])
def test_slots_leased_past_any_lease_are_garbage_repaired(
    redis_client: redis.Redis, score: float
) -> None:
    """Every slot of a concurrency key (or of the fleet's) held by a lease that ends far in the
    future, in a key with no TTL: never expired, so the client (or the whole fleet) would be
    refused for ever. No lease is longer than a day: one ending two days on is garbage, the key
    replaced and reported."""
    storage = RedisStorage(redis_client)
    key = "g:{x}:c:concurrency"
    redis_client.zadd(key, {str(token): score for token in range(1, 6)})
    check = Check(key, "concurrency", 5, 60, cost=7)  # token 7
    admitted = storage.evaluate([check], now_us=T0)
    assert admitted.allowed and admitted.repaired_keys == (key,)
    assert redis_client.zcard(key) == 1 and 0 < redis_client.pttl(key) <= 60_002
    live = Check(key, "concurrency", 5, 60, cost=8)  # a live slot beside it: kept
    assert storage.evaluate([live], now_us=T0 + 30_000_000).repaired_keys == ()
    assert redis_client.zcard(key) == 2


def test_bad_arguments_are_script_errors(redis_client: redis.Redis) -> None:
    script = redis_client.register_script(SCRIPT_SOURCE)
    bad: list[tuple[list[str], list[str | int | float]]] = [
        (["k"], ["-1,0,1,10,60000000"]),  # one field short
        (["k"], ["-1,0,1,10,60000000,1,1"]),  # one field too many
        (["k", "l"], ["-1,0,1,10,60000000,1"]),  # fields for one key, two keys
        (["k"], [-1, 0, 1, 10, 60_000_000, 1]),  # the old layout: one argument per number
        (["k"], ["-1,0,1,10,60000000,1", "x"]),  # a second argument
        (["k"], []),  # no argument
        (["k"], [""]),  # an empty one
        (["k"], ["-1,0,,1,10,60000000,1"]),  # an empty field (the count alone would pass)
        (["k"], [",-1,0,1,10,60000000,1"]),
        (["k"], ["-1,0,1,10,60000000,1,"]),
        (["k"], ["-1,2,1,10,60000000,1"]),  # mode 2
        (["k"], ["x,0,1,10,60000000,1"]),  # time
        (["k"], ["-1,0,7,10,60000000,1"]),  # algorithm 7 (6 is concurrency)
        (["k"], ["-1,0,16,10,60000000,1"]),  # the shadow flag alone
        (["k"], ["-1,0,55,10,60000000,1"]),  # release + shadow flags on algorithm 7
        (["k"], ["-1,0,257,10,60000000,1"]),  # an unknown flag (64 is a debt, 128 a meta check)
        (["k"], ["-1,0,1,0,60000000,1"]),  # limit 0
        (["k"], ["-1,0,1,10,1.5,1"]),  # fractional period
        (["k"], ["-1,0,1,10,60000000,-1"]),  # negative cost
        (["k"], ["-1,0,1,10,60000000,nan"]),
        (["k"], ["-1,0,1,10,inf,1"]),
    ]
    for keys, args in bad:
        with pytest.raises(redis.ResponseError, match="distlimit"):
            script(keys, args)
    storage = RedisStorage(redis_client)
    with pytest.raises(StorageResponseError, match="bad arguments for check 2"):
        storage.evaluate([Check("a", "gcra", 1, 1), Check("b", "gcra", 0, 1)])
    assert redis_client.dbsize() == 0  # refused before anything was written


def test_redis_time_is_used_without_injection(redis_client: redis.Redis) -> None:
    storage = RedisStorage(redis_client)
    check = Check("t:{x}:1:fixed_window", "fixed_window", 1, 3600)
    seconds, micros = redis_client.time()
    decision = storage.evaluate([check]).decisions[0]
    window_end = (seconds // 3600 + 1) * 3600 * 1_000_000
    assert decision.allowed
    assert abs(decision.reset_after * 1e6 - (window_end - seconds * 1_000_000 - micros)) < 5e6


def _ttls_set(redis_client: redis.Redis, run: Callable[[], object]) -> dict[str, int]:
    """The TTL (ms) each key was last given by the commands ``run`` made Redis execute, read
    from ``MONITOR`` (which shows the commands a script runs)."""
    ttls: dict[str, int] = {}
    with redis_client.monitor() as monitor:
        run()
        redis_client.echo("ttls-done")
        while True:
            command = monitor.next_command()["command"]
            if command == "ECHO ttls-done":
                return ttls
            words = command.split()
            if words[0] == "PEXPIRE":
                ttls[words[1]] = int(words[2])
            elif words[0] == "SET" and "PX" in words:
                ttls[words[1]] = int(words[words.index("PX") + 1])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("checks", [1, 2])
def test_a_key_outlives_its_reset_by_a_whole_millisecond(
    redis_client: redis.Redis, algorithm: Algorithm, checks: int
) -> None:
    """Redis counts a TTL from its clock truncated to the millisecond: a key given ``PEXPIRE 1``
    may expire at once (measured on 7.0: 7 in 30,000 script calls, within the same call), and
    one given its reset rounded up may vanish up to 1 ms early, when a request would start from
    zero. Every TTL a script sets is its reset, rounded up, and 1 ms more; on the fast path
    (one check), the general path (two), and a refund. Resets here are whole milliseconds or
    1 us (the fixed window's last microsecond), where the rounding alone gives no margin."""
    redis_client.flushall()
    script = redis_client.register_script(SCRIPT_SOURCE)
    period = 1
    window_end = (T0 // 1_000_000 + 7) * 1_000_000  # a second boundary
    now = window_end - 1 if algorithm == "fixed_window" else window_end
    keys = [f"ttl:{{m}}:{i}:{algorithm}" for i in range(checks)]
    batch = [Check(key, algorithm, 10, period, 1) for key in keys]
    for refund in (False, True):
        replies: list[object] = []

        def call(refund: bool = refund, replies: list[object] = replies) -> None:
            # one MULTI: the key cannot expire in real time between the two calls
            pipe = redis_client.pipeline(transaction=True)
            if refund:  # take two, give one back: what is left still needs its TTL
                script(*script_args([replace(c, cost=2) for c in batch], now), client=pipe)
            script(*script_args(batch, now, refund=refund), client=pipe)
            replies.extend(pipe.execute())

        ttls = _ttls_set(redis_client, call)
        evaluation = parse_reply(replies[-1], batch)
        for key, decision in zip(keys, evaluation.decisions, strict=True):
            reset_us = round(decision.reset_after * 1_000_000)
            assert reset_us > 0, (algorithm, refund, decision)
            assert key in ttls, (algorithm, refund, "no TTL set", ttls)
            assert ttls[key] * 1000 >= reset_us + 1000, (algorithm, refund, ttls[key], reset_us)
        redis_client.flushall()


@pytest.mark.parametrize("checks", [1, 2])
def test_a_busy_log_sets_its_ttl_once_a_step(redis_client: redis.Redis, checks: int) -> None:
    """A log key must outlive its newest member's period; a PEXPIRE per admission (a fifth of
    the log's script time) is not needed for that. 60 admissions 10 ms apart in a 1 s period
    (a step of 125 ms) set the TTL once a step, and after each call the key lives, in the
    script's clock, at least 1 ms past its newest member's period; on the fast path (one check)
    and the general path (two)."""
    redis_client.flushall()
    script = redis_client.register_script(SCRIPT_SOURCE)
    keys = [f"busy:{{m}}:{i}:sliding_window_log" for i in range(checks)]
    batch = [Check(key, "sliding_window_log", 1000, 1, 1) for key in keys]
    expires: dict[str, int] = {}  # each key's end, in the script's clock (us)
    renewals = 0
    for i in range(60):
        now = T0 + i * 10_000
        ttls = _ttls_set(redis_client, lambda now=now: script(*script_args(batch, now)))
        renewals += len(ttls)
        expires.update({key: now + ms * 1000 for key, ms in ttls.items()})
        for key in keys:
            assert expires[key] >= now + 1_000_000 + 1000, (i, key, expires[key] - now)
    assert 5 * checks <= renewals <= 6 * checks, renewals


@pytest.mark.parametrize("expired", [0, 1, SWL_BATCH, SWL_BATCH + 1, SWL_BATCH + 2, 64, 65, 599])
def test_a_log_removes_every_expired_entry_and_counts_the_rest_exactly(
    redis_client: redis.Redis, expired: int
) -> None:
    """600 entries of cost 1, 1 ms apart, ``expired`` of them out of the window: every expired
    one goes in the call (from the old end, or after a binary search when more than the old
    end's block expired) and the rest count, as the twin counts them; denied, then admitted."""
    redis_client.flushall()
    storage, twin = RedisStorage(redis_client), MemoryStorage(clock=lambda: 0)
    key = "many:{x}:1:sliding_window_log"
    one = Check(key, "sliding_window_log", 1000, 60, 1)
    for backend in (storage, twin):
        for i in range(600):
            assert backend.evaluate([one], now_us=T0 + i * 1000).allowed
    assert redis_client.llen(key) == 600
    now = T0 + 60_000_000 + (expired - 1) * 1000  # entries of T0 .. now - 60 s expired
    for cost in (401 + expired, 400 + expired):  # denied by one unit, then admitted
        check = [replace(one, cost=cost)]
        assert storage.evaluate(check, now_us=now) == twin.evaluate(check, now_us=now)
        assert redis_client.llen(key) == 600 - expired + (cost == 400 + expired)


def test_large_costs_and_limits(redis_client: redis.Redis) -> None:
    storage = RedisStorage(redis_client)
    twin = MemoryStorage(clock=lambda: 0)
    # the log writes one member per request, whatever its cost
    log = Check("big:{x}:1:sliding_window_log", "sliding_window_log", 3000, 60, cost=2500)
    for backend in (storage, twin):
        assert backend.evaluate([log], now_us=T0).decisions[0].remaining == 500
        assert not backend.evaluate([Check(*_fields(log), cost=501)], now_us=T0).allowed
        assert backend.evaluate([Check(*_fields(log), cost=500)], now_us=T0).allowed
    assert redis_client.llen(log.key) == 2  # 2,500 units, then 500
    # the largest rates and periods limits.py accepts
    huge = [
        Check(f"big:{{x}}:2:{a}", a, 10**12, 366 * 86_400, cost=10**12 - 1)
        for a in ALGORITHMS
        if a != "sliding_window_log"
    ]
    assert storage.evaluate(huge, now_us=T0) == twin.evaluate(huge, now_us=T0)
    again = storage.evaluate(huge, now_us=T0 + 1)
    assert again == twin.evaluate(huge, now_us=T0 + 1)
    assert [d.remaining for d in again.decisions] == [1, 1, 1, 1]


def test_a_log_give_back_takes_the_oldest_units(redis_client: redis.Redis) -> None:
    """Units given back are the log's oldest, never a later request's: those stay counted for
    their whole period. Taking the newest dated B's units as A's, and once A's time had passed
    the log admitted 5 more while B's 2 were still in the window: 7 of 5."""
    s, key = 1_000_000, "give:{x}:1:sliding_window_log"

    def check(cost: int) -> Check:
        return Check(key, "sliding_window_log", 5, 60, cost)

    script = redis_client.register_script(SCRIPT_SOURCE)

    def lua(checks: list[Check], now_us: int, refund: bool = False) -> Evaluation:
        return parse_reply(script(*script_args(checks, now_us, refund=refund)), checks)

    twin = MemoryStorage(clock=lambda: 0)
    for evaluate, refund in ((lua, partial(lua, refund=True)), (twin.evaluate, twin.refund)):
        assert evaluate([check(3)], now_us=T0).allowed  # A reserves 3
        assert evaluate([check(2)], now_us=T0 + 10 * s).allowed  # B takes 2
        assert refund([check(3)], now_us=T0 + 30 * s).decisions[0].remaining == 3  # A used none
        later = evaluate([check(5)], now_us=T0 + 61 * s)  # A's time is past, B's is not
        assert not later.allowed and later.decisions[0].remaining == 3, evaluate
        assert evaluate([check(3)], now_us=T0 + 61 * s).allowed
        # a Cluster refund of a request another slot group refused takes the oldest units too:
        # its newest entry of that cost may be a later request's (B below), whose units would
        # be dated as A's. Taking its own entry, a window held 3 of 2 (the list's review).
        start = T0 + 200 * s
        tight = Check(f"{key}:tight", "sliding_window_log", 2, 10, 1)
        assert evaluate([tight], now_us=start).allowed  # A, refused by another group
        assert evaluate([tight], now_us=start + 1000).allowed  # B, same client, meanwhile
        assert refund([tight], now_us=start + 2000).decisions[0].remaining == 1  # A's rollback
        assert evaluate([tight], now_us=start + 3000).allowed  # C
        assert not evaluate([tight], now_us=start + 10 * s + 500).allowed  # B and C still live


def _fields(check: Check) -> tuple[str, Algorithm, int, int]:
    return check.key, check.algorithm, check.limit, check.period


def test_a_reply_longer_than_one_format_call(redis_client: redis.Redis) -> None:
    # 200 checks = 1,201 integers: the script formats its reply in chunks (unpack's limit)
    storage = RedisStorage(redis_client)
    twin = MemoryStorage(clock=lambda: 0)
    checks = [
        Check(f"many:{{x}}:{i}:fixed_window", "fixed_window", 10, 60, i % 3) for i in range(200)
    ]
    for backend in (storage, twin):
        backend.evaluate(checks, now_us=T0)
    assert storage.evaluate(checks, now_us=T0 + 1) == twin.evaluate(checks, now_us=T0 + 1)


def test_the_log_batch_is_the_same_in_the_script_and_the_twin() -> None:
    # how many members one call removes or reads decides which members stay: both must agree
    found = re.search(r"^local SWL_BATCH = (\d+)$", SCRIPT_SOURCE, re.MULTILINE)
    assert found is not None and int(found[1]) == SWL_BATCH


def test_every_command_the_scripts_run_is_in_the_acl_grants() -> None:
    # an ACL user given exactly ACL_GRANTS must be able to run every path of the scripts
    from flask_distlimit.storage.heartbeat import HEARTBEAT_SOURCE
    from flask_distlimit.storage.lease_records import LEASE_RECORDS_SOURCE
    from flask_distlimit.storage.side_calls import SHARED_VALUE_SOURCE
    from flask_distlimit.storage.translate import ACL_GRANTS

    called = re.findall(
        r"redis\.p?call\(?'([A-Z]+)'",
        SCRIPT_SOURCE + HEARTBEAT_SOURCE + SHARED_VALUE_SOURCE + LEASE_RECORDS_SOURCE,
    )
    granted = {g.removeprefix("+") for g in ACL_GRANTS.split() if g.startswith("+")}
    assert called and {c.lower() for c in called} <= granted


def test_the_script_is_built_from_every_shipped_lua_file_and_the_same_each_time() -> None:
    # every file of engine/lua is in the script (none shipped unused), and building it again
    # gives the same text: the same SHA for SCRIPT LOAD / EVALSHA
    from importlib import resources

    from flask_distlimit.engine.lua_source import script_parts, script_source
    from flask_distlimit.engine.scripts import ALGORITHM_CODES, SHADOW_FLAG

    lua = resources.files("flask_distlimit.engine") / "lua"
    shipped = [f for f in lua.iterdir() if f.name.endswith(".lua")]
    assert len(shipped) >= len(ALGORITHM_CODES) + 4
    for file in shipped:
        assert file.read_text(encoding="utf-8").splitlines()[0] in SCRIPT_SOURCE, file.name
    assert script_source(script_parts(ALGORITHM_CODES, SHADOW_FLAG)) == SCRIPT_SOURCE


def test_common_helpers_are_inlined_not_built_on_every_call() -> None:
    code = "\n".join(line.partition("--")[0] for line in SCRIPT_SOURCE.splitlines())
    assert not re.search(r"\b(whole|finite|failed|expire_in)\b", code)
    assert "(type(raw) == 'table' and raw.err ~= nil)" in code


@pytest.mark.parametrize("algorithm", [a for a in ALGORITHMS if a != "concurrency"])
def test_a_meta_check_of_cost_0_writes_nothing_when_another_refuses(
    redis_client: redis.Redis, algorithm: Algorithm
) -> None:
    """A breach is written with the meta check's cost: of 0 (a peek, which the package never
    sends), nothing, on every algorithm (the log wrote an entry of no units, which reads as
    garbage: the next call reset its count)."""
    redis_client.flushall()
    storage = RedisStorage(redis_client)
    meta = Check(f"m0:{{x}}:m:{algorithm}", algorithm, 5, 60, cost=0, meta=True)
    spent = Check("m0:{x}:r:fixed_window", "fixed_window", 1, 60)
    storage.evaluate([spent], now_us=T0)
    refused = storage.evaluate([spent, meta], now_us=T0)
    assert not refused.allowed and refused.repaired_keys == ()
    assert redis_client.exists(meta.key) == 0


def test_a_log_give_back_keeps_a_debt_past_the_limit(redis_client: redis.Redis) -> None:
    """A settlement past the limit leaves the log holding more than L units, and it counts L
    until the debt's units leave the window. A give-back of another reservation then takes the
    oldest units, the debt's included: it took them from the L counted, and forgave the rest
    (an LLM tenant at 10 tokens a minute used 20 in one: the list's review)."""
    redis_client.flushall()
    s, key = 1_000_000, "debt:{x}:1:sliding_window_log"

    def check(cost: int, **kind: bool) -> Check:
        return Check(key, "sliding_window_log", 5, 60, cost, **kind)

    for backend in (RedisStorage(redis_client), MemoryStorage(clock=lambda: 0)):
        assert backend.evaluate([check(1)], now_us=T0).allowed  # A reserves 1
        assert backend.evaluate([check(4)], now_us=T0 + s // 2).allowed  # B reserves 4
        assert backend.evaluate([check(5, debt=True)], now_us=T0 + s).allowed  # A used 6
        given = backend.evaluate([check(4, release=True)], now_us=T0 + 2 * s)  # B used none
        assert given.decisions[0].remaining == 0  # 6 units live: 5 counted
        assert not backend.evaluate([check(1)], now_us=T0 + 3 * s).allowed, backend
