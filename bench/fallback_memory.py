"""Memory of the local fallback through a long outage: bytes per key held, with tracemalloc.

    PYTHONPATH=. python bench/fallback_memory.py                 # 100,000 identities
    PYTHONPATH=. python bench/fallback_memory.py --identities 300000 --rate 200

A guard under policy ``local`` whose storage fails every call (``memory://`` behind a failing
wrapper: no server needed, the fallback's work is the same) meets ``--identities`` identities,
one login each (a fixed window of 5 per minute), ``--rate`` a second on a fake clock, with a
reset timeout of 30 s. It prints the keys the fallback holds at the end (``held_keys``), the
keys it still keeps (held, and those not swept yet: the sweep runs once per doubling), what
tracemalloc counts as allocated since the start (the fallback's dictionaries, its in-process
store, the guard's last-known figures), and that divided by the keys kept. docs/failure-modes.md
("Memory of the local fallback") quotes the figures.
"""

from __future__ import annotations

import argparse
import logging
import tracemalloc

from flask_distlimit.decision import Check
from flask_distlimit.guard import Guard
from flask_distlimit.storage.memory import MemoryStorage
from tests.faults import FailingStorage
from tests.guard_helpers import FakeClock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--identities", type=int, default=100_000)
    parser.add_argument("--rate", type=float, default=100.0, help="new identities a second")
    args = parser.parse_args()
    logging.disable(logging.CRITICAL)  # the breaker's trials fail every 30 s of the fake clock
    clock = FakeClock(1_700_000_040.0)
    down = FailingStorage(MemoryStorage(), lambda _: True)
    guard = Guard(down, policy="local", clock=clock, reset_timeout=30.0)
    tracemalloc.start()
    start = tracemalloc.get_traced_memory()[0]
    for i in range(args.identities):
        clock.advance(1 / args.rate)
        key = f"ratelimit:{{user-{i:07d}}}:r:login:5/60:fixed_window"
        guard.evaluate([Check(key, "fixed_window", 5, 60)], now_us=round(clock() * 1_000_000))
    used = tracemalloc.get_traced_memory()[0] - start
    held = guard.fallback.held()
    kept = len(guard.fallback._covered)  # held, and those not swept yet (at most 2 x + 1024)
    print(
        f"identities={args.identities} rate={args.rate:g}/s "
        f"outage={args.identities / args.rate:g}s "
        f"held_keys={held} kept_keys={kept} bytes={used} "
        f"bytes_per_kept_key={used / max(1, kept):.0f}"
    )


if __name__ == "__main__":
    main()
