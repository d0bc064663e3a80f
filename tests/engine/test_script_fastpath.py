"""The script's fast paths decide and refuse exactly as its general path does.

One check whose argument is six plain decimal integers takes a fast path in the script (each rate
algorithm's, inlined: generated from its own file; the driver's for every algorithm); several
checks of the rate algorithms whose argument is plain integers take the several-check fast path
(the same regions); anything else (here: the same numbers with a space before each, which cjson
still reads) goes through the general path. So each scenario runs twice on twin keys, once per
path, and the replies and what is stored must match."""

from __future__ import annotations

import random
import re

import pytest
import redis

from flask_distlimit.engine.scripts import (
    _PARTS,
    ALGORITHM_CODES,
    RELEASE_FLAG,
    SCRIPT_SOURCE,
    SHADOW_FLAG,
)
from flask_distlimit.engine.sliding_window_log import SWL_BATCH
from tests.vectors import T0

pytestmark = pytest.mark.redis

MINUTE = 60_000_000


def _fast(fields: list[int]) -> str:
    return ",".join(map(str, fields))


def _general(fields: list[int]) -> str:
    # cjson reads " 5" as 5; the plain-digit patterns of the fast paths do not match it
    return ",".join(f" {f}" for f in fields)


def _state(client: redis.Redis, key: str) -> object:
    kind = client.type(key)
    if kind == b"hash":
        return sorted(client.hgetall(key).items())
    if kind == b"zset":
        return client.zrange(key, 0, -1, withscores=True)
    if kind == b"list":
        return client.lrange(key, 0, -1)
    if kind == b"string":
        return client.get(key)
    return kind


def _run(
    client: redis.Redis, checks: list[tuple[int, int, int]], steps: list[tuple[int, int, list[int]]]
) -> None:
    """checks: (code, limit, period) per key; steps: (now, mode, cost per check)."""
    script = client.register_script(SCRIPT_SOURCE)
    n = len(checks)
    fast_keys = [f"fast:{{t}}:{i}" for i in range(n)]
    general_keys = [f"general:{{t}}:{i}" for i in range(n)]
    widest = 0  # the longest time between the two calls of a step, measured on the server
    for now, mode, costs in steps:
        fields = [now, mode]
        for (code, limit, period), cost in zip(checks, costs, strict=True):
            fields += [code, limit, period, cost]
        before = _ms(client)
        assert script(fast_keys, [_fast(fields)]) == script(general_keys, [_general(fields)])
        widest = max(widest, _ms(client) - before)
        for fast, general in zip(fast_keys, general_keys, strict=True):
            assert _state(client, fast) == _state(client, general)
            # the same TTLs set in the same steps: the general key's expiry is as much later as
            # its call was (no timing assumption: the bound is measured; 1 ms for the server's
            # cached clock, which a script's expiry is computed from)
            fast_at, general_at = client.pexpiretime(fast), client.pexpiretime(general)
            if fast_at < 0 or general_at < 0:
                assert fast_at == general_at
            else:
                assert -1 <= general_at - fast_at <= widest + 1


def _ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return seconds * 1000 + micros // 1000 + 1


def _steps(
    rng: random.Random, n: int, count: int, refunds: bool
) -> list[tuple[int, int, list[int]]]:
    steps, now = [], T0
    for _ in range(count):
        now += rng.choice([0, 1, 999, 250_000, 7_000_000, 40_000_000])
        mode = 1 if refunds and rng.random() < 0.15 else 0
        steps.append((now, mode, [rng.choice([0, 1, 1, 1, 2, 3, 5, 11]) for _ in range(n)]))
    return steps


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", [a for a in ALGORITHM_CODES if a != "concurrency"])
@pytest.mark.parametrize("shadow", [False, True])
def test_one_check_decides_as_the_general_path(
    redis_client: redis.Redis, algorithm: str, shadow: bool
) -> None:
    rng = random.Random(f"{algorithm}{shadow}")
    code = ALGORITHM_CODES[algorithm] + (SHADOW_FLAG if shadow else 0)  # type: ignore[index]
    _run(redis_client, [(code, 5, MINUTE)], _steps(rng, 1, 120, refunds=True))


