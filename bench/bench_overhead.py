"""Per-request overhead of Flask-DistLimit against a minimal limiter and Flask-Limiter.

    python bench/bench_overhead.py --rounds 15 --gunicorn --write docs/bench/overhead.md
    python bench/bench_overhead.py --rounds 7 --batch 50   # a quick in-process look, no files
    python bench/bench_overhead.py --breakdown fixed_window:3    # where our time goes
    python bench/bench_overhead.py --profile sliding_window_log:3  # cProfile of our app
    python bench/bench_overhead.py --wire                          # RESP shapes of one call
    python bench/bench_overhead.py --wakeups        # a blocking wait for Redis inside a request
    python bench/bench_overhead.py --cpu --rounds 15   # this process's CPU time per request
    python bench/bench_overhead.py --opcodes        # Python opcodes per request (no noise at all)
    python bench/bench_overhead.py --always-tokens  # ours with DISTLIMIT_REQUEST_TOKENS="always"

Same process, same redis-server (a private one on loopback, started and stopped here), direct
WSGI calls of a trivial view: the environ is built once with werkzeug's ``EnvironBuilder`` and every
call is ``app(environ.copy(), start_response)``. Rows: 1 and 3 limits (huge, never reached) with
the fixed window, the sliding window counter and the sliding window log (Flask-Limiter's
``moving-window``), headers on in both libraries (ours at its default, ``both``: 3
``X-RateLimit-*`` and 2 IETF headers). Our tier limit is switched off
(``DISTLIMIT_TIERS = {"anonymous": ""}``) so both libraries apply exactly the row's limits.

The **minimal limiter** is the floor: a Flask app with one ``before_request`` calling a one-key
fixed-window script (``INCR``, ``PEXPIRE`` on the first hit, ``PTTL``) registered with stock
redis-py ``register_script``, and three ``X-RateLimit-*`` headers in ``after_request`` (the
source is printed below the table). One round trip, three commands, no identity, no algorithms,
no failure handling: what any Redis limiter must at least pay inside a request.

Rounds are interleaved: every round runs a batch of each app in a shuffled order (Redis emptied,
untimed, before every batch), so machine noise spreads over all of them. An app's time in a
round is the median of its batch; its overhead in that round is that minus the bare Flask app's.
Every ratio is taken within one round (ours / the minimal limiter's overhead, ours /
Flask-Limiter's) and the median over the rounds is reported, with its distribution-free 95 %
confidence interval in square brackets (order statistics, ``bench/intervals.py``: how far the
median itself may be from the machine's true one) and the lowest and highest round in round
brackets; overheads shown are medians over the rounds.

Round trips per request are counted separately (untimed) by counting redis-py's
``send_packed_command`` calls (a pipeline is one round trip), and commands per request from the
server's ``total_commands_processed``.

With ``--gunicorn``, ``bench/bench_gunicorn.py`` also serves the bare app, the minimal limiter
and ours (fixed window, one limit) with ``gunicorn -w 2`` on loopback and loads each with
``wrk`` in alternating runs (its docstring gives the method); requests per second are compared
within each round.

Goals (issues 3 and 14): ours <= 1.0x the minimal limiter's overhead on every algorithm with one
limit; <= 0.40x Flask-Limiter's on each 1-limit row and <= 0.30x on each 3-limit row; 1 round
trip for 3 limits; under gunicorn, >= 0.60 of the bare app's requests per second and >= 0.95 of
the minimal limiter's.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import inspect
import io
import os
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import redis.connection
from flask import Flask, Response, abort, g, request
from intervals import median_ci  # beside this file
from werkzeug.test import EnvironBuilder

ROOT = Path(__file__).resolve().parent.parent

#: Our algorithm name -> Flask-Limiter's strategy of the same idea.
ALGORITHMS = {
    "fixed_window": "fixed-window",
    "sliding_window_counter": "sliding-window-counter",
    "sliding_window_log": "moving-window",
}
#: Never reached during a run.
QUOTA = 100_000
#: The sliding window log accepts at most 1,000 per window: never reached within one batch, as
#: the run empties Redis (untimed) before every batch.
LOG_QUOTA = 1_000
LIMITS = {
    1: f"{QUOTA}/hour",
    3: f"{QUOTA}/second;{QUOTA}/minute;{QUOTA}/hour",
}


def limits(algorithm: str, n: int) -> str:
    """The row's limit string: huge, or the log's largest between two emptyings of Redis."""
    if algorithm == "sliding_window_log":
        return LIMITS[n].replace(str(QUOTA), str(LOG_QUOTA))
    return LIMITS[n]


GOAL_RATIO = {1: 0.40, 3: 0.30}
#: Ours / the minimal limiter's overhead, on every algorithm with one limit.
GOAL_MINIMAL = 1.0
CLIENT_ADDR = "203.0.113.9"

WsgiCall = Callable[[], None]


def _start_response(
    status: str, headers: list[tuple[str, str]], exc_info: Any = None, /
) -> Callable[[bytes], object]:
    _last["status"] = status
    _last["headers"] = headers
    return _write


def _write(data: bytes) -> None:
    raise AssertionError("the bench views return their body, they never call write()")


_last: dict[str, Any] = {}


def wsgi_caller(app: Flask) -> tuple[WsgiCall, dict[str, Any]]:
    environ = EnvironBuilder(path="/", environ_base={"REMOTE_ADDR": CLIENT_ADDR}).get_environ()

    def call() -> None:
        body = app(environ.copy(), _start_response)
        for _ in body:
            pass
        close = getattr(body, "close", None)
        if close is not None:
            close()

    return call, environ


def _view() -> str:
    return "ok"


def bare_app() -> Flask:
    app = Flask("bare")
    app.add_url_rule("/", view_func=_view)
    return app


def ours_app(url: str, algorithm: str, n: int, limit: str | None = None) -> Flask:
    """Our app on one row; ``limit`` replaces the row's limit string (the gunicorn runs)."""
    from flask_distlimit import Limiter

    app = Flask(f"ours-{algorithm}-{n}")
    app.config.update(
        # digests keyed from a secret, as in production; not SECRET_KEY, which would make Flask
        # open a session on every request of this app alone (about 30 us)
        DISTLIMIT_API_KEY_SECRET="bench",
        DISTLIMIT_STORAGE_URL=url,
        DISTLIMIT_ALGORITHM=algorithm,
        DISTLIMIT_TIERS={"anonymous": ""},
        DISTLIMIT_KEY_PREFIX=f"ours-{algorithm}-{n}",
        DISTLIMIT_HEADERS="both",
        DISTLIMIT_REQUEST_TOKENS=REQUEST_TOKENS["mode"],
    )
    limiter = Limiter(app)
    rule = limit or limits(algorithm, n)
    app.add_url_rule("/", view_func=limiter.limit(rule, algorithm=algorithm)(_view))
    return app


