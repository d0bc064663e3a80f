"""Memory of the local fallback through a long outage: bytes per key held, with tracemalloc.

    PYTHONPATH=. python bench/fallback_memory.py                 # 100,000 identities
    PYTHONPATH=. python bench/fallback_memory.py --identities 300000 --rate 200
    PYTHONPATH=. python bench/fallback_memory.py --app           # through Flask: ~15 minutes
    PYTHONPATH=. python bench/fallback_memory.py --identities 200000 --rate 2000   # a flood: capped

A guard under policy ``local`` whose storage fails every call (``memory://`` behind a failing
wrapper: no server needed, the fallback's work is the same) meets ``--identities`` identities,
one login each (a fixed window of 5 per minute), ``--rate`` a second on a fake clock, with a
reset timeout of 30 s. It prints the keys the fallback holds at the end (``held_keys``), the
keys it still keeps (held, and those not swept yet: the sweep runs once per doubling), what
tracemalloc counts as allocated since the start (the fallback's dictionaries, its in-process
store, the guard's last-known figures), and that divided by the keys kept. ``--max-keys`` is
``DISTLIMIT_FALLBACK_MAX_KEYS`` (default 50,000): a flood faster than the keys of the last minutes
can leave fills it, and the keys kept stop there. docs/failure-modes.md ("Memory of the local
fallback") quotes the figures.

``--app`` sends the logins through a Flask app instead (the Flask test client, one POST each):
``@limiter.limit("5/minute", key_func=<the username>, deduct_when=<a 401>)``, the default
algorithm (the sliding window counter), every one a failed login; what it prints counts
everything the requests left behind, the app's and the limiter's.
"""

from __future__ import annotations

import argparse
import logging
import tracemalloc
from collections.abc import Callable

from flask import Flask, request

from flask_distlimit import Limiter
from flask_distlimit.core.decision import Check
from flask_distlimit.resilience.fallback import DEFAULT_MAX_KEYS, LocalFallback
from flask_distlimit.resilience.guard import Guard
from flask_distlimit.storage.memory import MemoryStorage
from flask_distlimit.testing import FakeClock as EpochClock
from tests.faults import FailingStorage
from tests.guard_helpers import FakeClock


def _guard_logins(rate: float, max_keys: int) -> tuple[Callable[[int], object], LocalFallback]:
    clock = FakeClock(1_700_000_040.0)
    down = FailingStorage(MemoryStorage(), lambda _: True)
    guard = Guard(down, policy="local", clock=clock, reset_timeout=30.0, fallback_max_keys=max_keys)

    def login(i: int) -> object:
        clock.advance(1 / rate)
        key = f"ratelimit:{{user-{i:07d}}}:r:login:5/60:fixed_window"
        now_us = round(clock() * 1_000_000)
        return guard.evaluate([Check(key, "fixed_window", 5, 60)], now_us=now_us)

    return login, guard.fallback


def _app_logins(rate: float, max_keys: int) -> tuple[Callable[[int], object], LocalFallback]:
    clock = EpochClock(1_700_000_040.0)
    app = Flask("fallback-memory")
    app.config.update(
        DISTLIMIT_FAILURE_POLICY="local",
        DISTLIMIT_BREAKER_RESET_TIMEOUT=30,
        DISTLIMIT_FALLBACK_MAX_KEYS=max_keys,
        DISTLIMIT_TIERS={"anonymous": ""},
        SECRET_KEY="bench-secret-" + "x" * 20,
    )
    limiter = Limiter(clock=clock)
    limiter.init_app(app, storage=FailingStorage(MemoryStorage(clock=clock), lambda _: True))

    @app.post("/login")
    @limiter.limit(
        "5/minute",
        key_func=lambda: request.form["user"],
        deduct_when=lambda response: response.status_code == 401,
    )
    def login_view() -> tuple[str, int]:
        return "wrong password", 401

    client = app.test_client()
    for i in range(200):  # warm: imports, the plan, the breaker opened
        client.post("/login", data={"user": f"warm-{i}"})

    def login(i: int) -> object:
        clock.advance(1 / rate)
        return client.post("/login", data={"user": f"user-{i:07d}"})

    return login, limiter.state(app).guard.fallback


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--identities", type=int, default=100_000)
    parser.add_argument("--rate", type=float, default=100.0, help="new identities a second")
    parser.add_argument("--app", action="store_true", help="through a Flask app")
    parser.add_argument("--max-keys", type=int, default=DEFAULT_MAX_KEYS)
    args = parser.parse_args()
    logging.disable(logging.CRITICAL)  # the breaker's trials fail every 30 s of the fake clock
    login, fallback = (_app_logins if args.app else _guard_logins)(args.rate, args.max_keys)
    tracemalloc.start()
    start = tracemalloc.get_traced_memory()[0]
    for i in range(args.identities):
        login(i)
    used, peak = tracemalloc.get_traced_memory()
    used, peak = used - start, peak - start
    held = fallback.held()
    kept = len(fallback._covered)  # held, and those not swept yet (at most 2 x + 1024)
    print(
        f"identities={args.identities} rate={args.rate:g}/s max_keys={args.max_keys} "
        f"outage={args.identities / args.rate:g}s "
        f"held_keys={held} kept_keys={kept} bytes={used} peak_bytes={peak} "
        f"bytes_per_kept_key={used / max(1, kept):.0f}"
    )


if __name__ == "__main__":
    main()
