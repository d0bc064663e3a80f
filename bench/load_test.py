"""Load test: the example app on two gunicorn instances x 3 workers, one Redis, every algorithm.

    python bench/load_test.py            # about 5 minutes; writes docs/bench/load.md and
                                         # docs/img/load-allowed-per-second.png
    python bench/load_test.py --ramp 12 --algorithms fixed_window --no-write   # a quick look

What it does, all on 127.0.0.1 (the script starts and stops every process itself, by PID):

1. starts one private redis-server, then, for each algorithm (and once with the limiter disabled,
   for the baseline latency), two gunicorn instances of ``example_app`` with 3 gthread workers x 4
   threads each, sharing that Redis, with 10-second tier quotas:
   anonymous 20, free 50, pro 100 (``DISTLIMIT_TIERS``; no global per-IP limit, since every
   client here is 127.0.0.1);
2. three clients -- anonymous (by address), free (alice's JWT) and pro (bob's JWT) -- send
   ``GET /catalogue`` round-robin to the two instances from a bounded pool of threads:
   - a burst across a window boundary: 1.5x the quota per second from 1 s before a multiple of
     10 s (Redis time, epoch-aligned windows) to 1 s after it;
   - then a ramp: offered load rising linearly from 0.5x to 3x the quota rate over ``--ramp``
     seconds;
3. reports per algorithm and tier: allowed vs quota, 429s, 5xx, p50/p99 latency with and without
   the limiter, Retry-After counting down across a window, and how often the handler really ran
   for that client (``GET /downstream``);
4. draws allowed requests per second, and allowed requests in the last 10 s, against the limit.

Numbers depend on the machine; the shape does not.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import http.client
import json
import math
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.servers (redis-server by PID) and example_app live here

from tests.servers import RedisProcess, free_port, start_redis  # noqa: E402

ALGORITHMS = (
    "fixed_window",
    "sliding_window_log",
    "sliding_window_counter",
    "token_bucket",
    "gcra",
)
WINDOW = 10  # seconds: every tier quota is per 10 s, so a run takes well under a minute
QUOTAS = {"anonymous": 20, "free": 50, "pro": 100}
ACCOUNTS = {"free": ("alice", "alice-pw"), "pro": ("bob", "bob-pw")}
BURST_FACTOR = 1.5  # offered load during the boundary burst, in quotas per second
RAMP_FROM, RAMP_TO = 0.5, 3.0  # offered load during the ramp, in multiples of quota / WINDOW
INSTANCES, WORKERS, THREADS = 2, 3, 4
CLIENT_THREADS = 24
TOKEN_SOURCE = "127.0.0.2"  # tokens are fetched from another loopback address (own quota)


# -- processes ---------------------------------------------------------------------------------


@dataclass
class Instance:
    port: int
    proc: subprocess.Popen[bytes]
    log: Path


def start_instances(env: dict[str, str], logdir: Path, tag: str) -> list[Instance]:
    instances = []
    for i in range(INSTANCES):
        port = free_port()
        log = logdir / f"gunicorn-{tag}-{i}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [
                    sys.executable, "-m", "gunicorn",
                    "--config", str(ROOT / "example_app" / "gunicorn.conf.py"),
                    "--bind", f"127.0.0.1:{port}",
                    "--workers", str(WORKERS), "--threads", str(THREADS),
                    "example_app:create_app()",
                ],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        instances.append(Instance(port, proc, log))
    deadline = time.monotonic() + 60
    for inst in instances:
        while True:
            if inst.proc.poll() is not None:
                raise RuntimeError(f"gunicorn exited at start:\n{inst.log.read_text()[-2000:]}")
            try:
                if request(inst.port, "/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"gunicorn did not answer in time:\n{inst.log.read_text()}")
            time.sleep(0.2)
    # Wait until every worker of every instance has booted (each prints one line).
    while time.monotonic() < deadline:
        if all(i.log.read_text().count("Booting worker") >= WORKERS for i in instances):
            break
        time.sleep(0.2)
    return instances


def stop_instances(instances: Sequence[Instance]) -> None:
    for inst in instances:
        if inst.proc.poll() is None:
            inst.proc.send_signal(signal.SIGTERM)
    for inst in instances:
        with contextlib.suppress(subprocess.TimeoutExpired):
            inst.proc.wait(timeout=20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(inst.proc.pid, signal.SIGKILL)
        inst.proc.wait(timeout=10)


# -- HTTP --------------------------------------------------------------------------------------

_local = threading.local()


def _connection(port: int, source: str | None) -> http.client.HTTPConnection:
    pool: dict[tuple[int, str | None], http.client.HTTPConnection] = _local.__dict__.setdefault(
        "pool", {}
    )
    conn = pool.get((port, source))
    if conn is None:
        conn = http.client.HTTPConnection(
            "127.0.0.1", port, timeout=10, source_address=(source, 0) if source else None
        )
        pool[(port, source)] = conn
    return conn


def _drop(port: int, source: str | None) -> None:
    conn = _local.__dict__.get("pool", {}).pop((port, source), None)
    if conn is not None:
        conn.close()


def close_connections() -> None:
    for conn in _local.__dict__.pop("pool", {}).values():
        conn.close()


def request(
    port: int,
    path: str,
    *,
    method: str = "GET",
    headers: dict[str, str] | None = None,
    body: bytes | None = None,
    source: str | None = None,
) -> tuple[int, dict[str, str], bytes, float]:
    """(status, headers, body, seconds); keeps one connection per thread, port and source."""
    for attempt in (0, 1):
        conn = _connection(port, source)
        reused = conn.sock is not None
        started = time.perf_counter()
        try:
            conn.request(method, path, body=body, headers=headers or {})
            reply = conn.getresponse()
            data = reply.read()
        except (http.client.HTTPException, ConnectionError, TimeoutError):
            _drop(port, source)
            if reused and attempt == 0:
                continue  # the server closed an idle keep-alive connection: send it again
            raise
        elapsed = time.perf_counter() - started
        found = {k.lower(): v for k, v in reply.getheaders()}
        if found.get("connection", "").lower() == "close":
            _drop(port, source)
        return reply.status, found, data, elapsed
    raise AssertionError("unreachable")


# -- traffic -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Job:
    at: float  # seconds relative to the window boundary b
    tier: str


@dataclass(slots=True)
class Result:
    job: Job
    sent: float  # seconds relative to b (wall clock, the same clock as Redis on this host)
    latency: float
    status: int
    retry_after: int | None

    @property
    def decided(self) -> float:
        """When the server decided, approximately: half-way through the round trip."""
        return self.sent + self.latency / 2


def arrivals(rate_at: Iterator[tuple[float, float]], step: float) -> list[float]:
    """Times at which the integral of the rate crosses each whole number."""
    out, total, nxt = [], 0.0, 0.0
    for t, rate in rate_at:
        total += rate * step
        while total >= nxt + 1:
            nxt += 1
            out.append(t)
    return out


def schedule(ramp: float) -> list[Job]:
    jobs: list[Job] = []
    step = 0.001
    for tier, quota in QUOTAS.items():
        burst = ((-1 + i * step, BURST_FACTOR * quota) for i in range(int(2 / step)))
        jobs += [Job(t, tier) for t in arrivals(burst, step)]
        base = quota / WINDOW

        def ramp_rate(i: int, base: float = base) -> tuple[float, float]:
            t = 1 + i * step
            return t, base * (RAMP_FROM + (RAMP_TO - RAMP_FROM) * (t - 1) / ramp)

        jobs += [Job(t, tier) for t in arrivals(map(ramp_rate, range(int(ramp / step))), step)]
    return sorted(jobs, key=lambda j: j.at)


def run_jobs(
    jobs: Sequence[Job], ports: Sequence[int], tokens: dict[str, str], boundary: float
) -> list[Result]:
    results: list[Result | None] = [None] * len(jobs)
    cursor = iter(range(len(jobs)))
    lock = threading.Lock()
    hard_stop = boundary + jobs[-1].at + 30  # bounded in time as well as in count

    def worker() -> None:
        try:
            while True:
                with lock:
                    index = next(cursor, None)
                if index is None:
                    return
                job = jobs[index]
                wait = boundary + job.at - time.time()
                if wait > 0:
                    time.sleep(wait)
                if time.time() > hard_stop:
                    return
                token = tokens.get(job.tier)
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                sent = time.time() - boundary
                try:
                    status, found, _, latency = request(
                        ports[index % len(ports)], "/catalogue", headers=headers
                    )
                except OSError:
                    status, found, latency = 0, {}, 0.0
                retry = found.get("retry-after")
                results[index] = Result(
                    job, sent, latency, status, int(retry) if retry is not None else None
                )
        finally:
            close_connections()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(CLIENT_THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=max(1.0, hard_stop - time.time() + 5))
    return [r for r in results if r is not None]


def fetch_tokens(port: int) -> dict[str, str]:
    tokens = {}
    for tier, (account, password) in ACCOUNTS.items():
        body = json.dumps({"account": account, "password": password}).encode()
        status, _, data, _ = request(
            port,
            "/token",
            method="POST",
            body=body,
            headers={"Content-Type": "application/json"},
            source=TOKEN_SOURCE,
        )
        if status != 200:
            raise RuntimeError(f"POST /token for {account} answered {status}: {data!r}")
        tokens[tier] = json.loads(data)["access_token"]
    close_connections()
    return tokens


def downstream(port: int) -> dict[str, int]:
    status, _, data, _ = request(port, "/downstream")
    close_connections()
    if status != 200:
        raise RuntimeError(f"GET /downstream answered {status}")
    by_caller: dict[str, dict[str, int]] = json.loads(data)["by_caller"]
    return dict(by_caller.get("catalogue", {}))


CALLER = {"anonymous": "anonymous", "free": "user:alice", "pro": "user:bob"}


# -- one run -----------------------------------------------------------------------------------


@dataclass
class Run:
    algorithm: str  # or "off"
    results: list[Result]
    ran: dict[str, int]  # handler runs per tier during the run (downstream delta)
    ramp: float

    def of(self, tier: str) -> list[Result]:
        return [r for r in self.results if r.job.tier == tier]


def one_run(
    algorithm: str,
    redis_url: str,
    secret: str,
    tokens: dict[str, str],
    ramp: float,
    logdir: Path,
) -> tuple[Run, dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTLIMIT_", "EXAMPLE_"))}
    env.update(
        DISTLIMIT_STORAGE_URL=redis_url,
        DISTLIMIT_ALGORITHM=algorithm if algorithm != "off" else "sliding_window_counter",
        DISTLIMIT_ENABLED="false" if algorithm == "off" else "true",
        DISTLIMIT_TIERS=json.dumps(
            {**{t: f"{q}/{WINDOW} seconds" for t, q in QUOTAS.items()}, "internal": ""}
        ),
        DISTLIMIT_GLOBAL_LIMITS="",
        DISTLIMIT_KEY_PREFIX=f"load-{algorithm}-{secrets.token_hex(3)}",
        EXAMPLE_SECRET_KEY=secret,
    )
    instances = start_instances(env, logdir, algorithm)
    try:
        ports = [i.port for i in instances]
        if not tokens:
            tokens = fetch_tokens(ports[0])
        before = downstream(ports[0])
        jobs = schedule(ramp)
        # The burst starts 1 s before a window boundary; leave at least 2 s to get there.
        boundary = math.ceil((time.time() + 3) / WINDOW) * WINDOW
        results = run_jobs(jobs, ports, tokens, boundary)
        time.sleep(0.5)
        after = downstream(ports[1])
        ran = {t: after.get(c, 0) - before.get(c, 0) for t, c in CALLER.items()}
        return Run(algorithm, results, ran, ramp), tokens
    finally:
        stop_instances(instances)


# -- analysis ----------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def max_in(times: Sequence[float], span: float) -> int:
    ordered = sorted(times)
    return max(
        (i - bisect.bisect_left(ordered, t - span + 1e-9) + 1 for i, t in enumerate(ordered)),
        default=0,
    )


def tightest(times: Sequence[float], count: int) -> float | None:
    """The shortest span holding ``count`` of ``times`` (None: fewer times than that)."""
    ordered = sorted(times)
    if len(ordered) < count:
        return None
    return min(ordered[i + count - 1] - ordered[i] for i in range(len(ordered) - count + 1))


@dataclass
class TierStats:
    sent: int
    allowed: int
    denied: int
    errors: int
    ran: int
    bound: int  # most an exact limiter could admit: quota per window touched
    max_10s: int
    max_2s: int
    max_fixed: int  # most 200s inside one fixed window [kW, (k+1)W)
    over_span: float | None  # the shortest span holding quota + 1 200s (s)
    p50: float
    p99: float
    p50_allowed: float
    p99_allowed: float
    countdown: dict[int, list[int]] = field(default_factory=dict)


def tier_stats(run: Run, tier: str) -> TierStats:
    rs = run.of(tier)
    ok = [r for r in rs if r.status == 200]
    denied = [r for r in rs if r.status == 429]
    quota = QUOTAS[tier]
    windows = {math.floor(r.decided / WINDOW) for r in rs}
    countdown: dict[int, list[int]] = {}
    for r in denied:
        if r.retry_after is not None:
            offset = math.floor(r.decided % WINDOW)
            countdown.setdefault(offset, []).append(r.retry_after)
    ms = [r.latency * 1000 for r in rs if r.status]
    ms_ok = [r.latency * 1000 for r in ok]
    return TierStats(
        sent=len(rs),
        allowed=len(ok),
        denied=len(denied),
        errors=sum(1 for r in rs if r.status not in (200, 429)),
        ran=run.ran.get(tier, 0),
        bound=quota * len(windows),
        max_10s=max_in([r.decided for r in ok], WINDOW),
        max_2s=max_in([r.decided for r in ok], 2.0),
        max_fixed=max(Counter(math.floor(r.decided / WINDOW) for r in ok).values(), default=0),
        over_span=tightest([r.decided for r in ok], quota + 1),
        p50=percentile(ms, 0.5),
        p99=percentile(ms, 0.99),
        p50_allowed=percentile(ms_ok, 0.5),
        p99_allowed=percentile(ms_ok, 0.99),
        countdown=countdown,
    )


def log_reading(limited: Sequence[Run]) -> str:
    """The reading of the log's rows: the quota in any span, or how close an excess came."""
    text = f"- **sliding window log**: the quota in any {WINDOW} s, wherever the span starts"
    log = next((r for r in limited if r.algorithm == "sliding_window_log"), None)
    if log is None:
        return text + "."
    spans = {tier: tier_stats(log, tier).over_span for tier in QUOTAS}
    closest = min((s for s in spans.values() if s is not None), default=None)
    if closest is None or closest >= WINDOW:
        return text + " (1.00x)."
    short_ms = (WINDOW - closest) * 1000
    return (
        text + f"; where a row shows one more, the quota + 1 requests span {closest:.4f} s by"
        f" their half-way times, {short_ms:.1f} ms short of {WINDOW} s: closer than a round trip"
        " (about 2.5 ms here) lets the client place a decision. The server's own count is exact"
        " (`tests/engine/test_race.py`, `tests/extension/test_gunicorn.py`)."
    )