def flask_limiter_app(url: str, algorithm: str, n: int) -> Flask:
    from flask_limiter import Limiter
    from flask_limiter.util import get_remote_address

    app = Flask(f"flask-limiter-{algorithm}-{n}")
    limiter = Limiter(
        get_remote_address,
        app=app,
        storage_uri=url,
        strategy=ALGORITHMS[algorithm],
        headers_enabled=True,
        key_prefix=f"fl-{algorithm}-{n}",
    )
    app.add_url_rule("/", view_func=limiter.limit(limits(algorithm, n))(_view))
    return app


def minimal_app(url: str, limit: int = QUOTA, period_ms: int = 3_600_000) -> Flask:
    """The minimal limiter: one fixed window per client address, three headers."""
    app = Flask("minimal")
    r = redis.Redis.from_url(url, socket_timeout=0.1, socket_connect_timeout=0.1)
    hit = r.register_script(
        "local n = redis.call('INCR', KEYS[1]) "
        "if n == 1 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end "
        "return {n, redis.call('PTTL', KEYS[1])}"
    )

    @app.before_request
    def count() -> None:
        g.hits, g.ttl_ms = hit([f"rl:{request.remote_addr}"], [period_ms])
        if g.hits > limit:
            abort(429)

    @app.after_request
    def headers(response: Response) -> Response:
        if "hits" in g:
            response.headers["X-RateLimit-Limit"] = str(limit)
            response.headers["X-RateLimit-Remaining"] = str(max(0, limit - g.hits))
            response.headers["X-RateLimit-Reset"] = str(int(time.time() + g.ttl_ms / 1000) + 1)
        return response

    app.add_url_rule("/", view_func=_view)
    return app


@dataclass
class Subject:
    name: str
    call: WsgiCall
    samples: list[int] = field(default_factory=list)
    #: The median of each round's batch, us, in round order.
    per_round: list[float] = field(default_factory=list)

    @property
    def median_us(self) -> float:
        return statistics.median(self.samples) / 1000


def floor_app(client: redis.Redis) -> Flask:
    """The least any Redis limiter can do inside a request: one bare EVALSHA, no headers."""
    app = bare_app()
    app.name = "floor"
    sha = client.script_load("return redis.call('GET', KEYS[1])")

    @app.before_request
    def one_round_trip() -> None:
        client.evalsha(sha, 1, "bench:floor")

    return app


def evalsha_caller(client: redis.Redis) -> WsgiCall:
    sha = client.script_load("return redis.call('GET', KEYS[1])")

    def call() -> None:
        client.evalsha(sha, 1, "bench:floor")

    return call


def measure(
    subjects: list[Subject],
    rounds: int,
    batch: int,
    seed: int = 1,
    between: Callable[[], object] | None = None,
) -> None:
    """Interleaved batches; ``between`` runs untimed before every batch (e.g. FLUSHALL, so
    that the log's 1,000 per window is never reached)."""
    if batch + 200 >= LOG_QUOTA:
        raise SystemExit(f"--batch must stay under {LOG_QUOTA - 200} (the log's quota)")
    rng = random.Random(seed)
    clock = time.perf_counter_ns
    for subject in subjects:  # warm up: connections, scripts, caches
        if between is not None:
            between()
        for _ in range(200):
            subject.call()
    for _ in range(rounds):
        order = subjects[:]
        rng.shuffle(order)
        for subject in order:
            call, samples = subject.call, subject.samples
            if between is not None:
                between()
            gc.collect()
            gc.disable()
            first = len(samples)
            try:
                for _ in range(batch):
                    start = clock()
                    call()
                    samples.append(clock() - start)
            finally:
                gc.enable()
            subject.per_round.append(statistics.median(samples[first:]) / 1000)


@contextmanager
def counting_round_trips() -> Iterator[list[int]]:
    """Counts redis-py ``send_packed_command`` calls (one per round trip; a pipeline is one)."""
    count = [0]
    original = redis.connection.AbstractConnection.send_packed_command

    def counted(self: Any, command: Any, check_health: bool = True) -> None:
        count[0] += 1
        original(self, command, check_health)  # type: ignore[no-untyped-call]

    redis.connection.AbstractConnection.send_packed_command = counted  # type: ignore[method-assign]
    try:
        yield count
    finally:
        redis.connection.AbstractConnection.send_packed_command = original  # type: ignore[method-assign]


