"""Many requests in flight per process (issue 23): gthread and gevent, ours against the others.

    python bench/bench_inflight.py                                  # every level, 3 rounds
    python bench/bench_inflight.py --levels 300 --workers gevent --rounds 5 --seconds 3
    python bench/bench_inflight.py --kinds ours,ours-pool,minimal   # batching against a pool

For each worker class (``gthread``: ``-w 1 -k gthread --threads L``; ``gevent``: ``-w 1 -k
gevent --worker-connections max(L, 1000)``) and each level L of requests in flight per process
(``wrk -t2 -cL``: L connections, each with one request outstanding; an ``after_request`` hook
holds every answer ``--hold`` ms after the limiter admitted or refused it, so that L are in
flight at once), one
gunicorn per run serves one limiter, all on a private redis-server on loopback:

- ``ours``: Flask-DistLimit, its default configuration (batched calls, storage/pipeline.py);
- ``ours-pool``: the same with batching off and the pool sized from the concurrency (one
  connection per call in flight, ``max_connections`` = L): the alternative the pipeline's
  module docstring weighs;
- ``flask-limiter``: Flask-Limiter's fixed window on the same Redis;
- ``minimal``: the minimal limiter of ``bench/bench_overhead.py`` (one EVALSHA of INCR/PEXPIRE
  per request, redis-py's default pool).

Each limiter counts one client (loopback) against ``--limit`` per hour, fixed window, a fresh
Redis (``FLUSHALL``) per run: **admitted / limit** must be 1.0 (exact) while the run sends far
more than the limit, so most answers are 429s: every request still costs one decision.
Measured per run: requests/s and latency p50/p99 (``wrk --latency``, the hold included), the
limiter's own p50/p99 (``X-Limiter-Us``: from a ``before_request`` hook registered before the
limiter to the view, or to the refusal; under load it includes waiting for the GIL or the event
loop), 5xx (and
``wrk``'s socket errors), and **Redis CPU per decision** (``INFO cpu``, user + sys, over the
run, divided by the answers). Runs are interleaved: each round runs every limiter once per
(worker, level), in a shuffled order; ratios to the minimal limiter are taken within a round and
the median over the rounds is reported.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
KINDS = ("ours", "ours-pool", "flask-limiter", "minimal")
LEVELS = (8, 64, 300, 1000)
WORKERS = ("gthread", "gevent")

LUA = r"""
local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args) counts = {}; us = {} end
function response(status, headers, body)
  counts[status] = (counts[status] or 0) + 1
  local t = headers["X-Limiter-Us"]
  if t ~= nil and #us < 20000 then us[#us + 1] = tonumber(t) end