def report(runs: Sequence[Run], command: str, elapsed: float | None) -> str:
    base = next((r for r in runs if r.algorithm == "off"), None)
    limited = [r for r in runs if r.algorithm != "off"]
    lines = [
        "# Load test",
        "",
        "The example app on **2 gunicorn instances x 3 gthread workers x 4 threads**, one Redis,",
        f"every algorithm in turn. Tier quotas per {WINDOW} s: "
        + ", ".join(f"{t} {q}" for t, q in QUOTAS.items())
        + ". Three clients (anonymous by address, free and pro by JWT) send `GET /catalogue`",
        "round-robin to both instances: a burst of 1.5x the quota per second from 1 s before a",
        f"window boundary to 1 s after it, then a ramp from {RAMP_FROM}x to {RAMP_TO}x the quota "
        f"rate over {limited[0].ramp:.0f} s.",
        "",
        "Reproduce (about 5 minutes; starts and stops its own redis-server and gunicorns on"
        " 127.0.0.1):",
        "",
        f"    {command}",
        "",
        "Measured on a shared 2-core machine"
        + (f" in {elapsed:.0f} s" if elapsed is not None else "")
        + "; latencies include the load of other processes on it. The shape, not the"
        " milliseconds, is the point.",
        "",
        "## Allowed vs quota, per algorithm and tier",
        "",
        "*allowed* counts 200s; *handler ran* is the example app's downstream counter for that"
        " client (shared in Redis by all 6 workers), which must equal *allowed*; *quota x windows*"
        " is the quota times the windows the client was active in; *most in one window* is the"
        f" most 200s inside one fixed window [10k, 10k + {WINDOW}) s; *most in 10 s* / *most in"
        " 2 s* are the most 200s in any sliding 10 s / 2 s span. Decision times are taken at the"
        " client, half-way through each round trip, so a request decided within a few"
        " milliseconds of a boundary may be counted on its other side (hence an occasional"
        " request over the quota, e.g. 21 of 20, for an exact algorithm).",
        "",
        "| algorithm | tier | sent | allowed | 429 | 5xx/errors | handler ran | quota x windows |"
        " most in one window | most in 10 s | most in 2 s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in limited:
        for tier, quota in QUOTAS.items():
            s = tier_stats(run, tier)
            most = " | ".join(f"{n} ({n / quota:.2f}x)" for n in (s.max_fixed, s.max_10s, s.max_2s))
            lines.append(
                f"| {run.algorithm} | {tier} ({quota}/{WINDOW} s) | {s.sent} | {s.allowed} |"
                f" {s.denied} | {s.errors} | {s.ran} | {s.bound} | {most} |"
            )
    lines += [
        "",
        "Reading it:",
        "",
        "- **handler ran = allowed** in every row: the work behind the limiter is capped by what",
        "  it admits, counted across 6 worker processes on 2 instances; no 5xx.",
        "- **fixed window**: never more than the quota inside one window, but the burst that",
        "  straddles a boundary gets a quota on each side: up to 2x the quota in 2 seconds.",
        log_reading(limited),
        "- **sliding window counter**: smooth over 2 s, but right after a burst at the end of a",
        "  window it admits up to ~1.8x the quota in the next 10 s: it assumes the previous",
        "  window's requests were spread evenly (see the accuracy study in the algorithms page).",
        "- **token bucket** and **GCRA** admit the same: a full bucket at once, then the quota's",
        f"  rate (quota / {WINDOW} s), so up to quota x (1 + T / {WINDOW} s) in any T seconds,",
        "  by design: 1.2x in 2 s, ~2x in 10 s.",
        "",
        "## Latency with and without the limiter",
        "",
        "Client-side round trip over loopback, per tier; *off* runs the same traffic with"
        " `DISTLIMIT_ENABLED = False` (every request reaches the handler).",
        "",
        "| run | tier | p50 all (ms) | p99 all (ms) | p50 of 200s (ms) | p99 of 200s (ms) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for run in ([base] if base else []) + limited:
        for tier in QUOTAS:
            s = tier_stats(run, tier)
            name = "off (no limiter)" if run.algorithm == "off" else run.algorithm
            lines.append(
                f"| {name} | {tier} | {s.p50:.1f} | {s.p99:.1f} | {s.p50_allowed:.1f} |"
                f" {s.p99_allowed:.1f} |"
            )
    lines += [
        "",
        "The limiter's own cost (one EVALSHA per request, a few hundred microseconds) is within"
        " the run-to-run noise of these loopback round trips on a shared machine; 429s skip the"
        " handler. The [overhead benchmark](overhead.md) measures the cost precisely.",
        "",
        "## Retry-After across a window",
        "",
        "The `Retry-After` values of the free tier's 429s, by the second of the 10 s window in"
        " which the request was decided (the most frequent value, and the range seen).",
        "",
        "| algorithm | " + " | ".join(f"{s}-{s + 1} s" for s in range(WINDOW)) + " |",
        "|---|" + "---:|" * WINDOW,
    ]
    for run in limited:
        cd = tier_stats(run, "free").countdown
        cells = []
        for second in range(WINDOW):
            seen = cd.get(second, [])
            if not seen:
                cells.append("-")
                continue
            mode = Counter(seen).most_common(1)[0][0]
            lo, hi = min(seen), max(seen)
            cells.append(f"{mode}" if lo == hi else f"{mode} ({lo}-{hi})")
        lines.append(f"| {run.algorithm} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "The fixed window counts down to the next window (10, 9, ... 1). The log counts down to"
        " the moment its oldest entries leave the window, which depends on when they came. The"
        " counter, the token bucket and GCRA free capacity continuously, so at this load the next"
        " unit is never more than a second away. `Retry-After` is rounded up, never early.",
        "",
        "## Allowed requests over time",
        "",
        "![Allowed requests per second and in the last 10 s, per algorithm]"
        "(../img/load-allowed-per-second.png)",
        "",
    ]
    return "\n".join(lines)


def plot(runs: Sequence[Run], path: Path, tier: str = "pro") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    limited = [r for r in runs if r.algorithm != "off"]
    quota = QUOTAS[tier]
    fig, axes = plt.subplots(
        len(limited), 2, figsize=(13, 2.3 * len(limited) + 1), sharex=True, squeeze=False
    )
    end = 1 + limited[0].ramp
    for row, run in enumerate(limited):
        rs = run.of(tier)
        ok = sorted(r.decided for r in rs if r.status == 200)
        sent = [r.sent for r in rs]
        bins = [b for b in range(-2, math.ceil(end) + 1)]
        left, right = axes[row]
        left.hist(sent, bins=bins, color="#d0d0d0", edgecolor="white", lw=0.5, label="offered")
        left.hist(ok, bins=bins, color="#3f51b5", edgecolor="white", lw=0.5, label="allowed")
        left.axhline(quota / WINDOW, color="#e53935", ls="--", lw=1.2, label="limit rate (q/W)")
        left.set_ylabel(run.algorithm.replace("_", " "), fontsize=9)
        left.set_ylim(0, BURST_FACTOR * quota * 1.1)
        xs = [i / 10 for i in range(-20, int(end * 10) + 1)]
        rolling = [bisect.bisect_right(ok, x) - bisect.bisect_right(ok, x - WINDOW) for x in xs]
        right.plot(xs, rolling, color="#3f51b5", lw=1.5, label=f"allowed in the last {WINDOW} s")
        limit_label = f"limit ({quota} per {WINDOW} s)"
        right.axhline(quota, color="#e53935", ls="--", lw=1.2, label=limit_label)
        right.set_ylim(0, quota * 2.3)
        peak2, peak10 = max_in(ok, 2.0), max_in(ok, WINDOW)
        note = (
            f"most in any 2 s: {peak2} ({peak2 / quota:.2f}x)\n"
            f"most in any {WINDOW} s: {peak10} ({peak10 / quota:.2f}x)"
        )
        right.text(
            0.99, 0.95, note, ha="right", va="top", transform=right.transAxes, fontsize=9,
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8},
        )  # fmt: skip
        for ax in (left, right):
            for b in range(0, math.ceil(end) + 1, WINDOW):
                ax.axvline(b, color="#9e9e9e", lw=0.6, ls=":")
    axes[0][0].set_title(
        f"{tier} tier: requests per second (window boundaries dotted)", fontsize=10
    )
    axes[0][1].set_title(f"{tier} tier: allowed in the last {WINDOW} s", fontsize=10)
    axes[0][0].legend(loc="upper right", fontsize=8)
    axes[0][1].legend(loc="upper left", fontsize=8)
    axes[-1][0].set_xlabel("seconds from a window boundary (burst at -1..1 s, then the ramp)")
    axes[-1][1].set_xlabel("seconds from a window boundary")
    fig.suptitle(
        f"2 gunicorn instances x {WORKERS} workers, one Redis: boundary burst at 1.5x quota/s,"
        f" then offered load ramping {RAMP_FROM}x -> {RAMP_TO}x",
        fontsize=11,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main --------------------------------------------------------------------------------------


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def save(runs: Sequence[Run], path: Path) -> None:
    data = [
        {
            "algorithm": run.algorithm,
            "ramp": run.ramp,
            "ran": run.ran,
            "results": [
                [r.job.at, r.job.tier, r.sent, r.latency, r.status, r.retry_after]
                for r in run.results
            ],
        }
        for run in runs
    ]
    path.write_text(json.dumps(data))


def load(path: Path) -> list[Run]:
    return [
        Run(
            item["algorithm"],
            [
                Result(Job(at, tier), sent, lat, st, ra)
                for at, tier, sent, lat, st, ra in item["results"]
            ],
            item["ran"],
            item["ramp"],
        )
        for item in json.loads(path.read_text())
    ]


def main(argv: list[str] | None = None) -> int:
    # Stop cleanly (gunicorns and redis-server by PID) on Ctrl-C or SIGTERM, also when started
    # in the background, where a shell leaves SIGINT ignored.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithms", nargs="+", choices=ALGORITHMS, default=list(ALGORITHMS))
    parser.add_argument("--ramp", type=float, default=30.0, help="ramp seconds (30)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the limiter-off run")
    parser.add_argument("--no-write", action="store_true", help="print only; write no files")
    parser.add_argument(
        "--from-json", type=Path, help="redraw the report and plot from a saved run (no load)"
    )
    parser.add_argument("--markdown", type=Path, default=ROOT / "docs" / "bench" / "load.md")
    parser.add_argument(
        "--png", type=Path, default=ROOT / "docs" / "img" / "load-allowed-per-second.png"
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    logdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"distlimit-load-{os.getpid()}"
    logdir.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        runs = load(args.from_json)
        return finish(runs, args, argv, logdir, elapsed=None)
    server: RedisProcess = start_redis()
    secret = secrets.token_hex(32)
    tokens: dict[str, str] = {}
    runs = []
    try:
        order = ([] if args.no_baseline else ["off"]) + list(args.algorithms)
        for algorithm in order:
            print(f"[load] {algorithm} ...", file=sys.stderr, flush=True)
            run, tokens = one_run(algorithm, server.url, secret, tokens, args.ramp, logdir)
            runs.append(run)
            for tier in QUOTAS:
                s = tier_stats(run, tier)
                print(
                    f"[load]   {tier:<9} sent {s.sent:4} allowed {s.allowed:4} 429 {s.denied:4}"
                    f" errors {s.errors} ran {s.ran:4} bound {s.bound:4} most-in-2s {s.max_2s:4}"
                    f" p50 {s.p50:6.1f} ms p99 {s.p99:6.1f} ms",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        server.stop()
    save(runs, logdir / "runs.json")
    print(f"[load] raw results: {logdir / 'runs.json'}", file=sys.stderr)
    return finish(runs, args, argv, logdir, elapsed=time.monotonic() - started)


def finish(
    runs: list[Run],
    args: argparse.Namespace,
    argv: list[str] | None,
    logdir: Path,
    elapsed: float | None,
) -> int:
    given = sys.argv[1:] if argv is None else argv
    if args.from_json:
        given = []  # the report names the command that produced the data
    command = " ".join(["python bench/load_test.py", *given])
    text = report(runs, command, elapsed)
    if args.no_write:
        print(text)
        scratch = logdir / "load-allowed-per-second.png"
        plot(runs, scratch)
        print(f"plot: {scratch}", file=sys.stderr)
    else:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text)
        plot(runs, args.png)
        print(f"wrote {args.markdown} and {args.png}", file=sys.stderr)
    errors = sum(tier_stats(r, t).errors for r in runs for t in QUOTAS)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