def per_request(call: WsgiCall, server: redis.Redis, n: int = 200) -> tuple[float, float]:
    """(round trips, commands) per request, averaged over ``n`` requests."""
    call()  # connections and scripts are ready
    before = int(server.info("stats")["total_commands_processed"])
    with counting_round_trips() as count:
        for _ in range(n):
            call()
    after = int(server.info("stats")["total_commands_processed"])
    commands = after - before - 1  # the first INFO is counted in ``after``
    return count[0] / n, commands / n


@dataclass
class Row:
    algorithm: str
    n: int
    ours: Subject
    theirs: Subject
    ours_trips: float = 0.0
    ours_commands: float = 0.0
    theirs_trips: float = 0.0
    theirs_commands: float = 0.0


def check_limited(call: WsgiCall, name: str) -> None:
    """Every limiter really limits: a 200 with rate-limit headers."""
    call()
    names = {k.lower() for k, _ in _last["headers"]}
    if not _last["status"].startswith("200") or "x-ratelimit-remaining" not in names:
        raise SystemExit(f"{name}: expected a 200 with X-RateLimit-* headers, got {_last}")


@dataclass
class Baselines:
    bare: Subject  # the bare Flask app
    minimal: Subject  # the minimal limiter
    in_request: Subject  # the bare Flask app with one bare EVALSHA in before_request
    minimal_trips: float = 0.0
    minimal_commands: float = 0.0


def run(rounds: int, batch: int) -> tuple[list[Row], Baselines]:
    if rounds * batch + 1000 >= QUOTA:
        raise SystemExit(f"--rounds x --batch must stay under {QUOTA - 1000} (the limits' quota)")
    sys.path.insert(0, str(ROOT))  # tests.servers starts and stops redis-server by PID
    from tests.servers import start_redis

    server = start_redis()
    client = server.client()
    try:
        base = Baselines(
            Subject("bare Flask", wsgi_caller(bare_app())[0]),
            Subject("minimal limiter", wsgi_caller(minimal_app(server.url))[0]),
            Subject("bare Flask + 1 EVALSHA", wsgi_caller(floor_app(client))[0]),
        )
        check_limited(base.minimal.call, base.minimal.name)
        rows: list[Row] = []
        for algorithm in ALGORITHMS:
            for n in LIMITS:
                ours = Subject(
                    f"ours {algorithm} x{n}", wsgi_caller(ours_app(server.url, algorithm, n))[0]
                )
                theirs = Subject(
                    f"Flask-Limiter {ALGORITHMS[algorithm]} x{n}",
                    wsgi_caller(flask_limiter_app(server.url, algorithm, n))[0],
                )
                for subject in (ours, theirs):
                    check_limited(subject.call, subject.name)
                rows.append(Row(algorithm, n, ours, theirs))
        base.minimal_trips, base.minimal_commands = per_request(base.minimal.call, client)
        for row in rows:
            row.ours_trips, row.ours_commands = per_request(row.ours.call, client)
            row.theirs_trips, row.theirs_commands = per_request(row.theirs.call, client)
        subjects = [base.bare, base.minimal, base.in_request]
        subjects += [s for row in rows for s in (row.ours, row.theirs)]
        measure(subjects, rounds, batch, between=client.flushall)
        return rows, base
    finally:
        client.close()
        server.stop()


def overheads(subject: Subject, bare: Subject) -> list[float]:
    """The subject's overhead over the bare app in each round, us."""
    return [mine - theirs for mine, theirs in zip(subject.per_round, bare.per_round, strict=True)]


@dataclass
class Ratio:
    """A ratio taken within each round: the median over the rounds, its 95 % confidence
    interval, and the extremes."""

    median: float
    low: float
    high: float
    ci_low: float
    ci_high: float

    @classmethod
    def of(cls, numerators: list[float], denominators: list[float]) -> Ratio:
        ratios = [a / b for a, b in zip(numerators, denominators, strict=True)]
        return cls(statistics.median(ratios), min(ratios), max(ratios), *median_ci(ratios))

    def text(self) -> str:
        return (
            f"{self.median:.2f}x [{self.ci_low:.2f}-{self.ci_high:.2f}] "
            f"({self.low:.2f}-{self.high:.2f})"
        )


@dataclass
class Goal:
    text: str
    measured: str
    met: bool

    def row(self) -> str:
        return f"| {self.text} | {self.measured} | {'met' if self.met else '**not met**'} |"


