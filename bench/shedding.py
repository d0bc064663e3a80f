"""Load shedding by priority under overload: with and without shedding, the same ramp.

    python bench/shedding.py                 # about 3 minutes; writes docs/bench/shedding.md
                                             # and docs/img/shedding.png
    python bench/shedding.py --ramp 20 --no-write   # a quick look

All on 127.0.0.1; the script starts and stops every process itself, by PID:

1. one private redis-server and one gunicorn instance of the app below (3 gthread workers x 4
   threads = 12 request threads);
2. the handler's cost rises with load: it waits ``BASE_MS * (1 + SLOPE * others)`` where
   ``others`` is the number of requests in flight in its process besides itself (contention on
   a shared resource: a database, a lock, a cache);
3. an open-loop client sends a mixed workload (10% critical, 60% default, 30% sheddable) at an
   offered rate ramped from ``RAMP_FROM`` to ``RAMP_TO`` times the capacity (the rate the
   instance serves with every thread busy), each request with a deadline of ``DEADLINE`` s: an
   answer after it, or none, is a failure for the client;
4. twice: without shedding (the limiter declares nothing), then with
   ``DISTLIMIT_WORKER_THREADS=4`` (worker-utilization shedding) and
   ``DISTLIMIT_FLEET_CAPACITY=12`` (fleet usage, in Redis);
5. reports, per priority and second, goodput (200s within the deadline per second) and success
   rate, plotted, and a table per load level.

Numbers depend on the machine; the shape does not.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.servers import free_port, gunicorn_command, start_redis  # noqa: E402

PRIORITIES = ("critical", "default", "sheddable")
MIX = {"critical": 0.10, "default": 0.60, "sheddable": 0.30}
WORKERS, THREADS = 3, 4
BASE_MS = 100.0
SLOPE = 0.5  # each other request in flight in the process adds half the base cost
#: Requests per second the instance serves with every thread busy.
CAPACITY_RPS = WORKERS * THREADS / (BASE_MS / 1000 * (1 + SLOPE * (THREADS - 1)))
RAMP_FROM, RAMP_TO = 0.5, 3.0
DEADLINE = 1.0  # seconds: the client gives up then
CLIENT_THREADS = 256


# -- the app (gunicorn imports this module: bench.shedding:create_app()) ------------------------


def create_app() -> object:
    from flask import Flask, request

    from flask_distlimit import Limiter

    app = Flask("shedding-bench")
    app.config.update(
        DISTLIMIT_STORAGE_URL=os.environ["DISTLIMIT_STORAGE_URL"],
        DISTLIMIT_KEY_PREFIX="shedding-bench",
        DISTLIMIT_REDIS_TIMEOUT=1.0,
    )
    if os.environ.get("BENCH_SHEDDING") == "1":
        app.config.update(
            DISTLIMIT_WORKER_THREADS=THREADS, DISTLIMIT_FLEET_CAPACITY=WORKERS * THREADS
        )
    limiter = Limiter(app)

    @limiter.priority_resolver
    def from_query() -> str | None:
        return request.args.get("p")

    lock = threading.Lock()
    in_flight = [0]

    @app.get("/work")
    def work() -> str:
        with lock:
            others = in_flight[0]
            in_flight[0] += 1
        try:
            time.sleep(BASE_MS / 1000 * (1 + SLOPE * others))
        finally:
            with lock:
                in_flight[0] -= 1
        return "done"

    return app


# -- the run ------------------------------------------------------------------------------------


@dataclass
class Result:
    sent: float  # seconds since the start
    priority: str
    status: int  # 0: no answer within the deadline (or a connection error)
    elapsed: float


@contextlib.contextmanager
def gunicorn(redis_url: str, shedding: bool, logdir: Path) -> Iterator[int]:
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "DISTLIMIT_STORAGE_URL": redis_url,
        "BENCH_SHEDDING": "1" if shedding else "0",
    }
    cmd = gunicorn_command(
        "--bind", f"127.0.0.1:{port}",
        "--workers", str(WORKERS),
        "--worker-class", "gthread",
        "--threads", str(THREADS),
        "--backlog", "2048",
        "--log-level", "warning",
        "bench.shedding:create_app()",
    )  # fmt: skip
    log = logdir / f"gunicorn-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if _get(port, "/work?p=critical", 5.0)[0] == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gunicorn did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield port
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _get(port: int, path: str, timeout: float) -> tuple[int, float]:
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return response.status, time.monotonic() - started
    finally:
        conn.close()


def run(port: int, ramp: float, seed: int) -> list[Result]:
    """Open loop: request i is sent at its scheduled time whatever the answers so far."""
    rng = random.Random(seed)
    schedule: list[tuple[float, str]] = []
    t = 0.0
    while t < ramp:
        rate = CAPACITY_RPS * (RAMP_FROM + (RAMP_TO - RAMP_FROM) * t / ramp)
        t += rng.expovariate(rate)
        r = rng.random()
        priority = "critical" if r < MIX["critical"] else "default" if r < 0.70 else "sheddable"
        schedule.append((t, priority))
    results: list[Result] = []
    lock = threading.Lock()
    jobs = iter(schedule)
    jobs_lock = threading.Lock()
    start = time.monotonic()

    def client() -> None:
        while True:
            with jobs_lock:
                job = next(jobs, None)
            if job is None:
                return
            at, priority = job
            delay = start + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            try:
                status, elapsed = _get(port, f"/work?p={priority}", DEADLINE)
                if elapsed > DEADLINE:
                    status = 0
            except OSError:
                status, elapsed = 0, DEADLINE
            with lock:
                results.append(Result(at, priority, status, elapsed))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(CLIENT_THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return results


# -- the report ---------------------------------------------------------------------------------


def per_second(results: list[Result], ramp: float) -> dict[str, list[tuple[int, int]]]:
    """priority -> [(ok, sent) per second]."""
    seconds = int(ramp) + 1
    out = {p: [(0, 0)] * seconds for p in PRIORITIES}
    for r in results:
        s = min(int(r.sent), seconds - 1)
        ok, sent = out[r.priority][s]
        out[r.priority][s] = (ok + (r.status == 200), sent + 1)
    return out


def table(runs: dict[str, list[Result]], ramp: float) -> str:
    levels = [(0.5, 1.0), (1.0, 1.5), (1.5, 2.0), (2.0, 2.5), (2.5, 3.0)]
    lines = [
        "| shedding | offered load (x capacity) | critical | default | sheddable "
        "| goodput (200/s) |",
        "|---|---|---|---|---|---|",
    ]
    for name, results in runs.items():
        for lo, hi in levels:
            t0 = (lo - RAMP_FROM) / (RAMP_TO - RAMP_FROM) * ramp
            t1 = (hi - RAMP_FROM) / (RAMP_TO - RAMP_FROM) * ramp
            part = [r for r in results if t0 <= r.sent < t1]
            cells = []
            for p in PRIORITIES:
                mine = [r for r in part if r.priority == p]
                rate = sum(r.status == 200 for r in mine) / len(mine) if mine else float("nan")
                cells.append(f"{rate:.1%}")
            goodput = sum(r.status == 200 for r in part) / max(t1 - t0, 1e-9)
            lines.append(f"| {name} | {lo}-{hi} | {' | '.join(cells)} | {goodput:.0f} |")
    return "\n".join(lines)


def plot(runs: dict[str, list[Result]], ramp: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 7), sharex=True)
    colors = {"critical": "tab:red", "default": "tab:blue", "sheddable": "tab:gray"}
    for col, (name, results) in enumerate(runs.items()):
        series = per_second(results, ramp)
        xs = [RAMP_FROM + (RAMP_TO - RAMP_FROM) * (s + 0.5) / ramp for s in range(int(ramp) + 1)]
        for p in PRIORITIES:
            ok = [o for o, _ in series[p]]
            rate = [o / n if n else float("nan") for o, n in series[p]]
            axes[0][col].plot(xs, ok, label=p, color=colors[p])
            axes[1][col].plot(xs, rate, label=p, color=colors[p])
        axes[0][col].set_title(f"{name}: goodput (200 within {DEADLINE:g} s, per second)")
        axes[1][col].set_title(f"{name}: success rate")
        axes[1][col].set_ylim(-0.02, 1.02)
        axes[1][col].set_xlabel("offered load (x capacity)")
        axes[0][col].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


PAGE = """# Load shedding under overload

