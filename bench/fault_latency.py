"""The limiter's time during a fault, from runs ``bench/faults.py --dump DIR`` wrote.

    python bench/fault_latency.py DIR [DIR ...]    # one line per run: requests, p50/p90/p99/max

For every ``*.json`` run in each ``DIR``: the requests sent during the fault and their
limiter's time (``X-Limiter-Ms``, the server's wall time, waiting for a CPU included), its
percentiles, and how many took more than ``DISTLIMIT_REDIS_TIMEOUT`` + 10 ms.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.faults import LATENCY_BOUND_MS, load, percentile


def main() -> None:
    print(
        f"| run | requests | p50 ms | p90 ms | p99 ms | max ms | over {LATENCY_BOUND_MS:.0f} ms |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for directory in map(Path, sys.argv[1:]):
        for path in sorted(directory.glob("*.json")):
            run = load(path)
            ms = [s.limiter_ms for s in run.samples if run.fault_start <= s.sent <= run.fault_end]
            cells = [f"{percentile(ms, q):.1f}" for q in (50, 90, 99, 100)]
            over = sum(m > LATENCY_BOUND_MS for m in ms)
            print(f"| {directory.name}/{path.stem} | {len(ms)} | {' | '.join(cells)} | {over} |")


if __name__ == "__main__":
    main()