def table(rows: Iterable[Row], base: Baselines) -> tuple[str, list[Goal]]:
    """The Markdown table of every row, and the goals with what was measured."""
    rows = list(rows)
    bare_rounds = base.bare.per_round
    minimal = overheads(base.minimal, base.bare)
    lines = [
        "| algorithm | limits | ours overhead (us) | minimal limiter (us) | ours / minimal "
        "| Flask-Limiter (us) | ours / Flask-Limiter | round trips FL / ours "
        "| commands FL / ours |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    to_minimal: dict[str, Ratio] = {}
    to_theirs: dict[tuple[str, int], Ratio] = {}
    trips_ok = True
    for row in rows:
        ours = overheads(row.ours, base.bare)
        theirs = overheads(row.theirs, base.bare)
        vs_minimal = Ratio.of(ours, minimal)
        vs_theirs = Ratio.of(ours, theirs)
        to_theirs[(row.algorithm, row.n)] = vs_theirs
        minimal_goal = ""
        if row.n == 1:
            to_minimal[row.algorithm] = vs_minimal
            minimal_goal = " met" if vs_minimal.median <= GOAL_MINIMAL else " **not met**"
        goal = GOAL_RATIO[row.n]
        theirs_goal = "met" if vs_theirs.median <= goal else "**not met**"
        trips_ok = trips_ok and row.ours_trips <= 1.0
        lines.append(
            f"| {row.algorithm} | {row.n} | {statistics.median(ours):.1f} "
            f"| {statistics.median(minimal):.1f} | {vs_minimal.text()}{minimal_goal} "
            f"| {statistics.median(theirs):.1f} | {vs_theirs.text()} (<= {goal:.2f}x "
            f"{theirs_goal}) | {row.theirs_trips:g} / {row.ours_trips:g} "
            f"| {row.theirs_commands:.0f} / {row.ours_commands:.0f} |"
        )
    in_request = overheads(base.in_request, base.bare)
    lines += [
        "",
        f"{len(bare_rounds)} rounds of {len(base.bare.samples) // max(1, len(bare_rounds))} "
        "requests per app. Medians over the rounds: bare Flask "
        f"{statistics.median(bare_rounds):.1f} us per request; the minimal limiter "
        f"{statistics.median(minimal):.1f} us over it "
        f"({base.minimal_trips:g} round trip, {base.minimal_commands:.0f} commands per request); "
        f"one bare redis-py EVALSHA of a one-GET script in before_request (no headers) "
        f"{statistics.median(in_request):.1f} us over it.",
    ]
    goals = [
        Goal(
            f"ours <= {GOAL_MINIMAL:.1f}x the minimal limiter's overhead, 1 limit, every algorithm",
            ", ".join(f"{a} {r.median:.2f}x" for a, r in to_minimal.items()),
            all(r.median <= GOAL_MINIMAL for r in to_minimal.values()),
        )
    ]
    for n, goal in GOAL_RATIO.items():
        chosen = {a: r for (a, k), r in to_theirs.items() if k == n}
        goals.append(
            Goal(
                f"ours <= {goal:.2f}x Flask-Limiter's overhead, {n} limit{'s' if n > 1 else ''}, "
                "every algorithm",
                ", ".join(f"{a} {r.median:.2f}x" for a, r in chosen.items()),
                all(r.median <= goal for r in chosen.values()),
            )
        )
    goals.append(
        Goal(
            "1 round trip per request for 1 and 3 limits",
            ", ".join(sorted({f"{row.ours_trips:g}" for row in rows})),
            trips_ok,
        )
    )
    return "\n".join(lines), goals


def _minimal_script(app: Flask) -> Any:
    """The closure cell holding the redis-py ``Script`` the minimal limiter's hook calls."""
    hook = app.before_request_funcs[None][0]
    for cell in hook.__closure__ or ():
        if isinstance(cell.cell_contents, redis.commands.core.Script):
            return cell
    raise AssertionError("the minimal limiter's hook holds no Script")


def canned_minimal(url: str) -> Flask:
    """The minimal limiter with its script call replaced by a fixed answer: its own Python."""
    app = minimal_app(url)
    app.name = "minimal-canned"
    _minimal_script(app).cell_contents = lambda keys, args: [1, 3_600_000]
    return app


def minimal_source() -> str:
    """The minimal limiter's code, as it runs in this benchmark."""
    return inspect.getsource(minimal_app)


def breakdown(spec: str, rounds: int, batch: int) -> str:
    """Where our overhead goes on one row (``algorithm:n``), every part timed in the same rounds.

    - the extension's own Python: our app with the storage call replaced by its recorded
      answer, minus the bare Flask app;
    - the storage call inside a request: our whole request minus that;
    - of which the in-request floor: the bare Flask app with one bare EVALSHA in
      ``before_request``, minus the bare Flask app (a round trip made between two pieces of
      Python work costs more than one timed in a tight loop: caches and the idle redis-server
      have to wake up);
    - of which our script's server time beyond a one-GET script (``INFO commandstats``), and our
      client side against redis-py's (``storage.evaluate`` minus the bare redis-py ``EVALSHA``
      and the server time, tight loops: the hand-packed call, the lean pool, ``script_args`` and
      ``parse_reply`` against redis-py's ``execute_command``; negative when ours is cheaper).
    """
    algorithm, _, n = spec.partition(":")
    sys.path.insert(0, str(ROOT))
    from flask_distlimit.engine.scripts import script_args
    from tests.servers import start_redis

    server = start_redis()
    client = server.client()
    try:
        app = ours_app(server.url, algorithm, int(n or 1))
        call = wsgi_caller(app)[0]
        state = app.extensions["distlimit"]
        guard, storage = state.guard, state.storage
        seen: list[Any] = []
        original = guard.evaluate

        def recording(checks: Any, **kwargs: Any) -> Any:
            outcome = original(checks, **kwargs)
            seen.append((list(checks), outcome))
            return outcome

        guard.evaluate = recording
        call()
        guard.evaluate = original
        checks, outcome = seen[0]
        canned = ours_app(server.url, algorithm, int(n or 1))
        canned.extensions["distlimit"].guard.evaluate = lambda checks, **kwargs: outcome
        keys, args = script_args(checks)
        sha = client.script_load(storage._script.script)  # the same script, for INFO commandstats
        get_sha = client.script_load("return redis.call('GET', KEYS[1])")

        subjects = [
            Subject("bare", wsgi_caller(bare_app())[0]),
            Subject("floor app", wsgi_caller(floor_app(client))[0]),
            Subject("whole", call),
            Subject("canned", wsgi_caller(canned)[0]),
            Subject("get", evalsha_caller(client)),
            Subject("storage", lambda: storage.evaluate(checks)),
            Subject("minimal", wsgi_caller(minimal_app(server.url))[0]),
            Subject("minimal canned", wsgi_caller(canned_minimal(server.url))[0]),
        ]
        measure(subjects, rounds, batch, between=client.flushall)
        m = {s.name: s.median_us for s in subjects}
        server_us = {}
        minimal_script = _minimal_script(minimal_app(server.url)).cell_contents
        minimal_sha = client.script_load(minimal_script.script)
        for name, digest, k, a in (
            ("ours", sha, keys, args),
            ("get", get_sha, ["x"], []),
            ("minimal", minimal_sha, ["rl:x"], [3_600_000]),
        ):
            client.config_resetstat()
            for _ in range(1000):
                client.evalsha(digest, len(k), *k, *a)
            server_us[name] = float(client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])
        storage_in_request = m["whole"] - m["canned"]
        floor = m["floor app"] - m["bare"]
        layers = [
            ("extension's own Python (hooks, identity, keys, headers)", m["canned"] - m["bare"]),
            ("our storage call inside the request", storage_in_request),
            ("- of which the in-request floor (one bare EVALSHA)", floor),
            ("- beyond the floor", storage_in_request - floor),
            (
                f"  - our script's server time beyond a GET script "
                f"({server_us['ours']:.1f} vs {server_us['get']:.1f} us)",
                server_us["ours"] - server_us["get"],
            ),
            (
                f"  - our client side against redis-py's bare call ({len(keys)} keys, a reply of "
                f"{1 + 6 * len(keys)} integers; tight loops, server time taken out)",
                m["storage"] - m["get"] - (server_us["ours"] - server_us["get"]),
            ),
        ]
        explained = sum(value for name, value in layers[4:])
        layers.append(
            ("  - the rest (a longer call costs more inside a request)", layers[3][1] - explained)
        )
        lines = [f"Breakdown of our overhead, {algorithm} x{n or 1} (medians, us):", ""]
        lines += ["| part | us |", "|---|---|"]
        lines += [f"| {name} | {value:.1f} |" for name, value in layers]
        lines.append(f"| total overhead | {m['whole'] - m['bare']:.1f} |")
        own, call_ = m["minimal canned"] - m["bare"], m["minimal"] - m["minimal canned"]
        lines += [
            f"| the minimal limiter's total overhead | {m['minimal'] - m['bare']:.1f} |",
            f"| - its own Python (two hooks, 3 headers; script answer canned) | {own:.1f} |",
            f"| - its script call inside the request (stock redis-py Script) | {call_:.1f} |",
            f"| &nbsp;&nbsp;- its script's server time (INFO commandstats) "
            f"| {server_us['minimal']:.1f} |",
            f"| ours minus minimal: own Python | {m['canned'] - m['bare'] - own:+.1f} |",
            f"| ours minus minimal: the Redis call in the request "
            f"| {storage_in_request - call_:+.1f} |",
            f"| ours minus minimal: server time "
            f"| {server_us['ours'] - server_us['minimal']:+.1f} |",
        ]
        return "\n".join(lines)
    finally:
        client.close()
        server.stop()