def test_one_concurrency_slot_and_its_release_as_the_general_path(
    redis_client: redis.Redis,
) -> None:
    rng = random.Random(6)
    take, give = ALGORITHM_CODES["concurrency"], ALGORITHM_CODES["concurrency"] + RELEASE_FLAG
    script = redis_client.register_script(SCRIPT_SOURCE)
    held: list[int] = []
    now = T0
    for _ in range(80):
        now += rng.choice([0, 1, 500_000, 3_000_000])
        if held and rng.random() < 0.4:
            code, token = give, held.pop(rng.randrange(len(held)))
        else:
            code, token = take, rng.randrange(1, 10**12)
            held.append(token)
        fields = [now, 0, code, 3, 10_000_000, token]
        fast = script(["fast:{c}"], [_fast(fields)])
        assert fast == script(["general:{c}"], [_general(fields)])
        assert _state(redis_client, "fast:{c}") == _state(redis_client, "general:{c}")


@pytest.mark.parametrize("n", [2, 3, 7, 8])
def test_several_checks_decide_as_with_spaced_fields(redis_client: redis.Redis, n: int) -> None:
    rng = random.Random(n)
    codes = [1, 2, 3, 4, 5, 1 + SHADOW_FLAG, 3, 5]
    checks = [(codes[i], 4 + i, MINUTE) for i in range(n)]
    _run(redis_client, checks, _steps(rng, n, 60, refunds=True))


#: The algorithms with fast paths (their files mark their regions).
FAST = ("fixed_window", "sliding_window_log", "sliding_window_counter", "token_bucket", "gcra")


@pytest.mark.parametrize("seed", range(6))
def test_several_checks_with_fast_paths_decide_as_the_general_path(
    redis_client: redis.Redis, seed: int
) -> None:
    # the several-check fast path: 2 to 9 checks of the algorithms with fast paths, any mix, some
    # shadow, small limits (requests denied by one check, or by a shadow one only)
    rng = random.Random(seed)
    n = rng.randint(2, 9)
    checks = [
        (
            ALGORITHM_CODES[rng.choice(FAST)] + rng.choice([0, 0, SHADOW_FLAG]),
            rng.randint(1, 9),
            MINUTE,
        )
        for _ in range(n)
    ]
    _run(redis_client, checks, _steps(rng, n, 60, refunds=True))


