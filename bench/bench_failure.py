"""Request latency while Redis is healthy, stalled and dead, per failure policy; the breaker's cost.

    python bench/bench_failure.py                              # ~30 s; prints the tables
    python bench/bench_failure.py --write docs/bench/failure.md

A private redis-server on loopback (started and stopped here) and one Flask app per policy
(``open``, ``closed``, ``local``) with one limit on one route (huge, never reached) and the
production defaults: DISTLIMIT_REDIS_TIMEOUT 0.1 s, DISTLIMIT_BREAKER_FAIL_MAX 5,
DISTLIMIT_BREAKER_RESET_TIMEOUT 30 s. Requests are direct WSGI calls (environ built once with
werkzeug's ``EnvironBuilder``, ``app(environ.copy(), start_response)``), sequential, from a
fresh app for every (state, policy) cell, so each stalled or dead cell starts with a closed
breaker and pays the fail_max timed-out or refused calls that open it:

- healthy: the server answers;
- stalled: the server is SIGSTOPped (accepts connections, never answers): the first 5 requests
  wait the 100 ms timeout, then the breaker is open;
- dead: the server is killed (connection refused at once), restarted afterwards.

Then the breaker alone: ``Guard.evaluate`` with the breaker open (policy open), the cost of
``Breaker.allow()``, and the closed-breaker path (``Guard.evaluate`` minus the bare storage call,
on the healthy server, interleaved rounds).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from flask import Flask
from werkzeug.test import EnvironBuilder

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flask_distlimit import Limiter  # noqa: E402
from flask_distlimit.core.decision import Check, Decision, Evaluation  # noqa: E402
from flask_distlimit.errors import StorageUnavailable  # noqa: E402
from flask_distlimit.resilience.guard import Guard  # noqa: E402
from flask_distlimit.storage.base import Storage  # noqa: E402
from flask_distlimit.storage.urls import from_url  # noqa: E402
from tests.servers import RedisProcess, start_redis  # noqa: E402

POLICIES = ("open", "closed", "local")
COMMAND = "python bench/bench_failure.py --write docs/bench/failure.md"


def make_app(url: str, policy: str) -> Flask:
    app = Flask(f"bench-{policy}")
    app.config.update(
        DISTLIMIT_STORAGE_URL=url,
        DISTLIMIT_FAILURE_POLICY=policy,
        DISTLIMIT_TIERS={"anonymous": ""},
    )
    limiter = Limiter(app)

    @app.get("/")
    @limiter.limit("1000000000/hour")
    def index() -> str:
        return "ok"

    return app


def caller(app: Flask) -> Callable[[], int]:
    environ = EnvironBuilder(path="/", environ_base={"REMOTE_ADDR": "203.0.113.9"}).get_environ()
    status: list[int] = []

    def start_response(s: str, headers: Any, exc_info: Any = None) -> None:
        status.append(int(s[:3]))

    def call() -> int:
        body = app(environ.copy(), start_response)
        for _ in body:
            pass
        close = getattr(body, "close", None)
        if close is not None:
            close()
        return status.pop()

    return call


def measure(call: Callable[[], int], n: int) -> tuple[list[float], dict[int, int]]:
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    for _ in range(n):
        started = time.perf_counter()
        code = call()
        latencies.append(time.perf_counter() - started)
        statuses[code] = statuses.get(code, 0) + 1
    return latencies, statuses


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, round(q / 100 * len(ordered)) - 1)]


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f}"


def latency_table(server: RedisProcess, n: int) -> list[str]:
    rows = [
        "| Redis | policy | requests | p50 ms | p99 ms | max ms | statuses |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for state in ("healthy", "stalled", "dead"):
        for policy in POLICIES:
            app = make_app(server.url, policy)
            call = caller(app)
            measure(call, 50)  # warm: connections, scripts (healthy server)
            if state == "stalled":
                server.signal(signal.SIGSTOP)
            elif state == "dead":
                server.stop()
            try:
                latencies, statuses = measure(call, n)
            finally:
                if state == "stalled":
                    server.signal(signal.SIGCONT)
                elif state == "dead":
                    server.start()
            seen = ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items()))
            rows.append(
                f"| {state} | {policy} | {n} | {fmt_ms(pct(latencies, 50))} | "
                f"{fmt_ms(pct(latencies, 99))} | {fmt_ms(max(latencies))} | {seen} |"
            )
            print(rows[-1], flush=True)
    return rows


def per_call(fn: Callable[[], object], n: int) -> float:
    started = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - started) / n


def breaker_table(server: RedisProcess, rounds: int) -> list[str]:
    checks = [Check("ratelimit:{bench}:r:fixed_window", "fixed_window", 10**9, 3600)]
    storage = from_url(server.url)
    guard = Guard(storage)
    bare_samples: list[float] = []
    guarded_samples: list[float] = []
    for _ in range(rounds):  # interleaved: noise falls on both
        bare_samples.append(per_call(lambda: storage.evaluate(checks), 200))
        guarded_samples.append(per_call(lambda: guard.evaluate(checks), 200))
    bare = statistics.median(bare_samples)
    guarded = statistics.median(guarded_samples)

    dead = Guard(from_url("redis://127.0.0.1:1/0"), policy="open", fail_max=1)
    dead.evaluate(checks)  # refused: the breaker opens
    assert dead.breaker.state == "open"
    open_guard = statistics.median(
        per_call(lambda: dead.evaluate(checks), 20_000) for _ in range(5)
    )
    local = Guard(from_url("redis://127.0.0.1:1/0"), policy="local", fail_max=1)
    local.evaluate(checks)
    open_local = statistics.median(
        per_call(lambda: local.evaluate(checks), 20_000) for _ in range(5)
    )
    allow = statistics.median(per_call(dead.breaker.allow, 100_000) for _ in range(5))
    refused = Guard(from_url("redis://127.0.0.1:1/0"), policy="open", fail_max=10_000)

    def refused_call() -> None:
        with contextlib.suppress(StorageUnavailable):
            refused.storage.evaluate(checks)

    refused_cost = statistics.median(per_call(refused_call, 200) for _ in range(5))
    storage.close()

    class Noop(Storage):  # the guard's pure-Python cost, without any network noise
        scheme = "noop"
        answer = Evaluation((Decision(True, 10**9, 10**9, 0.0, 0.0),))

        def evaluate(self, checks: Sequence[Check], *, now_us: int | None = None) -> Evaluation:
            return self.answer

        def ping(self) -> float:
            return 0.0

        def scan(self, match: str) -> Iterator[str]:
            return iter(())

        def delete(self, keys: Iterable[str]) -> int:
            return 0

        def heartbeat(self, key: str, member: str, ttl: float) -> int:
            return 1

    noop = Noop()
    noop_guard = Guard(noop)
    noop_bare = min(per_call(lambda: noop.evaluate(checks), 50_000) for _ in range(7))
    noop_guarded = min(per_call(lambda: noop_guard.evaluate(checks), 50_000) for _ in range(7))
    return [
        "| what | us per call |",
        "|---|---:|",
        f"| bare storage call (one EVALSHA, healthy Redis) | {bare * 1e6:.1f} |",
        f"| `Guard.evaluate`, breaker closed, same call | {guarded * 1e6:.1f} |",
        f"| difference (network noise included) | {(guarded - bare) * 1e6:.1f} |",
        f"| closed-breaker path alone: `Guard.evaluate` minus the call, in-process no-op "
        f"storage (min of 7 x 50,000) | {(noop_guarded - noop_bare) * 1e6:.2f} |",
        f"| `Guard.evaluate`, breaker open, policy open | {open_guard * 1e6:.2f} |",
        f"| `Guard.evaluate`, breaker open, policy local (in-process decision) | "
        f"{open_local * 1e6:.2f} |",
        f"| `Breaker.allow()` while open | {allow * 1e6:.3f} |",
        f"| one refused connection, without a breaker (what the open breaker saves) | "
        f"{refused_cost * 1e6:.1f} |",
    ]


def render(latency: Iterable[str], breaker: Iterable[str], n: int) -> str:
    return "\n".join(
        [
            "# Benchmark: requests while Redis fails",
            "",
            "Produced by `bench/bench_failure.py` (see its docstring for the method):",
            "",
            f"    {COMMAND}",
            "",
            f"## Request latency by Redis state and failure policy ({n} sequential requests each)",
            "",
            "Direct WSGI calls of a one-limit route, production defaults (timeout 100 ms, fail_max"
            " 5, reset timeout 30 s); each cell starts with a closed breaker.",
            "",
            *latency,
            "",
            "## The breaker's own cost",
            "",
            *breaker,
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--write", type=Path, help="also write the markdown tables here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the breaker's WARNINGs are expected here
    server = start_redis()
    try:
        latency = latency_table(server, args.requests)
        breaker = breaker_table(server, args.rounds)
    finally:
        server.stop()
    text = render(latency, breaker, args.requests)
    print(text)
    if args.write:
        write(args.write, text)


START, END = "<!-- bench_failure.py: start -->", "<!-- bench_failure.py: end -->"


def write(path: Path, text: str, markers: tuple[str, str] = (START, END)) -> None:
    """Replace the generated part of ``path`` (between ``markers``), keeping the rest; a file
    without them gets the block appended (``bench/faults.py`` writes its own block)."""
    start, end = markers
    block = f"{start}\n{text}{end}\n"
    old = path.read_text() if path.exists() else ""
    if start in old and end in old:
        head, _, rest = old.partition(start)
        _, _, tail = rest.partition(end + "\n")
        block = head + block + tail
    elif old:
        block = old.rstrip("\n") + "\n\n" + block
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(block)


if __name__ == "__main__":
    main()
