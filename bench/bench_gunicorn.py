"""Requests per second under gunicorn: the bare app, the minimal limiter and ours, alternating.

    python bench/bench_gunicorn.py --pairs 7 --seconds 5      # about 2 minutes
    python bench/bench_gunicorn.py --pairs 9 --seconds 5 --always-tokens  # + ours, tokens always
    (also run by: python bench/bench_overhead.py --gunicorn ...)

A private redis-server on loopback and three gunicorn servers (``-w 2``, gunicorn's default sync
workers, loopback ports), all started and stopped here by PID: the bare Flask app, the minimal
limiter of ``bench/bench_overhead.py`` (one fixed window, three ``X-RateLimit-*`` headers) and
ours (fixed window, one limit, default headers), each limit far above what a run sends. ``wrk``
(one thread, 8 connections) loads one server at a time for ``--seconds``; every round runs each
server once in a shuffled order, after an unmeasured warm-up run of each. Requests per second
are compared within each round (ours / bare, ours / minimal) and the median over the rounds is
reported, with its 95 % confidence interval in square brackets and the lowest and highest
round in round brackets. Any response but a 200 fails the run.

Each run also records CPU per request: the gunicorn processes' (master and workers, from Linux's
``/proc``), Redis's whole process (``INFO cpu``) and Redis's own time in ``EVALSHA`` (``INFO
commandstats``, reset before each run), to show where a server's requests per second go when
the machine's cores are the limit. ``--always-tokens`` adds an experiment beside the goals' apps:
ours with ``DISTLIMIT_REQUEST_TOKENS = "always"``, every call carrying a request token (issue
11's replay safety; by default only after connection failures), to show what the token costs.

``wrk`` comes from Debian's package (``apt-get install -y wrk``). Client, servers and Redis share
the machine's cores, as they would on one small host; the ratios are what the goals are about.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
KINDS = ("bare", "minimal", "ours")
#: ``--always-tokens``: ours with every call carrying a request token (what it costs a server)
ALWAYS = "ours-always-tokens"
#: Far above what a run sends (a few thousand requests per second for a few minutes).
HUGE = 1_000_000_000
GOAL_BARE = 0.60
GOAL_MINIMAL = 0.95
WRK_CONNECTIONS = 8


def create_app(kind: str) -> Any:
    """gunicorn's app factory, ``bench_gunicorn:create_app('ours')``; Redis at BENCH_REDIS_URL."""
    from bench_overhead import bare_app, minimal_app, ours_app

    url = os.environ["BENCH_REDIS_URL"]
    if kind == "bare":
        return bare_app()
    if kind == "minimal":
        return minimal_app(url, limit=HUGE)
    if kind == "ours":
        return ours_app(url, "fixed_window", 1, limit=f"{HUGE}/hour")
    if kind == ALWAYS:  # the experiment of --always-tokens: never a goal's figure
        from bench_overhead import REQUEST_TOKENS

        REQUEST_TOKENS["mode"] = "always"
        return ours_app(url, "fixed_window", 1, limit=f"{HUGE}/hour")
    raise ValueError(f"unknown app kind {kind!r}: one of {(*KINDS, ALWAYS)}")


@dataclass
class Server:
    kind: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path
    rps: list[float] = field(default_factory=list)
    #: per run: the gunicorn processes' CPU (master and workers), Redis's CPU and Redis's own
    #: time in EVALSHA (INFO commandstats), each in us per request
    cpu: list[tuple[float, float, float]] = field(default_factory=list)


def start(kind: str, redis_url: str, logdir: Path) -> Server:
    sys.path.insert(0, str(ROOT))
    from tests.servers import free_port

    port = free_port()
    log = logdir / f"gunicorn-{kind}.log"
    env = {
        **os.environ,
        "BENCH_REDIS_URL": redis_url,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(BENCH)]),
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "gunicorn", "-w", "2",
                "--bind", f"127.0.0.1:{port}", "--log-level", "warning",
                f"bench_gunicorn:create_app('{kind}')",
            ],
            cwd=BENCH, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    server = Server(kind, port, proc, log)
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"gunicorn ({kind}) exited at start:\n{log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"gunicorn ({kind}) did not answer in time:\n{log.read_text()}")
        time.sleep(0.2)
    return server


def stop(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
    try:
        server.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=10)


def wrk(port: int, seconds: float) -> float:
    """Requests per second of one ``wrk`` run; every response must be a 200."""
    out = subprocess.run(
        [
            "wrk", "-t1", f"-c{WRK_CONNECTIONS}", f"-d{seconds:g}s", "--timeout", "2s",
            f"http://127.0.0.1:{port}/",
        ],
        capture_output=True, text=True, check=True, timeout=seconds + 30,
    ).stdout  # fmt: skip
    if "Non-2xx" in out:
        raise RuntimeError(f"wrk saw responses other than 200:\n{out}")
    found = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if found is None:
        raise RuntimeError(f"no Requests/sec in wrk's output:\n{out}")
    return float(found.group(1))


@dataclass
class Result:
    servers: dict[str, Server]
    pairs: int
    seconds: float

    def ratios(self, mine: str, theirs: str) -> list[float]:
        a, b = self.servers[mine].rps, self.servers[theirs].rps
        return [x / y for x, y in zip(a, b, strict=True)]