One gunicorn instance ({workers} gthread workers x {threads} threads) whose handler waits
{base:g} ms x (1 + {slope:g} x the other requests in flight in its process): its cost rises with
load, as it does in front of a shared database. Capacity, the rate it serves with every thread
busy: about {capacity:.0f} requests/s. An open-loop client sends 10% critical, 60% default and
30% sheddable requests (the priority from `?p=`, through a `@limiter.priority_resolver`) at an
offered rate ramped from {ramp_from:g}x to {ramp_to:g}x the capacity over {ramp:g} s; an answer
later than {deadline:g} s, or none, is a failure. The same ramp runs twice: without shedding (the
limiter declares nothing), and with `DISTLIMIT_WORKER_THREADS={threads}` (worker utilization)
and `DISTLIMIT_FLEET_CAPACITY={fleet}` (fleet usage, in Redis) at their default thresholds.

Reproduce (about 3 minutes; starts and stops its own redis-server and gunicorn on 127.0.0.1):

    python bench/shedding.py

Measured on a shared 2-core machine that also runs the client (Python threads): the client's
own CPU use is part of the overload. The shape, not the numbers, is the point.

![Goodput and success rate per priority, without and with shedding](../img/shedding.png)

## Success rate per priority and load level

{table}

{summary}
"""


def summary(runs: dict[str, list[Result]], ramp: float) -> str:
    """One sentence per run: the success rate of each priority above 1x capacity."""
    t1 = (1.0 - RAMP_FROM) / (RAMP_TO - RAMP_FROM) * ramp
    parts = []
    for name, results in runs.items():
        over = [r for r in results if r.sent >= t1]
        rates = []
        for p in PRIORITIES:
            mine = [r for r in over if r.priority == p]
            ok = sum(r.status == 200 for r in mine)
            rates.append(f"{p} {ok / len(mine):.1%}" if mine else f"{p} -")
        parts.append(f"- **{name} shedding**, above 1x capacity: " + ", ".join(rates) + ".")
    return "\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ramp", type=float, default=40.0, help="seconds of the ramp")
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    redis = start_redis()
    runs: dict[str, list[Result]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="distlimit-shedding-") as logdir:
            for name, shedding in (("without", False), ("with", True)):
                redis.client().flushall()
                with gunicorn(redis.url, shedding, Path(logdir)) as port:
                    runs[name] = run(port, args.ramp, args.seed)
    finally:
        redis.stop()
    text = table(runs, args.ramp)
    print(f"capacity ~ {CAPACITY_RPS:.0f} requests/s; ramp {RAMP_FROM}x -> {RAMP_TO}x over "
          f"{args.ramp:g} s; deadline {DEADLINE:g} s")  # fmt: skip
    print(text)
    if not args.no_write:
        plot(runs, args.ramp, ROOT / "docs" / "img" / "shedding.png")
        page = PAGE.format(
            capacity=CAPACITY_RPS,
            workers=WORKERS,
            threads=THREADS,
            base=BASE_MS,
            slope=SLOPE,
            ramp_from=RAMP_FROM,
            ramp_to=RAMP_TO,
            ramp=args.ramp,
            deadline=DEADLINE,
            table=text,
            fleet=WORKERS * THREADS,
            summary=summary(runs, args.ramp),
        )
        (ROOT / "docs" / "bench" / "shedding.md").write_text(page, encoding="utf-8")


if __name__ == "__main__":
    main()