def wire(rounds: int, batch: int) -> str:
    """What the RESP encoding of a 3-check call costs in redis-py (tight loops, one-GET scripts).

    Same server work; only the shape differs: 14 ARGV integers vs one packed ARGV string, and a
    19-integer array reply vs one bulk string split in Python.
    """
    sys.path.insert(0, str(ROOT))
    from tests.servers import start_redis

    server = start_redis()
    client = server.client()
    try:
        body = "1700000000000000" + ",1,1000000000,999999,3599000000,0,0" * 3
        get = client.script_load("return redis.call('GET', KEYS[1])")
        array = client.script_load(f"redis.call('GET', KEYS[1]) return {{{body}}}")
        text = client.script_load(f"redis.call('GET', KEYS[1]) return '{body}'")
        args: list[str | int] = ["k1", "k2", "k3", -1, 0, *[1, 1000000000, 3600000000, 1] * 3]
        packed = ["k1", "k2", "k3", ",".join(str(a) for a in args[3:])]

        def split_ints() -> None:
            [int(x) for x in client.evalsha(text, 1, "x").split(b",")]

        subjects = [
            Subject("bare EVALSHA (1 key, nil reply)", lambda: client.evalsha(get, 1, "x")),
            Subject("19-integer array reply", lambda: client.evalsha(array, 1, "x")),
            Subject("same 19 integers as one string, split", split_ints),
            Subject("3 keys + 14 ARGV", lambda: client.evalsha(get, 3, *args)),
            Subject("3 keys + 1 packed ARGV string", lambda: client.evalsha(get, 3, *packed)),
        ]
        measure(subjects, rounds, batch, between=client.flushall)
        lines = ["| call shape | median us |", "|---|---|"]
        lines += [f"| {s.name} | {s.median_us:.1f} |" for s in subjects]
        return "\n".join(lines)
    finally:
        client.close()
        server.stop()


