"""What meta limits cost the script: Redis's own time per call (INFO commandstats).

    python bench/bench_meta.py                 # ~20 s
    python bench/bench_meta.py --main /work/main   # also main's script on the same calls

A private redis-server (loopback, no persistence). Rows: 1 check and 2 checks with no meta
limit (this tree's script, and main's when ``--main`` names a checkout: the price of the
meta code for apps that configure none), and 2 checks plus 1 meta check (admitted requests:
the meta check is decided, never written). Clients rotate over 1,000 identities with limits
never reached. Each of 15 rounds runs 1,000 calls of every row, in a shuffled order; the
median of the rounds' ``usec_per_call`` is reported (docs/bench/engine.md, "Meta limits").
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time

import redis

from flask_distlimit.core.decision import Check
from flask_distlimit.engine.scripts import SCRIPT_SOURCE, script_args

CALLS, ROUNDS = 1000, 15


def main_source(path: str) -> str:
    """``SCRIPT_SOURCE`` of the checkout at ``path`` (run in a subprocess: its own modules)."""
    code = "from flask_distlimit.engine.scripts import SCRIPT_SOURCE as s; print(s, end='')"
    return subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": path},
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def checks(i: int, routes: int, meta: bool) -> list[Check]:
    tag = f"bench:{{c{i % 1000}}}"
    made = [Check(f"{tag}:r{n}", "sliding_window_counter", 10**9, 60) for n in range(routes)]
    if meta:
        made.append(Check(f"{tag}:m", "sliding_window_counter", 2, 3600, meta=True))
    return made


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--main", help="a checkout whose script to compare (no meta code)")
    args = parser.parse_args()
    assert importlib.util.find_spec("flask_distlimit")
    port = 16479
    with tempfile.TemporaryDirectory() as work:
        server = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                work,
            ],
            stdout=subprocess.DEVNULL,
        )
        try:
            client = redis.Redis(port=port)
            for _ in range(100):
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.05)
            scripts = {"ours": client.register_script(SCRIPT_SOURCE)}
            if args.main:
                scripts["main"] = client.register_script(main_source(args.main))
            rows = [
                (f"{name}: {routes} check(s)", scripts[name], routes, False)
                for name in scripts
                for routes in (1, 2)
            ]
            rows.append(("ours: 2 checks + 1 meta", scripts["ours"], 2, True))
            figures: dict[str, list[float]] = {r[0]: [] for r in rows}
            for _ in range(ROUNDS):
                random.shuffle(rows)
                for label, script, routes, meta in rows:
                    client.config_resetstat()
                    for i in range(CALLS):
                        keys, argv = script_args(checks(i, routes, meta))
                        script(keys=keys, args=argv)
                    stats = client.info("commandstats")["cmdstat_evalsha"]
                    figures[label].append(stats["usec_per_call"])
            for label, values in figures.items():
                q = statistics.quantiles(values, n=4)
                print(
                    f"{label:28s} {statistics.median(values):6.2f} us/call (Redis), "
                    f"IQR {q[0]:.2f}-{q[2]:.2f}"
                )
        finally:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
