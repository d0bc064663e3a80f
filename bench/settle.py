"""What ``settle=`` costs (issue 35 item 5): the same limit with and without a settlement.

    python bench/settle.py --rounds 5 --seconds 4

One gunicorn instance of ``tests/apps/settle_bench_app.py`` (3 gthread workers x 4 threads) on
a private redis-server, loaded by ``wrk`` (1 thread, 16 connections) one route at a time, in
interleaved rounds (the order shuffled per round): ``/plain`` reserves 10 units of a limit
that is never reached; ``/settled`` the same, settled to 7 after each response (a release of
3: one more script call). Per route: Redis ``EVALSHA`` calls and Redis CPU (``INFO
commandstats``, ``usec``) per request, and requests per second; the median over the rounds,
and the ratio settled / plain taken within each round.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from leasing import wrk  # noqa: E402


def _evalsha(client: Any) -> tuple[int, int]:
    """(EVALSHA calls, their Redis CPU in us) of the server so far."""
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0)), int(stats.get("usec", 0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is needed: apt-get install -y wrk")
    from tests.gunicorn_servers import launch, wait_ready
    from tests.servers import start_redis

    redis_server = start_redis()
    client = redis_server.client()
    seen: dict[str, dict[str, list[float]]] = {
        p: {"calls": [], "usec": [], "rps": []} for p in ("/plain", "/settled")
    }
    ratios: dict[str, list[float]] = {"usec": [], "rps": []}
    with tempfile.TemporaryDirectory(prefix="bench-settle-") as logdir:
        env = {"DISTLIMIT_STORAGE_URL": redis_server.url}
        server = launch("tests.apps.settle_bench_app:app", env, Path(logdir))
        try:
            wait_ready(server)
            for path in seen:  # warm-up: connections, scripts
                wrk(server.port, path, 1)
            order = list(seen)
            rng = random.Random(11)
            for number in range(args.rounds):
                rng.shuffle(order)
                for path in order:
                    before = _evalsha(client)
                    done, non2xx, rps, _ = wrk(server.port, path, args.seconds)
                    after = _evalsha(client)
                    if non2xx:
                        raise RuntimeError(f"{path}: {non2xx} responses other than 200")
                    seen[path]["calls"].append((after[0] - before[0]) / done)
                    seen[path]["usec"].append((after[1] - before[1]) / done)
                    seen[path]["rps"].append(rps)
                for key in ratios:
                    ratios[key].append(seen["/settled"][key][-1] / seen["/plain"][key][-1])
                print(f"  round {number + 1}/{args.rounds} done", file=sys.stderr)
        finally:
            server.stop()
            client.close()
            redis_server.stop()
    print("| route | EVALSHA calls / request | Redis CPU us / request | requests/s |")
    print("|---|---|---|---|")
    for path, values in seen.items():
        print(
            f"| `{path}` | {statistics.median(values['calls']):.2f} | "
            f"{statistics.median(values['usec']):.1f} | {statistics.median(values['rps']):,.0f} |"
        )
    usec, rps = statistics.median(ratios["usec"]), statistics.median(ratios["rps"])
    print(
        f"\nsettled / plain, median of the rounds: Redis CPU per request {usec:.2f}x, "
        f"requests/s {rps:.2f}x"
    )


if __name__ == "__main__":
    main()