@pytest.mark.parametrize("algorithm", ["fixed_window", "sliding_window_counter"])
def test_counters_decide_as_the_general_path_at_any_limit_and_period(
    redis_client: redis.Redis, algorithm: str
) -> None:
    # limits, periods and steps of many sizes: every branch of the retry search (waiting in this
    # window, only in the next, never) and windows shifting by one, two or more
    rng = random.Random(algorithm)
    for _ in range(12):
        # periods of seconds at least: a key's TTL runs on the server's real clock
        limit = rng.choice([1, 2, 3, 7, 40, 999])
        period = rng.choice([3_000_001, 7_000_000, MINUTE, 999_999_937])
        code = ALGORITHM_CODES[algorithm] + rng.choice([0, SHADOW_FLAG])  # type: ignore[index]
        steps, now = [], T0 + rng.randrange(period)
        for _ in range(25):
            now += rng.choice([0, 1, period // 3, period - 1, period, 2 * period + 1])
            costs = [rng.choice([0, 1, 1, 2, limit // 2, limit, limit + 1])]
            steps.append((now, 0, costs))
        for key in ("fast:{t}:0", "general:{t}:0"):
            redis_client.delete(key)
        _run(redis_client, [(code, limit, period)], steps)


def test_time_from_redis_on_the_fast_path(redis_client: redis.Redis) -> None:
    script = redis_client.register_script(SCRIPT_SOURCE)
    before = int(redis_client.time()[0]) * 1_000_000
    reply = script(["clock:{c}"], ["-1,0,1,10,60000000,1"]).split(b",")
    assert int(reply[0]) >= before
    assert reply[1:3] == [b"1", b"10"] and reply[3] == b"9"


MALFORMED = [
    "-2,0,1,10,60000000,1",  # time
    "-0001x,0,1,10,60000000,1",
    "-1,2,1,10,60000000,1",  # mode 2
    "-1,10,1,10,60000000,1",
    "-1,0,0,10,60000000,1",  # algorithm 0
    "-1,0,7,10,60000000,1",
    "-1,0,23,10,60000000,1",  # shadow flag on algorithm 7
    "-1,0,48,10,60000000,1",  # release and shadow flags on algorithm 0
    "-1,0,1,0,60000000,1",  # limit 0
    "-1,0,1,9007199254740993,60000000,1",  # not exact in a double
    "-1,0,1,10,0,1",  # period 0
    "-1,0,1,10,9007199254740993,1",
    "-1,0,1,10," + "9" * 400 + ",1",  # infinity
    "-1,0,1,10,60000000,9007199254740993",
    "-1,0,1,10,60000000,-1",
    "-1,0,1,10,60000000",
    "-1,0,1,10,60000000,1,",
    "-1,0,1,10,60000000,1,1",
    "-1,0,1,10,6e7,1.5",
    f"{T0},0,5,10,1,1",  # a GCRA rate too fast to compute exactly
]


MALFORMED_SEVERAL = [  # two windowed checks: anything off goes on to the general path
    "-2,0,1,10,60000000,1,3,10,60000000,1",
    "-1,0,1,10,60000000,1,3,0,60000000,1",  # limit 0 in the second check
    "-1,0,1,10,60000000,1,3,10,0,1",
    "-1,0,1,10,60000000,1,3,10,60000000,-1",
    "-1,0,1,10,60000000,1,3,10,60000000,9007199254740993",
    "-1,0,1,10,60000000,1,3,10," + "9" * 400 + ",1",
    "-1,0,1,10,60000000,1,3,10,60000000",
    "-1,0,1,10,60000000,1,3,10,60000000,1,",
    "-1,0,1,10,60000000,1,7,10,60000000,1",  # algorithm 7
    f"{T0},0,1,10,60000000,1,5,10,1,1",  # a GCRA rate too fast to compute exactly
    "-1,0,1,10,60000000,1,3,10,60000000,1.5",
    "-1,0,1,10,60000000,1,3,10,60000000,true",
]


@pytest.mark.parametrize("argument", MALFORMED_SEVERAL)
def test_malformed_arguments_of_several_checks_are_refused_as_on_the_general_path(
    redis_client: redis.Redis, argument: str
) -> None:
    script = redis_client.register_script(SCRIPT_SOURCE)
    with pytest.raises(redis.ResponseError, match="distlimit") as fast:
        script(["k1", "k2"], [argument])
    spaced = ",".join(f" {field}" for field in argument.split(","))
    with pytest.raises(redis.ResponseError, match="distlimit") as general:
        script(["k1", "k2"], [spaced])
    assert str(fast.value) == str(general.value)
    assert redis_client.dbsize() == 0


@pytest.mark.parametrize("argument", MALFORMED)
def test_malformed_arguments_are_refused_as_on_the_general_path(
    redis_client: redis.Redis, argument: str
) -> None:
    script = redis_client.register_script(SCRIPT_SOURCE)
    with pytest.raises(redis.ResponseError, match="distlimit") as fast:
        script(["k"], [argument])
    spaced = ",".join(f" {field}" for field in argument.split(","))
    with pytest.raises(redis.ResponseError, match="distlimit") as general:
        script(["k"], [spaced])
    assert str(fast.value) == str(general.value)
    assert redis_client.dbsize() == 0


def test_the_fast_path_is_built_from_each_algorithm_s_own_text() -> None:
    # one source per algorithm: each with fast paths has a branch (one check's, several checks'),
    # every placeholder of the templates is filled, and the log's branches remove and read as many
    # members per call as its file says
    fast = _PARTS[1]
    for algorithm in FAST:
        assert f"code_s == '{ALGORITHM_CODES[algorithm]}' or" in fast  # type: ignore[index]
        several = f"if code == {ALGORITHM_CODES[algorithm]} then"  # type: ignore[index]
        assert SCRIPT_SOURCE.count(several) == 2  # the driver's, to decide and to commit
    assert not re.search(r"^\s*--@", fast + _PARTS[3], re.MULTILINE)  # and the driver
    batches = re.findall(r"^ *local SWL_BATCH = (\d+)$", SCRIPT_SOURCE, re.MULTILINE)
    assert len(batches) == 3 and {int(b) for b in batches} == {SWL_BATCH}


GARBAGE = {
    "gcra": [
        lambda r, k: r.hset(k, "t", "1"),
        lambda r, k: r.set(k, "x"),
        lambda r, k: r.set(k, "1e300"),
        lambda r, k: r.set(k, "-1"),
        lambda r, k: r.set(k, str(T0 // 12_000_000 + 3)),  # 3 units owed (T = 12 s)
        lambda r, k: r.set(k, str(T0 // 12_000_000 + 10)),  # 10 owed: kept (at most 2L)
        lambda r, k: r.set(k, str(T0 // 12_000_000 + 11)),  # more: repaired
        lambda r, k: r.set(k, str(T0 / 12_000_000 + 2.5)),
    ],
    "token_bucket": [
        lambda r, k: r.set(k, "x"),
        lambda r, k: r.hset(k, mapping={"t": "1e300", "s": str(T0)}),
        lambda r, k: r.hset(k, mapping={"t": "x", "s": str(T0)}),
        lambda r, k: r.hset(k, mapping={"t": "2", "s": "x"}),
        lambda r, k: r.hset(k, mapping={"t": "2"}),  # no time: repaired
        lambda r, k: r.hset(k, mapping={"t": "-5", "s": str(T0 - 1)}),  # a debt, at most L
        lambda r, k: r.hset(k, mapping={"t": "-6", "s": str(T0 - 1)}),  # more: repaired
        lambda r, k: r.hset(k, mapping={"t": "2.5", "s": str(T0 - MINUTE // 2)}),
        lambda r, k: r.hset(k, mapping={"t": "1", "s": str(T0 + MINUTE)}),  # ahead, kept
        lambda r, k: r.hset(k, mapping={"t": "1", "s": str(T0 + MINUTE + 1)}),  # too far ahead
    ],
    "fixed_window": [
        lambda r, k: r.set(k, "x"),
        lambda r, k: r.hset(k, mapping={"w": "1", "n": "1e300"}),
        lambda r, k: r.hset(k, mapping={"w": "x"}),
        lambda r, k: r.hset(k, mapping={"w": str(T0 // MINUTE + 1), "n": "2"}),  # ahead, kept
        lambda r, k: r.hset(k, mapping={"w": str(T0 // MINUTE + 2), "n": "2"}),  # too far ahead
        lambda r, k: r.hset(k, mapping={"w": str(T0 // MINUTE), "n": "2.5"}),
    ],
    "sliding_window_counter": [
        lambda r, k: r.set(k, "x"),
        lambda r, k: r.hset(k, mapping={"w": "1", "c": "1e300", "p": "0"}),
        lambda r, k: r.hset(k, mapping={"w": "x"}),
        lambda r, k: r.hset(k, mapping={"w": str(T0 // MINUTE), "c": "2"}),  # no p: repaired
        lambda r, k: r.hset(k, mapping={"w": str(T0 // MINUTE), "c": "2", "p": "4"}),
        lambda r, k: r.hset(k, mapping={"w": str(T0 // MINUTE - 1), "c": "3", "p": "1"}),
        lambda r, k: r.hset(k, mapping={"w": str(T0 // MINUTE - 2), "c": "3", "p": "1"}),
        lambda r, k: r.hset(k, mapping={"w": str(T0 // MINUTE + 1), "c": "2", "p": "1"}),  # ahead
        lambda r, k: r.hset(k, mapping={"w": str(T0 // MINUTE + 2), "c": "2", "p": "1"}),
        lambda r, k: r.hset(k, mapping={"w": str(T0 // MINUTE), "c": "2.5", "p": "0"}),
        lambda r, k: r.hset(k, mapping={"w": str(T0 // MINUTE), "c": "-1", "p": "0"}),
    ],
    "sliding_window_log": [  # entries oldest first (the newest is pushed last, to the head)
        lambda r, k: r.set(k, "x"),
        lambda r, k: r.zadd(k, {"0:1": T0 - 1}),  # a sorted set, as a former version kept
        lambda r, k: r.lpush(k, f"{T0 - 5}:0:1", "junk", f"{T0 - 1}:3:4"),
        lambda r, k: r.lpush(k, "junk", f"{T0 - 4}:0:1", f"{T0 - 1}:1:3"),  # oldest unreadable
        lambda r, k: r.lpush(k, f"{T0 - 5}:0:9", f"{T0 - 1}:1:3"),  # oldest ends past the newest
        lambda r, k: r.lpush(k, f"{T0 - 2 * MINUTE}:0:1", f"{T0 - 5}:1:2", f"{T0 - 1}:2:4"),
        lambda r, k: r.lpush(k, f"{T0 - 1}:2:1"),  # start >= end
        lambda r, k: r.lpush(k, f"{T0 - 3}:0:2", f"{T0 - 2}:2:4", f"{T0 - 1}:4:9"),  # over L
        lambda r, k: r.lpush(k, f"{T0 + MINUTE + 9}:0:1"),  # too far ahead
        lambda r, k: r.lpush(k, *(f"{T0 - 2 * MINUTE + i}:{i}:{i + 1}" for i in range(7))),
        # more expired than the old end's block: a search, which meets an unreadable entry
        lambda r, k: r.lpush(
            k, *(f"{T0 - 2 * MINUTE + i}:{i}:{i + 1}" for i in range(7)), f"{T0 - 1}:7:8"
        ),
        lambda r, k: r.lpush(
            k, *(f"{T0 - 2 * MINUTE + i}:{i}:{i + 1}" for i in range(7)), "junk", f"{T0 - 1}:8:9"
        ),
        lambda r, k: r.lpush(
            k,
            *(f"{T0 - 2 * MINUTE + i}:{i}:{i + 1}" for i in range(7)),
            f"{T0 - 2}:7:8",
            f"{T0 - 1}:8:9",
        ),
    ],
}


@pytest.mark.parametrize(
    ("algorithm", "spoil"), [(a, s) for a, spoils in GARBAGE.items() for s in spoils]
)
def test_stored_garbage_is_handled_as_on_the_general_path(
    redis_client: redis.Redis, algorithm: str, spoil: object
) -> None:
    code = ALGORITHM_CODES[algorithm]  # type: ignore[index]
    for cost in (0, 1, 3, 9):
        for key in ("fast:{t}:0", "general:{t}:0"):  # the keys _run uses
            redis_client.delete(key)
            spoil(redis_client, key)  # type: ignore[operator]
        _run(redis_client, [(code, 5, MINUTE)], [(T0, 0, [cost]), (T0 + 1, 0, [1])])
    redis_client.delete("fast:{t}:0", "general:{t}:0")  # garbage may keep a key without a TTL


@pytest.mark.parametrize(
    ("algorithm", "spoil"), [(a, s) for a, spoils in GARBAGE.items() for s in spoils]
)
def test_stored_garbage_among_several_checks_as_on_the_general_path(
    redis_client: redis.Redis, algorithm: str, spoil: object
) -> None:
    code = ALGORITHM_CODES[algorithm]  # type: ignore[index]
    checks = [(3, 4, MINUTE), (code, 5, MINUTE), (code + SHADOW_FLAG, 2, MINUTE)]
    for cost in (0, 1, 3, 9):
        for key in ("fast:{t}:1", "general:{t}:1", "fast:{t}:2", "general:{t}:2"):
            redis_client.delete(key)
            spoil(redis_client, key)  # type: ignore[operator]
        _run(redis_client, checks, [(T0, 0, [1, cost, cost]), (T0 + 1, 0, [1, 1, 1])])
    redis_client.delete(*(f"{path}:{{t}}:{i}" for path in ("fast", "general") for i in range(3)))
