"""The algorithm registry (:mod:`flask_distlimit.engine.registry`): one entry per algorithm, and
the entries agree with what still states the same facts elsewhere (the script's codes, the
leases' algorithms), until those read the registry too."""

from __future__ import annotations

from typing import get_args

import pytest
import redis

from flask_distlimit import ConfigurationError
from flask_distlimit.core.algorithms import ALGORITHMS, CONCURRENCY, Algorithm
from flask_distlimit.core.limits import parse_rates
from flask_distlimit.declare.lease_options import LEASABLE
from flask_distlimit.engine.concurrency import MAX_CONCURRENCY
from flask_distlimit.engine.gcra import MAX_GCRA_RATE
from flask_distlimit.engine.registry import REGISTRY, check_rate
from flask_distlimit.engine.scripts import ALGORITHM_CODES, SCRIPT_SOURCE
from flask_distlimit.engine.sliding_window_log import MAX_LOG_LIMIT
from flask_distlimit.storage.give_back import GIVE_BACK_CODES, GIVE_BACK_SOURCE
from tests.distlimit_fixtures import EXACT_ALGORITHMS


def test_every_algorithm_has_one_entry_under_its_name() -> None:
    assert set(REGISTRY) == set(get_args(Algorithm)) == {*ALGORITHMS, CONCURRENCY}
    assert all(entry.name == name for name, entry in REGISTRY.items())


def test_each_code_is_its_algorithms_place_in_the_script() -> None:
    """The code a check is sent as picks the loader of its algorithm in the driver (the table
    is written from the codes: a code out of order would run another algorithm's Lua)."""
    assert ALGORITHM_CODES == {
        "fixed_window": 1,
        "sliding_window_log": 2,
        "sliding_window_counter": 3,
        "token_bucket": 4,
        "gcra": 5,
        "concurrency": 6,
    }  # on the wire: stored scripts' callers use them
    [line] = [ln for ln in SCRIPT_SOURCE.splitlines() if ln.startswith("local LOADERS = {")]
    loaders = line.removeprefix("local LOADERS = {").removesuffix("}").split(", ")
    assert loaders == [f"LOAD_{name.upper()}" for name in sorted(REGISTRY, key=ALGORITHM_CODES.get)]
    for name in REGISTRY:  # each loader is defined by its algorithm's own file
        assert f"local function LOAD_{name.upper()}()" in SCRIPT_SOURCE


def test_the_leasable_algorithms_are_those_the_lease_options_accept() -> None:
    assert {name for name, entry in REGISTRY.items() if entry.leasable} == LEASABLE
    # Not the log: it stores when each unit is used, unknown for a unit leased in advance.
    assert {"fixed_window", "sliding_window_counter", "token_bucket", "gcra"} == LEASABLE


def test_the_exact_algorithms_are_the_rate_algorithms_that_never_admit_more() -> None:
    assert {"fixed_window", "sliding_window_log", "token_bucket", "gcra"} == EXACT_ALGORITHMS


def test_a_lease_ends_with_the_window_or_when_the_rate_has_earned_its_units_back() -> None:
    # what resilience/leases.py computes per algorithm (Lease.granted): one of the three
    for name, entry in REGISTRY.items():
        if entry.leasable:
            assert [entry.aligned, entry.span > 1, entry.refills].count(True) == 1, name
    assert {n for n, e in REGISTRY.items() if e.refills} == {"token_bucket", "gcra"}


def test_units_are_given_back_to_the_windowed_counts_only() -> None:
    assert GIVE_BACK_CODES == {"fixed_window": 1, "sliding_window_counter": 3}
    assert "local FIELDS = {[1] = 'n', [3] = 'c'}" in GIVE_BACK_SOURCE
    for name, entry in REGISTRY.items():
        assert (entry.give_back_field is None) == (entry.counted is None), name


@pytest.mark.parametrize("code", [0, 2, 4, 5, 6, 7])
def test_the_give_back_script_refuses_an_algorithm_it_cannot_give_back_to(
    redis_client: redis.Redis, code: int
) -> None:
    with pytest.raises(redis.ResponseError, match="bad give-back arguments"):
        redis_client.eval(GIVE_BACK_SOURCE, 1, "gb:{x}:k", code, 60_000_000, 1, 1, 0)


def test_each_bound_is_refused_with_its_own_message() -> None:
    (log,) = parse_rates(f"{MAX_LOG_LIMIT + 1}/day")
    with pytest.raises(ConfigurationError, match=f"up to {MAX_LOG_LIMIT} per window"):
        check_rate("sliding_window_log", log)
    (fast,) = parse_rates(f"{MAX_GCRA_RATE + 1}/second")
    with pytest.raises(ConfigurationError, match=f"up to {MAX_GCRA_RATE} per second"):
        check_rate("gcra", fast)
    for algorithm in ("fixed_window", "sliding_window_counter", "token_bucket"):
        check_rate(algorithm, log)
        check_rate(algorithm, fast)
    (slots,) = parse_rates(f"{MAX_CONCURRENCY}/second")
    check_rate(CONCURRENCY, slots)
    assert REGISTRY[CONCURRENCY].max_limit == MAX_CONCURRENCY
