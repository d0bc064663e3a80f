"""Quota leasing (issue 15): one leased limit side by side with the same limit unleased.

    python bench/leasing.py --rounds 7 --seconds 4 --write docs/bench/leasing.md

Three measurements, each in interleaved rounds (every round runs the leased and the unleased
subject once, in a shuffled order; ratios are taken within a round and the median over the
rounds is reported, with its 95 % confidence interval in square brackets and the lowest and
highest round in round brackets):

1. **Storage calls per request, under gunicorn.** A private redis-server on loopback and one
   gunicorn instance of ``tests/apps/leasing_app.py`` (3 gthread workers x 4 threads, as
   ``tests/extension/test_gunicorn.py`` launches it): ``/leased`` is a shared fixed window
   ``lease=True``, ``/plain`` the same limit on its own key, unleased; the limit (``--limit``,
   10^8/minute) is never reached, so every request is admitted. ``wrk`` (1 thread, 16 connections)
   loads one route at a time for ``--seconds`` at its full rate. Storage calls are the server's
   ``EVALSHA`` calls (``INFO commandstats``: renewals, and the lease records each worker
   publishes at most once a second), divided by the requests ``wrk`` completed; also
   requests per second and wrk's median latency.
2. **Admissions per window against the limit, under gunicorn.** ``/tight`` (``--tight``,
   200/second, leased) loaded by ``wrk`` above its limit for ``--seconds``; every admission is
   counted in Redis per window of the host's clock (the Redis server's: one host), by the window
   it was in from before the limiter decided (a ``before_request`` hook) to the view; the few that
   crossed a window's end on the way are *straddling* (decided in that window or the one before)
   and counted apart. Reported: for each whole window (the first and last, partly loaded, left
   out), the admissions certainly in it and the straddling ones that may be, against the limit
   and the stated under-admission bound (processes x the largest lease).
3. **The limiter's own time per request (p50), in-process.** gunicorn's timings include the
   server, the client and the machine's two cores shared by all of them, which drown a
   difference of some microseconds; so, as ``bench/bench_overhead.py`` does, three apps are
   called as WSGI apps in this process (the environ built once, ``app(environ.copy(),
   start_response)``), on the same redis-server: the bare Flask app, the leased limit and the
   unleased one (same limit, same options). In a round the subjects are called in turn, one
   request each, ``--batch`` times (the order shuffled per round), so that a burst of load from
   elsewhere on the machine hits them alike; an app's time in a round is the median of its
   requests, its overhead that minus the bare app's in the same round; the ratio leased /
   unleased is taken within each round (``--overhead-rounds`` rounds). A fourth subject, the
   leased app with ``Leases.spend_one`` (a request spent out of its lease) replaced by a
   constant decision, splits the leased overhead into the lease's own work and the rest of the
   request path (gate, identity, checks, report, headers), which every request pays.

Goals (issue 15): <= 0.05 storage calls per request on the leased route; leased p50 overhead
<= 0.2x the unleased one; admissions per window <= the limit, >= the limit minus the bound.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_overhead import Ratio, bare_app, wsgi_caller  # noqa: E402

from flask_distlimit.core.limits import parse_rates  # noqa: E402
from flask_distlimit.declare.lease_options import auto_cap  # noqa: E402

LIMIT = "100000000/minute"  # never reached in measurements 1 and 3
TIGHT = "200/second"
PROCESSES = 3  # gunicorn workers of the instance
WRK_CONNECTIONS = 16
GOAL_CALLS = 0.05
GOAL_OVERHEAD = 0.2


def _commandstats(client: Any) -> tuple[int, int]:
    """(EVALSHA calls, every command processed) of the server so far."""
    stats = client.info("commandstats")
    evalsha = int(stats.get("cmdstat_evalsha", {}).get("calls", 0))
    total = int(client.info("stats")["total_commands_processed"])
    return evalsha, total


def wrk(port: int, path: str, seconds: float) -> tuple[int, int, float, float]:
    """(requests, non-2xx responses, requests per second, median latency in ms) of one run."""
    out = subprocess.run(
        [
            "wrk", "-t1", f"-c{WRK_CONNECTIONS}", f"-d{seconds:g}s", "--timeout", "5s",
            "--latency", f"http://127.0.0.1:{port}{path}",
        ],
        capture_output=True, text=True, check=True, timeout=seconds + 60,
    ).stdout  # fmt: skip
    done = re.search(r"(\d+) requests in", out)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    p50 = re.search(r"50%\s+([\d.]+)(us|ms|s)\b", out)
    if done is None or rps is None or p50 is None:
        raise RuntimeError(f"unexpected wrk output:\n{out}")
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    scale = {"us": 0.001, "ms": 1.0, "s": 1000.0}[p50.group(2)]
    return (
        int(done.group(1)),
        int(non2xx.group(1)) if non2xx else 0,
        float(rps.group(1)),
        float(p50.group(1)) * scale,
    )


@dataclass
class Route:
    path: str
    calls: list[float] = field(default_factory=list)  #: storage calls per request, per round
    commands: list[float] = field(default_factory=list)
    rps: list[float] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)


@dataclass
class Gunicorn:
    routes: dict[str, Route]
    #: admissions of each whole window of /tight: (certainly in it, straddling its ends)
    windows: list[tuple[int, int]]
    tight_requests: int
    bound: int
    tight_rps: float


def run_gunicorn(rounds: int, seconds: float, limit: str, tight: str, seed: int = 5) -> Gunicorn:
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is needed: apt-get install -y wrk")
    from tests.gunicorn_servers import launch, wait_ready
    from tests.servers import start_redis

    redis_server = start_redis()
    client = redis_server.client()
    prefix = f"bench-lease-{os.getpid()}"
    env = {
        "DISTLIMIT_STORAGE_URL": redis_server.url,
        "LEASING_LIMIT": limit,
        "LEASING_TIGHT": tight,
        "LEASING_PREFIX": prefix,
        "LEASING_LEASE": "true",
    }
    routes = {"leased": Route("/leased"), "plain": Route("/plain")}
    with tempfile.TemporaryDirectory(prefix="bench-lease-") as logdir:
        server = launch("tests.apps.leasing_app:app", env, Path(logdir))
        try:
            wait_ready(server)
            for route in routes.values():  # warm-up: connections, scripts, lease sizes
                wrk(server.port, route.path, 1)
            rng = random.Random(seed)
            order = list(routes)
            for number in range(rounds):
                rng.shuffle(order)
                for name in order:
                    route = routes[name]
                    before = _commandstats(client)
                    done, non2xx, rps, p50 = wrk(server.port, route.path, seconds)
                    after = _commandstats(client)
                    if non2xx:
                        raise RuntimeError(f"{route.path}: {non2xx} responses other than 200")
                    route.calls.append((after[0] - before[0]) / done)
                    route.commands.append((after[1] - before[1]) / done)
                    route.rps.append(rps)
                    route.latency_ms.append(p50)
                line = ", ".join(
                    f"{n} {routes[n].rps[-1]:,.0f} req/s {routes[n].calls[-1]:.4f} calls/req"
                    for n in routes
                )
                print(f"  round {number + 1}/{rounds}: {line}", file=sys.stderr)
            # Admissions per window: /tight above its limit.
            rate = parse_rates(tight)[0]
            start = time.time()
            tight_requests, _, tight_rps, _ = wrk(
                server.port, "/tight", max(seconds, 3 * rate.period)
            )
            first, last = int(start) // rate.period, int(time.time()) // rate.period
            windows = [
                (
                    int(client.get(f"{prefix}:admitted:{w}") or 0),
                    int(client.get(f"{prefix}:straddled:{w}") or 0)
                    + int(client.get(f"{prefix}:straddled:{w + 1}") or 0),
                )
                for w in range(first + 1, last)
            ]
        finally:
            server.stop()
            client.close()
            redis_server.stop()
    bound = PROCESSES * auto_cap(parse_rates(tight)[0].amount)
    return Gunicorn(routes, windows, tight_requests, bound, tight_rps)


@dataclass
class Overhead:
    bare: list[float] = field(default_factory=list)
    leased: list[float] = field(default_factory=list)
    plain: list[float] = field(default_factory=list)
    stub: list[float] = field(default_factory=list)
    calls_leased: float = 0.0


def _app(url: str, limit: str, lease: bool, prefix: str) -> Any:
    from flask import Flask

    from flask_distlimit import Limiter

    app = Flask(f"bench-{prefix}")
    app.config.update(
        DISTLIMIT_STORAGE_URL=url,
        DISTLIMIT_TIERS={"anonymous": ""},
        DISTLIMIT_KEY_PREFIX=prefix,
        DISTLIMIT_HEADERS="both",
    )
    limiter = Limiter(app)

    def view() -> str:
        return "ok"

    limited = limiter.shared_limit(
        limit, scope="hot", key_func=lambda: "everyone", algorithm="fixed_window", lease=lease
    )(view)
    app.add_url_rule("/", view_func=limited)
    return app


def run_overhead(rounds: int, batch: int, limit: str, seed: int = 7) -> Overhead:
    from tests.servers import start_redis

    redis_server = start_redis()
    client = redis_server.client()
    result = Overhead()
    try:
        from flask_distlimit.core.decision import Decision

        stub = _app(redis_server.url, limit, True, "stub")
        answer = Decision(True, 10**8, 10**8 - 1, 30.0, 0.0)
        stub.extensions["distlimit"].enforcer.leases.spend_one = lambda check: answer
        subjects = {
            "bare": wsgi_caller(bare_app())[0],
            "leased": wsgi_caller(_app(redis_server.url, limit, True, "leased"))[0],
            "plain": wsgi_caller(_app(redis_server.url, limit, False, "plain"))[0],
            "stub": wsgi_caller(stub)[0],
        }
        for call in subjects.values():  # warm up; the lease sizes itself from this traffic
            for _ in range(2000):
                call()
        before = _commandstats(client)[0]
        for _ in range(batch):
            subjects["leased"]()
        result.calls_leased = (_commandstats(client)[0] - before) / batch
        rng = random.Random(seed)
        order = list(subjects)
        clock = time.perf_counter_ns
        for _ in range(rounds):
            rng.shuffle(order)
            calls = [(name, subjects[name]) for name in order]
            samples: dict[str, list[int]] = {name: [] for name in order}
            gc.collect()
            gc.disable()
            try:
                for _ in range(batch):  # one call of each subject in turn: noise hits all
                    for name, call in calls:
                        started = clock()
                        call()
                        samples[name].append(clock() - started)
            finally:
                gc.enable()
            for name in order:
                getattr(result, name).append(statistics.median(samples[name]) / 1000)
    finally:
        client.close()
        redis_server.stop()
    return result


def table(g: Gunicorn | None, o: Overhead | None, args: argparse.Namespace) -> tuple[str, bool]:
    lines: list[str] = []
    met = True
    if g is not None:
        leased, plain = g.routes["leased"], g.routes["plain"]
        calls = (
            f"{statistics.median(leased.calls):.4f} ({min(leased.calls):.4f}-"
            f"{max(leased.calls):.4f})"
        )
        lines += [
            f"**Under gunicorn** (one instance, 3 gthread workers x 4 threads; wrk -t1 "
            f"-c{WRK_CONNECTIONS}, {args.seconds:g} s per route per round, {args.rounds} rounds; "
            f"limit {args.limit}, fixed window, never reached):",
            "",
            "| route | storage calls / request | Redis commands / request | requests/s "
            "| wrk p50 latency |",
            "|---|---|---|---:|---:|",
            f"| leased (`lease=True`) | {calls} | {statistics.median(leased.commands):.4f} "
            f"| {statistics.median(leased.rps):,.0f} "
            f"| {statistics.median(leased.latency_ms):.2f} ms |",
            f"| unleased | {statistics.median(plain.calls):.4f} "
            f"| {statistics.median(plain.commands):.4f} | {statistics.median(plain.rps):,.0f} "
            f"| {statistics.median(plain.latency_ms):.2f} ms |",
            "",
            f"Requests/s leased / unleased, within rounds: "
            f"{Ratio.of(leased.rps, plain.rps).text()}.",
            "",
        ]
        ok = statistics.median(leased.calls) <= GOAL_CALLS
        met = met and ok
        lines.append(
            f"- storage calls per request on the leased route: "
            f"{statistics.median(leased.calls):.4f} (goal <= {GOAL_CALLS}): "
            f"{'met' if ok else 'NOT met'}"
        )
        limit = parse_rates(args.tight)[0].amount
        if g.windows:
            over = max(sure for sure, _ in g.windows) <= limit
            under = min(sure + maybe for sure, maybe in g.windows) >= limit - g.bound
            met = met and over and under
            shown = ", ".join(f"{sure} (+{maybe} straddling)" for sure, maybe in g.windows)
            lines += [
                f"- admissions per whole window of `/tight` ({args.tight}, leased, "
                f"{g.tight_requests:,} requests at {g.tight_rps:,.0f}/s, over "
                f"{len(g.windows) + 2} windows): {shown}; certainly in the window: at most "
                f"{limit}: {'met' if over else 'NOT met'}; with the straddling: at least "
                f"{limit} - {g.bound} (the bound: {PROCESSES} processes x "
                f"{g.bound // PROCESSES} units): {'met' if under else 'NOT met'}",
            ]
        lines.append("")
    if o is not None:
        bare = statistics.median(o.bare)
        leased_over = [x - b for x, b in zip(o.leased, o.bare, strict=True)]
        plain_over = [x - b for x, b in zip(o.plain, o.bare, strict=True)]
        stub_over = [x - b for x, b in zip(o.stub, o.bare, strict=True)]
        lease_own = [x - b for x, b in zip(o.leased, o.stub, strict=True)]
        ratio = Ratio.of(leased_over, plain_over)
        ok = ratio.median <= GOAL_OVERHEAD
        met = met and ok
        lines += [
            f"**The limiter's own time per request, in-process** (WSGI calls in turn, "
            f"{args.batch} per subject, {args.overhead_rounds} rounds, headers `both`; the bare "
            f"app: {bare:.1f} us):",
            "",
            "| subject | p50 overhead over the bare app | storage calls / request |",
            "|---|---:|---:|",
            f"| leased (`lease=True`) | {statistics.median(leased_over):.1f} us "
            f"| {o.calls_leased:.4f} |",
            f"| unleased | {statistics.median(plain_over):.1f} us | 1 |",
            f"| leased, the lease's work replaced by a constant decision "
            f"| {statistics.median(stub_over):.1f} us | 0 |",
            "",
            f"- the lease's own work per request (leased - stubbed, within rounds): "
            f"{statistics.median(lease_own):.1f} us; the rest of the leased overhead is the "
            f"request path every request pays: {Ratio.of(stub_over, plain_over).text()} of the "
            "unleased overhead",
            f"- leased / unleased overhead, within rounds: {ratio.text()} (goal <= "
            f"{GOAL_OVERHEAD}): {'met' if ok else 'NOT met'}",
            "",
        ]
    return "\n".join(lines), met


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--overhead-rounds", type=int, default=15)
    parser.add_argument("--limit", default=LIMIT)
    parser.add_argument("--tight", default=TIGHT)
    parser.add_argument("--no-gunicorn", action="store_true", help="only the in-process part")
    parser.add_argument("--write", type=Path, help="write the report (Markdown) to this file")
    args = parser.parse_args()
    o = run_overhead(args.overhead_rounds, args.batch, args.limit)
    g = None if args.no_gunicorn else run_gunicorn(args.rounds, args.seconds, args.limit,
                                                   args.tight)  # fmt: skip
    text, met = table(g, o, args)
    print(text)
    if args.write is not None:
        command = "python bench/leasing.py " + " ".join(sys.argv[1:])
        method = (__doc__ or "").split("\n\n", 2)[2]  # after the title and the command
        args.write.write_text(
            f"# Quota leasing: leased against unleased\n\n"
            f"Command (from the repository root; it starts and stops its own `redis-server` and "
            f"gunicorn):\n\n    {command}\n\n"
            f"Run {datetime.date.today().isoformat()} on {os.cpu_count()} cores shared with "
            f"other work.\n\n## Results\n\n{text}\n## Method\n\n{method}",
            encoding="utf-8",
        )
    sys.exit(0 if met else 1)


if __name__ == "__main__":
    main()