def _process_cpu(pid: int) -> float:
    """CPU seconds of process ``pid`` and its children (Linux ``/proc``; 0 elsewhere)."""
    total = 0.0
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        for each in [pid, *map(int, children)]:
            fields = Path(f"/proc/{each}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0
    return total


def _redis_cpu(client: Any) -> tuple[float, float]:
    """Redis's CPU seconds so far, and its microseconds in EVALSHA since the last reset."""
    cpu = client.info("cpu")
    stats = client.info("commandstats").get("cmdstat_evalsha", {"usec": 0})
    return cpu["used_cpu_user"] + cpu["used_cpu_sys"], float(stats["usec"])


def measured(server: Server, client: Any, seconds: float) -> float:
    """One ``wrk`` run of ``server``, its CPU per request recorded; answers requests/s."""
    client.config_resetstat()
    before, (redis_before, _) = _process_cpu(server.proc.pid), _redis_cpu(client)
    rps = wrk(server.port, seconds)
    after, (redis_after, evalsha_us) = _process_cpu(server.proc.pid), _redis_cpu(client)
    requests = max(1.0, rps * seconds)
    server.cpu.append(
        (
            (after - before) / requests * 1e6,
            (redis_after - redis_before) / requests * 1e6,
            evalsha_us / requests,
        )
    )
    return rps


def run(pairs: int, seconds: float, seed: int = 3, kinds: tuple[str, ...] = KINDS) -> Result:
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is needed for the gunicorn runs: apt-get install -y wrk")
    sys.path.insert(0, str(ROOT))
    from tests.servers import start_redis

    redis_server = start_redis()
    client = redis_server.client()
    servers: dict[str, Server] = {}
    with tempfile.TemporaryDirectory(prefix="bench-gunicorn-") as logdir:
        try:
            for kind in kinds:
                servers[kind] = start(kind, redis_server.url, Path(logdir))
            for server in servers.values():  # warm-up: workers' connections, scripts, caches
                wrk(server.port, 1)
            rng = random.Random(seed)
            order = list(kinds)
            for number in range(pairs):
                rng.shuffle(order)
                for kind in order:
                    servers[kind].rps.append(measured(servers[kind], client, seconds))
                line = ", ".join(f"{k} {servers[k].rps[-1]:,.0f}" for k in kinds)
                print(f"  gunicorn round {number + 1}/{pairs}: {line} req/s", file=sys.stderr)
        finally:
            for server in servers.values():
                stop(server)
            client.close()
            redis_server.stop()
    return Result(servers, pairs, seconds)


def table(result: Result) -> tuple[str, list[Any]]:
    """The Markdown table and the goals (``bench_overhead.Goal``)."""
    from bench_overhead import Goal, Ratio

    def ratio(mine: str, theirs: str) -> Ratio:
        return Ratio.of(result.servers[mine].rps, result.servers[theirs].rps)

    to_bare, to_minimal, minimal_to_bare = (
        ratio("ours", "bare"),
        ratio("ours", "minimal"),
        ratio("minimal", "bare"),
    )
    lines = [
        "| app (gunicorn -w 2 sync workers, wrk -t1 -c8) | requests/s (median of rounds) "
        "| / bare app | / minimal limiter |",
        "|---|---:|---|---|",
        f"| bare Flask | {statistics.median(result.servers['bare'].rps):,.0f} | 1 | |",
        f"| minimal limiter | {statistics.median(result.servers['minimal'].rps):,.0f} "
        f"| {minimal_to_bare.text()} | 1 |",
        f"| ours (fixed window, 1 limit) | {statistics.median(result.servers['ours'].rps):,.0f} "
        f"| {to_bare.text()} | {to_minimal.text()} |",
    ]
    if ALWAYS in result.servers:
        lines.append(
            f"| *experiment:* ours, a request token on every call "
            f"| {statistics.median(result.servers[ALWAYS].rps):,.0f} "
            f"| {ratio(ALWAYS, 'bare').text()} | {ratio(ALWAYS, 'minimal').text()} |"
        )
    lines += [
        "",
        f"{result.pairs} rounds of {result.seconds:g} s per app, apps in a shuffled order in each "
        "round; ratios taken within each round.",
        "",
        "CPU per request, median of the runs (us): the gunicorn processes (master and workers, "
        "from /proc), Redis's whole process (INFO cpu) and Redis's own time in EVALSHA "
        "(INFO commandstats):",
        "",
        "| app | gunicorn CPU | Redis CPU | of which EVALSHA |",
        "|---|---:|---:|---:|",
    ]
    for kind, server in result.servers.items():
        workers, whole, evalsha = (statistics.median(c[i] for c in server.cpu) for i in range(3))
        lines.append(f"| {kind} | {workers:.0f} | {whole:.0f} | {evalsha:.1f} |")
    goals = [
        Goal(
            f"under gunicorn, ours >= {GOAL_BARE:.2f} of the bare app's requests/s",
            f"{to_bare.median:.2f}",
            to_bare.median >= GOAL_BARE,
        ),
        Goal(
            f"under gunicorn, ours >= {GOAL_MINIMAL:.2f} of the minimal limiter's requests/s",
            f"{to_minimal.median:.2f}",
            to_minimal.median >= GOAL_MINIMAL,
        ),
    ]
    return "\n".join(lines), goals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=7, help="rounds (each runs every app once)")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of one wrk run")
    parser.add_argument(
        "--always-tokens",
        action="store_true",
        help="an experiment beside the goals' apps: ours with every call carrying a request "
        'token (DISTLIMIT_REQUEST_TOKENS="always": what the token costs a server)',
    )
    args = parser.parse_args(argv)
    kinds = (*KINDS, ALWAYS) if args.always_tokens else KINDS
    text, goals = table(run(args.pairs, args.seconds, kinds=kinds))
    print(text)
    for goal in goals:
        print(goal.row())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