def wakeups(rounds: int, batch: int) -> str:
    """What waiting for Redis costs on this machine: one raw EVALSHA (a one-GET script, packed
    once, written and read on a bare socket: no client library at all) waiting in a blocking
    ``recv`` against the same call spinning on a non-blocking one, alone and inside a bare Flask
    request. The difference is the price of the process sleeping while Redis works (on a VM, the
    idle virtual CPU halts and must be woken), which every Redis limiter pays in a request; it
    is NOT a mode of the library (spinning would burn a core per waiting request).
    """
    sys.path.insert(0, str(ROOT))
    from tests.servers import start_redis

    server = start_redis()
    client = server.client()
    connection: Any = None
    try:
        sha = client.script_load("return redis.call('GET', KEYS[1])")
        connection = client.connection_pool.get_connection()
        connection.connect()
        sock = connection._sock
        command = b"".join(connection.pack_command("EVALSHA", sha, 1, "bench:floor"))

        def blocking() -> None:
            sock.sendall(command)
            if not sock.recv(4096):
                raise ConnectionError("closed")

        def spinning() -> None:
            sock.sendall(command)
            sock.setblocking(False)
            try:
                while True:
                    try:
                        if not sock.recv(4096):
                            raise ConnectionError("closed")
                        return
                    except BlockingIOError:
                        continue
            finally:
                sock.settimeout(5.0)

        def in_request(call: WsgiCall, name: str) -> WsgiCall:
            app = bare_app()
            app.name = name
            app.before_request(call)
            return wsgi_caller(app)[0]

        subjects = [
            Subject("bare Flask", wsgi_caller(bare_app())[0]),
            Subject("raw EVALSHA, blocking recv", blocking),
            Subject("raw EVALSHA, spinning recv", spinning),
            Subject("bare Flask + raw EVALSHA, blocking", in_request(blocking, "blocking")),
            Subject("bare Flask + raw EVALSHA, spinning", in_request(spinning, "spinning")),
        ]
        measure(subjects, rounds, batch, between=client.flushall)
        bare = subjects[0].median_us
        lines = ["| call | median us | inside a request (over bare Flask) |", "|---|---|---|"]
        for alone, inside in ((subjects[1], subjects[3]), (subjects[2], subjects[4])):
            lines.append(
                f"| {alone.name} | {alone.median_us:.1f} | {inside.median_us - bare:.1f} |"
            )
        return "\n".join(lines)
    finally:
        if connection is not None:
            connection.disconnect()
        client.close()
        server.stop()