end
function done(summary, latency, requests)
  local total, all = {}, {}
  for _, thread in ipairs(threads) do
    for status, n in pairs(thread:get("counts")) do total[status] = (total[status] or 0) + n end
    for _, t in ipairs(thread:get("us")) do all[#all + 1] = t end
  end
  for status, n in pairs(total) do io.write(string.format("status %d %d\n", status, n)) end
  table.sort(all)
  if #all > 0 then
    io.write(string.format("limiter %d %d\n", all[math.max(1, math.floor(#all * 0.5))],
      all[math.max(1, math.floor(#all * 0.99))]))
  end
  io.write(string.format("errors %d %d %d %d\n", summary.errors.connect, summary.errors.read,
    summary.errors.write, summary.errors.timeout))
end
"""


# -- the apps (gunicorn's factory: bench_inflight:create_app('ours')) ---------------------------


def _timed(app: Any, install: Callable[[], None], hold: float) -> None:
    """``install`` the limiter after a hook that starts a clock: ``X-Limiter-Us`` is the time
    from there to the view (or to the refusal), whatever hook or decorator the limiter uses.
    Every answer, 200 or 429, is then held ``hold`` seconds, so that many are in flight."""
    from flask import g

    @app.before_request
    def started() -> None:
        g.limiter_started = time.perf_counter()

    install()

    @app.after_request
    def tell(response: Any) -> Any:
        took = g.get("limiter_us")
        if took is None and "limiter_started" in g:  # refused before the view
            took = (time.perf_counter() - g.limiter_started) * 1e6
        if took is not None:
            response.headers["X-Limiter-Us"] = str(int(took))
        time.sleep(hold)  # gevent's under -k gevent
        return response


def _decided() -> None:
    """In the view: the limiter has decided."""
    from flask import g

    g.limiter_us = (time.perf_counter() - g.limiter_started) * 1e6


def create_app(kind: str) -> Any:
    from flask import Flask, abort, g, request

    url = os.environ["BENCH_REDIS_URL"]
    limit = int(os.environ["BENCH_LIMIT"])
    hold = float(os.environ["BENCH_HOLD_MS"]) / 1000
    app = Flask(kind)

    def view() -> str:
        _decided()
        return "ok"

    if kind in ("ours", "ours-pool"):
        from flask_distlimit import Limiter

        app.config.update(DISTLIMIT_STORAGE_URL=url, DISTLIMIT_KEY_PREFIX="bench-inflight")
        holder: dict[str, Any] = {}
        _timed(app, lambda: holder.setdefault("limiter", Limiter(app)), hold)
        limiter = holder["limiter"]
        if kind == "ours-pool":  # no batching: one connection per call in flight
            storage = limiter.state(app).storage
            concurrency = int(os.environ["BENCH_LEVEL"])
            storage.pool.max_connections = concurrency
            storage.pipeline.width = concurrency
            storage.pipeline.max_batch = 1
        app.add_url_rule(
            "/", view_func=limiter.limit(f"{limit}/hour", algorithm="fixed_window")(view)
        )
    elif kind == "flask-limiter":
        from flask_limiter import Limiter as FlaskLimiter
        from flask_limiter.util import get_remote_address

        holder = {}
        _timed(
            app,
            lambda: holder.setdefault(
                "limiter",
                FlaskLimiter(
                    get_remote_address,
                    app=app,
                    storage_uri=url,
                    strategy="fixed-window",
                    key_prefix="bench-inflight-fl",
                ),
            ),
            hold,
        )
        app.add_url_rule("/", view_func=holder["limiter"].limit(f"{limit} per hour")(view))
    elif kind == "minimal":
        import redis

        r = redis.Redis.from_url(url, socket_timeout=0.1, socket_connect_timeout=0.1)
        hit = r.register_script(
            "local n = redis.call('INCR', KEYS[1]) "
            "if n == 1 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end "
            "return {n, redis.call('PTTL', KEYS[1])}"
        )

        def install() -> None:
            @app.before_request
            def count() -> None:
                g.hits, g.ttl_ms = hit([f"rl:{request.remote_addr}"], [3_600_000])
                if g.hits > limit:
                    abort(429)

        _timed(app, install, hold)
        app.add_url_rule("/", view_func=view)
    else:
        raise ValueError(f"unknown kind {kind!r}: one of {KINDS}")
    return app


# -- one run -----------------------------------------------------------------------------------


@dataclass
class Run:
    kind: str
    worker: str
    level: int
    rps: float
    p50_ms: float
    p99_ms: float
    limiter_p50_ms: float
    limiter_p99_ms: float
    admitted: int
    answers: int
    fivexx: int
    socket_errors: int
    redis_cpu_us: float  # per decision


def _ms(text: str) -> float:
    value = float(re.match(r"[\d.]+", text).group(0))  # type: ignore[union-attr]
    return value * {"us": 0.001, "ms": 1.0, "s": 1000.0}[re.sub(r"[\d.]+", "", text)]


def serve(kind: str, worker: str, level: int, env: dict[str, str], log: Path) -> tuple[Any, int]:
    sys.path.insert(0, str(ROOT))
    from tests.servers import free_port, gunicorn_command

    port = free_port()
    if worker == "gevent":
        args = ["-k", "gevent", "--worker-connections", str(max(level, 1000))]
    else:
        args = ["-k", "gthread", "--threads", str(level)]
    env = {
        **os.environ,
        **env,
        "BENCH_LEVEL": str(level),
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(BENCH)]),
    }
    cmd = gunicorn_command(
        "-w", "1", *args, "--backlog", "4096", "--graceful-timeout", "2",
        "--bind", f"127.0.0.1:{port}",
        "--log-level", "warning", f"bench_inflight:create_app('{kind}')",
    )  # fmt: skip
    out = log.open("ab")
    proc = subprocess.Popen(
        cmd, cwd=BENCH, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"gunicorn {kind} exited:\n{log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/__ready", timeout=2):
                pass
        except urllib.error.HTTPError:
            break  # it answers (a 404)
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"gunicorn {kind} did not answer:\n{log.read_text()[-2000:]}")
        time.sleep(0.2)
    return proc, port


def stop(proc: Any) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def one(
    kind: str, worker: str, level: int, args: argparse.Namespace, client: Any, lua: Path, log: Path
) -> Run:
    client.flushall()
    env = {
        "BENCH_REDIS_URL": args.redis_url,
        "BENCH_LIMIT": str(args.limit),
        "BENCH_HOLD_MS": str(args.hold),
    }
    proc, port = serve(kind, worker, level, env, log)
    try:
        cpu = client.info("cpu")
        before = cpu["used_cpu_user"] + cpu["used_cpu_sys"]
        out = subprocess.run(
            [
                "wrk", "-t2", f"-c{level}", f"-d{args.seconds}s", "--timeout", "10s",
                "--latency", "-s", str(lua), f"http://127.0.0.1:{port}/",
            ],
            capture_output=True, text=True, check=True, timeout=args.seconds + 60,
        ).stdout  # fmt: skip
        cpu = client.info("cpu")
        after = cpu["used_cpu_user"] + cpu["used_cpu_sys"]
    finally:
        stop(proc)
    statuses = {int(s): int(n) for s, n in re.findall(r"^status (\d+) (\d+)$", out, re.M)}
    answers = sum(statuses.values())
    latency = dict(re.findall(r"^\s+(50|99)(?:\.0+)?%\s+([\d.]+[mu]?s)", out, re.M))
    if "99" not in latency:
        print(out, file=sys.stderr)
    limiter = re.search(r"^limiter (\d+) (\d+)$", out, re.M)
    errors = re.search(r"^errors (\d+) (\d+) (\d+) (\d+)$", out, re.M)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    assert errors is not None and rps is not None, out
    return Run(
        kind,
        worker,
        level,
        float(rps.group(1)),
        _ms(latency.get("50", "0ms")),
        _ms(latency.get("99", "0ms")),
        int(limiter.group(1)) / 1000 if limiter else 0.0,
        int(limiter.group(2)) / 1000 if limiter else 0.0,
        statuses.get(200, 0),
        answers,
        sum(n for s, n in statuses.items() if s >= 500),
        sum(int(n) for n in errors.groups()),
        (after - before) / max(1, answers) * 1e6,
    )


# -- the table ---------------------------------------------------------------------------------


@dataclass
class Cell:
    runs: list[Run] = field(default_factory=list)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def table(cells: dict[tuple[str, int, str], Cell], args: argparse.Namespace) -> str:
    lines = [
        "| worker | in flight | limiter | admitted / limit | requests/s (x minimal) | "
        "p50 / p99 ms | limiter p50 / p99 ms | 5xx (socket errors) | Redis CPU us / decision "
        "(x minimal) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for worker in args.workers:
        for level in args.levels:
            minimal = cells.get((worker, level, "minimal"))
            for kind in args.kinds:
                cell = cells.get((worker, level, kind))
                if cell is None or not cell.runs:
                    continue
                runs = cell.runs
                ratio = cpu_ratio = ""
                if minimal is not None and kind != "minimal":
                    pairs = list(zip(runs, minimal.runs, strict=False))
                    ratio = f" ({_median([a.rps / b.rps for a, b in pairs if b.rps]):.2f}x)"
                    cpus = [a.redis_cpu_us / b.redis_cpu_us for a, b in pairs if b.redis_cpu_us]
                    cpu_ratio = f" ({_median(cpus):.2f}x)"
                admitted = max(r.admitted for r in runs) / args.limit
                low = min(r.admitted for r in runs) / args.limit
                fivexx = sum(r.fivexx for r in runs)
                errors = sum(r.socket_errors for r in runs)
                lines.append(
                    f"| {worker} | {level} | {kind} | {low:.2f}-{admitted:.2f} | "
                    f"{_median([r.rps for r in runs]):.0f}{ratio} | "
                    f"{_median([r.p50_ms for r in runs]):.0f} / "
                    f"{_median([r.p99_ms for r in runs]):.0f} | "
                    f"{_median([r.limiter_p50_ms for r in runs]):.1f} / "
                    f"{_median([r.limiter_p99_ms for r in runs]):.1f} | "
                    f"{fivexx} ({errors}) | "
                    f"{_median([r.redis_cpu_us for r in runs]):.1f}{cpu_ratio} |"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=3)
    parser.add_argument("--hold", type=float, default=10.0, help="ms the view holds a request")
    parser.add_argument("--limit", type=int, default=100, help="per hour, per run")
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)))
    parser.add_argument("--workers", default=",".join(WORKERS))
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--seed", type=int, default=23)
    args = parser.parse_args(argv)
    args.levels = [int(v) for v in args.levels.split(",")]
    args.workers = args.workers.split(",")
    args.kinds = args.kinds.split(",")
    sys.path.insert(0, str(ROOT))
    from tests.servers import start_redis

    server = start_redis()
    args.redis_url = server.url
    client = server.client()
    rng = random.Random(args.seed)
    cells: dict[tuple[str, int, str], Cell] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-inflight-") as tmp:
            lua = Path(tmp) / "count.lua"
            lua.write_text(LUA)
            log = Path(tmp) / "gunicorn.log"
            for round_ in range(args.rounds):
                for worker in args.workers:
                    for level in args.levels:
                        kinds = list(args.kinds)
                        rng.shuffle(kinds)
                        for kind in kinds:
                            run = one(kind, worker, level, args, client, lua, log)
                            cells.setdefault((worker, level, kind), Cell()).runs.append(run)
                            print(f"round {round_ + 1} {run}", file=sys.stderr, flush=True)
    finally:
        client.close()
        server.stop()
    print(table(cells, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
