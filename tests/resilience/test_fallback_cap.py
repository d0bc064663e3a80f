"""The local fallback's cap (issue 34, finding 3 and item 2): however many identities an outage
meets, it counts at most ``max_keys`` keys (``DISTLIMIT_FALLBACK_MAX_KEYS``) and one overflow
key per limit, and the cap never lifts a limit: no key is evicted for a new one, identities past
the cap share one share of each limit, and a key that enters later starts from what that share
has left. docs/failure-modes.md ("Memory of the local fallback") states the bytes and the bound.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import pytest

from flask_distlimit.core.decision import Check
from flask_distlimit.resilience.fallback import LocalFallback
from tests.guard_helpers import FakeClock

START = 1_700_000_040.0  # on a whole minute: the first fixed window is [START, START + 60)
#: docs/failure-modes.md: about 650 bytes a key held (bench/fallback_memory.py); the bound says 1 KB
BYTES_PER_KEY = 1_000
#: what the fallback holds whatever its keys (its store, the overflow keys, dict slack)
FIXED_BYTES = 256_000


def _login(who: str, limit: int = 5, period: int = 60) -> Check:
    return Check(f"ratelimit:{{{who}}}:r:login:fixed_window", "fixed_window", limit, period)


def _ask(fallback: LocalFallback, clock: FakeClock, check: Check, instances: int = 1) -> bool:
    return fallback.evaluate([check], instances=instances, now_us=round(clock() * 1e6)).allowed


def _admitted(fallback: LocalFallback, clock: FakeClock, check: Check, times: int) -> int:
    return sum(_ask(fallback, clock, check) for _ in range(times))


def _resident_bytes() -> int:
    """This process's resident memory now (Linux: /proc/self/statm, in pages)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
def test_a_million_identities_in_one_outage_stay_under_the_bound() -> None:
    """Before: every identity of the outage's last minutes was held, whatever the rate (on main,
    the first 100,000 of this flood: 100,000 keys, 46.7 MB traced); now at most the cap. The
    process's resident memory is read every 50,000 identities (tracemalloc would cost the loop
    7x): its growth is what the flood cost, an upper bound of what the fallback holds."""
    cap = 5_000  # a bound of 5.3 MB: well above what other threads of the process may allocate
    clock = FakeClock(START)
    fallback = LocalFallback(clock=clock, settle=30.0, max_keys=cap)
    logging.getLogger("flask_distlimit.guard").disabled = True  # the paced WARNING: tested below
    try:
        victim = _login("victim")  # met before the flood: it has its own count
        assert _admitted(fallback, clock, victim, 6) == 5
        before = _resident_bytes()
        grown = 0
        for i in range(1_000_000):
            clock.advance(0.001)  # 1,000 new identities a second: the outage lasts 1,000 s
            _ask(fallback, clock, _login(f"u{i}"))
            if i % 50_000 == 0:
                grown = max(grown, _resident_bytes() - before)
                assert fallback.held() <= cap + 1  # and the overflow key of the login limit
            if i == 50_000:  # 50 s into the window: flooding fresh keys evicted nothing
                assert not _ask(fallback, clock, victim)
    finally:
        logging.getLogger("flask_distlimit.guard").disabled = False
    bound = cap * BYTES_PER_KEY + FIXED_BYTES
    assert grown <= bound, (grown, bound)
    assert fallback.held() <= cap + 1
    latecomer = _login("latecomer")  # past the cap: the flood has spent the shared share
    assert _admitted(fallback, clock, latecomer, 6) <= 5


def test_identities_past_the_cap_share_one_strict_share_of_each_limit() -> None:
    clock = FakeClock(START)
    fallback = LocalFallback(clock=clock, max_keys=2)
    assert _admitted(fallback, clock, _login("a"), 1) == 1
    assert _admitted(fallback, clock, _login("b"), 1) == 1
    # full: c and d share one share (5) of the login limit between them
    assert _admitted(fallback, clock, _login("c"), 4) == 4
    assert _admitted(fallback, clock, _login("d"), 4) == 1
    assert _admitted(fallback, clock, _login("a"), 9) == 4  # the keys held keep their own count
    assert fallback.held() == 3  # a, b and the login limit's overflow key
    other = Check("ratelimit:{c}:r:search:fixed_window", "fixed_window", 2, 60)
    assert _admitted(fallback, clock, other, 3) == 2  # another limit: an overflow key of its own


def test_flooding_fresh_keys_never_gives_a_fresh_quota() -> None:
    """As the attacker: spend your share, flood fresh keys to evict your counter, try again."""
    clock = FakeClock(START)
    fallback = LocalFallback(clock=clock, max_keys=100)
    attacker = _login("attacker")
    assert _admitted(fallback, clock, attacker, 6) == 5
    for i in range(1_000):
        clock.advance(0.01)
        _ask(fallback, clock, _login(f"fresh-{i}"))
    assert _admitted(fallback, clock, attacker, 5) == 0  # the same window: still spent
    assert _admitted(fallback, clock, _login("fresh-2000"), 5) == 0  # the overflow is spent too


def test_a_key_entering_after_the_overflow_starts_from_what_it_has_left() -> None:
    """Before the fix of the start (the cap without it), b spent 2 in the overflow, then entered
    with a whole share of its own: 5 in a window whose share is 3."""
    clock = FakeClock(START)
    fallback = LocalFallback(clock=clock, settle=0.0, max_keys=2)
    for who in ("a", "x"):  # fill the cap for a second
        assert _ask(fallback, clock, _login(who, limit=5, period=1))
    b = _login("b", limit=3)
    assert _admitted(fallback, clock, b, 2) == 2  # on the overflow key
    clock.advance(3)  # the counts of a and x have ended: there is room again
    assert fallback.held() == 1  # only the overflow key of b's limit
    assert _admitted(fallback, clock, b, 5) == 1  # b enters with what the overflow had left
    assert fallback.covers(b.key)


def test_a_slot_taken_on_the_overflow_key_is_released_there() -> None:
    clock = FakeClock(START)
    fallback = LocalFallback(clock=clock, max_keys=1)
    assert _ask(fallback, clock, _login("a"))
    slot = Check("ratelimit:{b}:r:export:concurrency", "concurrency", 1, 60, 1, token=7)
    other = Check("ratelimit:{c}:r:export:concurrency", "concurrency", 1, 60, 1, token=8)
    assert _ask(fallback, clock, slot)  # past the cap: the overflow key's one slot
    assert not _ask(fallback, clock, other)
    now_us = round(clock() * 1e6)
    fallback.release([dataclasses.replace(slot, release=True)], instances=1, now_us=now_us)
    assert _ask(fallback, clock, other)


def test_a_full_fallback_warns_once_a_minute_with_the_setting(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock(START)
    fallback = LocalFallback(clock=clock, max_keys=1)
    with caplog.at_level(logging.WARNING, logger="flask_distlimit.guard"):
        for i in range(300):
            clock.advance(0.5)
            _ask(fallback, clock, _login(f"u{i}"))
    lines = [r.getMessage() for r in caplog.records if r.name == "flask_distlimit.guard"]
    assert len(lines) == 3  # 150 s of overflow: at 0, 60 and 120 s
    assert "DISTLIMIT_FALLBACK_MAX_KEYS = 1 keys" in lines[0]
    assert "1 decisions" in lines[0] and "120 decisions" in lines[1]