def cpu_time(rounds: int, batch: int, seed: int = 1) -> str:
    """This process's CPU time per request over the bare app's, for ours (every row), the
    minimal limiter and Flask-Limiter: a second table that noise hurts less than wall time.

    Wall time of a request is mostly the wait for Redis (a sleeping process, a VM waking up);
    ``time.process_time_ns`` counts only the Python and the system calls of this process, so
    what a limiter does around its call stands out. Same apps, interleaved rounds as the main
    table (Redis emptied, untimed, before every batch); a subject's figure in a round is its
    batch's CPU time divided by ``batch``, minus the bare app's; every ratio is taken within one
    round, and the median over the rounds is reported with its 95 % confidence interval and the
    lowest and highest round.
    The last columns add the Redis main thread's CPU time over each batch (``INFO cpu``).
    """
    if batch + 200 >= LOG_QUOTA:
        raise SystemExit(f"--batch must stay under {LOG_QUOTA - 200} (the log's quota)")
    sys.path.insert(0, str(ROOT))
    from tests.servers import start_redis

    server = start_redis()
    client = server.client()
    try:
        subjects: dict[str, WsgiCall] = {
            "bare": wsgi_caller(bare_app())[0],
            "minimal": wsgi_caller(minimal_app(server.url))[0],
        }
        for algorithm in ALGORITHMS:
            for n in LIMITS:
                subjects[f"ours {algorithm} {n}"] = wsgi_caller(ours_app(server.url, algorithm, n))[
                    0
                ]
                subjects[f"fl {algorithm} {n}"] = wsgi_caller(
                    flask_limiter_app(server.url, algorithm, n)
                )[0]
        per_round: dict[str, list[float]] = {name: [] for name in subjects}
        with_redis: dict[str, list[float]] = {name: [] for name in subjects}  # + Redis's CPU

        def redis_cpu() -> float:
            """Redis's main thread's CPU time so far, us (getrusage, as INFO gives it)."""
            cpu = client.info("cpu")
            return (cpu["used_cpu_user_main_thread"] + cpu["used_cpu_sys_main_thread"]) * 1e6

        for name, call in subjects.items():  # warm up: connections, scripts, caches
            if name != "bare":
                check_limited(call, name)
            client.flushall()
            for _ in range(200):
                call()
        rng = random.Random(seed)
        clock = time.process_time_ns
        for _ in range(rounds):
            order = list(subjects.items())
            rng.shuffle(order)
            for name, call in order:
                client.flushall()
                gc.collect()
                gc.disable()
                redis_before = redis_cpu()
                try:
                    start = clock()
                    for _ in range(batch):
                        call()
                    spent = clock() - start
                finally:
                    gc.enable()
                redis_spent = redis_cpu() - redis_before
                per_round[name].append(spent / batch / 1000)
                with_redis[name].append((spent / 1000 + redis_spent) / batch)
        bare = per_round["bare"]

        def over(name: str, table: dict[str, list[float]] = per_round) -> list[float]:
            return [a - b for a, b in zip(table[name], table["bare"], strict=True)]

        def least(name: str) -> float:
            """The subject's lowest round over the bare app's: interference only adds CPU."""
            return min(per_round[name]) - min(bare)

        minimal = over("minimal")
        minimal_both = over("minimal", with_redis)
        lines = [
            "| algorithm | limits | ours CPU over bare (us) | ours / minimal "
            "| lowest rounds: ours / minimal | Flask-Limiter (us) | ours / Flask-Limiter "
            "| lowest rounds: ours / Flask-Limiter | with Redis's CPU: ours (us) "
            "| ours / minimal | ours / Flask-Limiter |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for algorithm in ALGORITHMS:
            for n in LIMITS:
                name, fl = f"ours {algorithm} {n}", f"fl {algorithm} {n}"
                ours, theirs = over(name), over(fl)
                lines.append(
                    f"| {algorithm} | {n} | {statistics.median(ours):.1f} "
                    f"| {Ratio.of(ours, minimal).text()} "
                    f"| {least(name) / least('minimal'):.2f}x "
                    f"| {statistics.median(theirs):.1f} | {Ratio.of(ours, theirs).text()} "
                    f"| {least(name) / least(fl):.2f}x "
                    f"| {statistics.median(over(name, with_redis)):.1f} "
                    f"| {Ratio.of(over(name, with_redis), minimal_both).text()} "
                    f"| {Ratio.of(over(name, with_redis), over(fl, with_redis)).text()} |"
                )
        lines += [
            "",
            f"{rounds} rounds of {batch} requests per app, process CPU time "
            f"(time.process_time_ns). Medians over the rounds: bare Flask "
            f"{statistics.median(bare):.1f} us per request; the minimal limiter "
            f"{statistics.median(minimal):.1f} us over it. Lowest rounds: each app's least CPU "
            "per request over the bare app's least (another process on the machine can only add "
            "to an app's CPU time, through caches and the scheduler). With Redis's CPU: the "
            "process's CPU plus the Redis main thread's (INFO cpu, read before and after each "
            f"batch), per request over the bare app's; the minimal limiter's "
            f"{statistics.median(minimal_both):.1f} us.",
        ]
        return "\n".join(lines)
    finally:
        client.close()
        server.stop()


def opcodes(requests: int = 50) -> str:
    """Python bytecode instructions and Python function calls per request over the bare app's,
    for the minimal limiter and ours on every row: counted with ``sys.settrace``
    (``f_trace_opcodes``), so no machine noise touches them. They measure the Python side only
    (not C code such as werkzeug's header checks or a frozen dataclass's setters, nor system
    calls, nor Redis): a regression guard and a guide, not a time."""
    sys.path.insert(0, str(ROOT))
    from tests.servers import start_redis

    server = start_redis()
    counts = [0, 0]

    def traced(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        counts[1] += 1
        return step

    def step(frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            counts[0] += 1
        return step

    def count(call: WsgiCall) -> tuple[float, float]:
        for _ in range(20):  # connections, scripts, caches
            call()
        counts[:] = [0, 0]
        sys.settrace(traced)
        try:
            for _ in range(requests):
                call()
        finally:
            sys.settrace(None)
        return counts[0] / requests, counts[1] / requests

    try:
        bare = count(wsgi_caller(bare_app())[0])
        rows = [("minimal limiter", count(wsgi_caller(minimal_app(server.url))[0]))]
        for algorithm in ALGORITHMS:
            for n in LIMITS:
                call = wsgi_caller(ours_app(server.url, algorithm, n))[0]
                rows.append((f"ours {algorithm} x{n}", count(call)))
        lines = ["| app | opcodes over bare | Python calls over bare |", "|---|---|---|"]
        lines += [
            f"| {name} | {ops - bare[0]:.0f} | {calls - bare[1]:.0f} |"
            for name, (ops, calls) in rows
        ]
        lines.append(
            f"\nThe bare app: {bare[0]:.0f} opcodes, {bare[1]:.0f} Python calls per request."
        )
        return "\n".join(lines)
    finally:
        server.stop()


def profile(spec: str, calls: int) -> None:
    """cProfile of our app on one row (``algorithm:n``), top functions by own time."""
    algorithm, _, n = spec.partition(":")
    sys.path.insert(0, str(ROOT))
    from tests.servers import start_redis

    server = start_redis()
    try:
        call = wsgi_caller(ours_app(server.url, algorithm, int(n or 1)))[0]
        for _ in range(500):
            call()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            call()
        profiler.disable()
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out).strip_dirs()
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(40)
        print(out.getvalue())
    finally:
        server.stop()


#: ``DISTLIMIT_REQUEST_TOKENS`` of our apps: ``"auto"`` (the default: a calm storage's calls
#: carry no request token), ``"always"`` with ``--always-tokens`` (what a token costs a request).
REQUEST_TOKENS = {"mode": "auto"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch", type=int, default=200)
    parser.add_argument(
        "--write",
        type=Path,
        help="also write the tables to this Markdown file, and the goals' table to --summary",
    )
    parser.add_argument(
        "--summary",
        type=Path,
        default=ROOT / "docs" / "benchmarks.md",
        help="the page whose goals' block --write rewrites (between its markers)",
    )
    parser.add_argument(
        "--gunicorn", action="store_true", help="also run bench/bench_gunicorn.py (wrk)"
    )
    parser.add_argument("--pairs", type=int, default=7, help="gunicorn rounds")
    parser.add_argument("--seconds", type=float, default=5.0, help="one wrk run, seconds")
    parser.add_argument("--note", default="", help="a line printed above the written tables")
    parser.add_argument("--profile", metavar="ALGORITHM:N", help="profile our app on one row")
    parser.add_argument("--profile-calls", type=int, default=5000)
    parser.add_argument("--breakdown", metavar="ALGORITHM:N", help="time our layers on one row")
    parser.add_argument("--wire", action="store_true", help="time RESP shapes of a 3-check call")
    parser.add_argument(
        "--wakeups", action="store_true", help="time a raw EVALSHA blocking vs spinning"
    )
    parser.add_argument(
        "--cpu", action="store_true", help="this process's CPU time per request over bare"
    )
    parser.add_argument(
        "--opcodes", action="store_true", help="Python opcodes and calls per request over bare"
    )
    parser.add_argument(
        "--always-tokens",
        action="store_true",
        help='an experiment, never a goal\'s figure: ours with DISTLIMIT_REQUEST_TOKENS="always" '
        "(every call carries a request token: what its SET costs a request)",
    )
    args = parser.parse_args(argv)
    if args.always_tokens:
        if args.write:
            parser.error("--always-tokens is an experiment: it cannot --write the goals' tables")
        REQUEST_TOKENS["mode"] = "always"
    if args.opcodes:
        print(opcodes())
        return 0
    if args.cpu:
        print(cpu_time(args.rounds, args.batch))
        return 0
    if args.wire:
        print(wire(args.rounds, args.batch))
        return 0
    if args.wakeups:
        print(wakeups(args.rounds, args.batch))
        return 0
    if args.breakdown:
        print(breakdown(args.breakdown, args.rounds, args.batch))
        return 0
    if args.profile:
        profile(args.profile, args.profile_calls)
        return 0
    if args.rounds < 7 or (args.gunicorn and args.pairs < 7):
        raise SystemExit("--rounds, --pairs: at least 7 (every ratio is a median over them)")
    started = _when()
    rows, base = run(args.rounds, args.batch)
    text, goals = table(rows, base)
    served = ""
    if args.gunicorn:
        import bench_gunicorn  # beside this file

        served, more = bench_gunicorn.table(bench_gunicorn.run(args.pairs, args.seconds))
        goals += more
    print(text)
    if served:
        print("\n" + served)
    print("\n" + "\n".join(goal.row() for goal in goals))
    print("all goals met" if all(goal.met for goal in goals) else "some goals NOT met")
    if args.write:
        command = f"python bench/bench_overhead.py --rounds {args.rounds} --batch {args.batch}"
        if args.gunicorn:
            command += f" --gunicorn --pairs {args.pairs} --seconds {args.seconds:g}"
        command += f" --write {args.write}"
        when = f"{started} to {_when()}"
        args.write.parent.mkdir(parents=True, exist_ok=True)
        kept = ""  # hand-written analysis below the marker survives a re-run
        if args.write.exists() and _MARKER in args.write.read_text():
            kept = args.write.read_text().split(_MARKER, 1)[1]
        page = _document(text, served, command, when, args.note)
        args.write.write_text(page + "\n" + _MARKER + kept)
        write_summary(args.summary, _summary(goals, command, when, args.note))
    return 0


_MARKER = "<!-- end of the generated part; the analysis below is kept on re-runs -->"
_BEGIN = "<!-- goals: generated by bench/bench_overhead.py --write; edit the bench, not this -->"
_END = "<!-- end of goals -->"


def _when() -> str:
    """The time (UTC) and the machine's load average, for the record."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{now} (load average {load})"


def _document(text: str, served: str, command: str, when: str, note: str) -> str:
    method = (__doc__ or "").split("\n\n", 2)[2].strip()
    parts = [
        "# Per-request overhead: the minimal limiter and Flask-Limiter\n",
        "Command (from the repository root; it starts and stops its own `redis-server` and",
        "gunicorn servers):\n",
        f"    {command}\n",
        f"{method}\n",
        "## Result\n",
        f"Measured {when}, {_versions()}." + (f" **{note}**" if note else "") + "\n",
        f"{text}\n",
    ]
    if served:
        parts += ["## Under gunicorn\n", f"{served}\n"]
    parts += [
        "## The minimal limiter\n",
        "```python",
        "# fragment: from bench/bench_overhead.py (QUOTA, _view and the imports are the bench's)",
        minimal_source().rstrip(),
        "```\n",
    ]
    return "\n".join(parts)


def _versions() -> str:
    from importlib.metadata import version

    return ", ".join(
        f"{name} {version(name)}" for name in ("flask", "redis", "Flask-Limiter", "gunicorn")
    )


def _summary(goals: list[Goal], command: str, when: str, note: str) -> str:
    lines = [
        _BEGIN,
        "",
        f"Measured {when}" + (f". **{note}**" if note else "") + ". Command (re-run it to update",
        "this table and [the overhead page](bench/overhead.md)):",
        "",
        f"    {command}",
        "",
        "| goal | measured (median over interleaved rounds) | |",
        "|---|---|---|",
        *(goal.row() for goal in goals),
        "",
        "The minimal limiter, the floor these goals compare with (one round trip, three commands,",
        "three headers):",
        "",
        "```python",
        "# fragment: from bench/bench_overhead.py (QUOTA, _view and the imports are the bench's)",
        minimal_source().rstrip(),
        "```",
        "",
        _END,
    ]
    return "\n".join(lines)


def write_summary(path: Path, block: str) -> None:
    """Replace the goals' block of ``path`` (between its markers), or append it."""
    text = path.read_text() if path.exists() else ""
    if _BEGIN in text and _END in text:
        head, rest = text.split(_BEGIN, 1)
        text = head + block + rest.split(_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


if __name__ == "__main__":
    raise SystemExit(main())
