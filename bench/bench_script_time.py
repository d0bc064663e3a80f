"""How long can one request make Redis run one script call? The worst cases, in Redis's own time.

    python bench/bench_script_time.py                                  # ~15 s on 2 cores
    python bench/bench_script_time.py --write docs/bench/script-time.md

Redis runs a script alone: while one EVALSHA runs, every other client waits. If a request the
library accepts could make one call run for long (a large cost on a large log limit wrote one
sorted-set member per unit: 258 ms for 100,000 units), concurrent calls would time out, the
breaker would open, and under the ``open`` policy every limit would be off. The library's bound
(issue 10): **no accepted request makes one script call run longer than 1 ms** on this 2-core
machine. This benchmark measures it.

Every row builds a worst state for one algorithm at its largest accepted limit and cost (untimed:
through the script itself, with injected times; a state used by several keys is built once and
copied with ``COPY``), then runs ONE ``EVALSHA`` exactly as ``RedisStorage`` sends it, and reads
Redis's own accounting of that call:

- **SLOWLOG** (``slowlog-log-slower-than 0``): the call's duration as Redis measured it, in us;
- **INFO commandstats**, reset before the call: the commands the script ran (every command but
  the ``EVALSHA`` itself and the benchmark's own ``SLOWLOG``/``CONFIG``), which do not depend on
  the machine, and the log entries it removed or wrote where it matters (``LLEN`` before and
  after).

Rows run in interleaved rounds (each round runs every row once, in a shuffled order) so that the
noise of a shared machine spreads over all rows; each round measures a row twice: *cold* (right
after the other rows' work) and *warm* (the same call ran once just before on a copy of the
state, as on a busy server, where a long call makes others wait). The tables give the median and
the maximum over the rounds, and how many calls of all went over the bound.

The largest accepted limits and costs are read from ``flask_distlimit.core.algorithms`` and the
twins' modules (and ``limits.py``'s bounds: 10**12 units, 366 days), so the same file measures any
version. Calls
inject their time (the states are built at chosen times); a production call reads Redis's
``TIME`` instead, one command more.

A last table times what is not a script call but still stops Redis: freeing a full log key
(``DEL``; a key whose TTL ends is freed the same way unless the server runs with
``lazyfree-lazy-expire yes``).
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout this file is in, before any installed copy

from flask_distlimit.core import algorithms  # noqa: E402
from flask_distlimit.core.algorithms import Algorithm  # noqa: E402
from flask_distlimit.core.decision import Check  # noqa: E402
from flask_distlimit.engine import gcra, sliding_window_log  # noqa: E402
from flask_distlimit.engine.scripts import SCRIPT_SOURCE, script_args  # noqa: E402

ROUNDS = 30
BOUND_US = 1000
T0 = 20_000 * 86_400 * 1_000_000  # an injected "now", aligned with every period used here
DAY = 86_400
YEAR = 366 * DAY  # the longest period limits.py accepts
HUGE = 10**12  # the largest amount limits.py accepts
HUGE_TEXT = "10^12"
#: The log's limit, the number of limits one request may carry (read from the version measured).
LOG_LIMIT: int = sliding_window_log.MAX_LOG_LIMIT
MANY: int = getattr(algorithms, "MAX_LIMITS_PER_REQUEST", 16)
FASTEST_GCRA: int = gcra.MAX_GCRA_RATE  # per second
#: The four algorithms whose state is a few numbers whatever the limit.
COUNTERS: tuple[Algorithm, ...] = ("fixed_window", "sliding_window_counter", "token_bucket", "gcra")
#: The bench's own commands, left out of "commands the script ran".
_OWN = ("cmdstat_evalsha", "cmdstat_slowlog", "cmdstat_config", "cmdstat_info", "cmdstat_llen")


@dataclass
class Call:
    """One limit of the measured call: its algorithm, limit, period (s) and cost."""

    algorithm: Algorithm
    limit: int
    period: int
    cost: int


@dataclass
class Row:
    name: str
    calls: list[Call]
    #: builds the state under the given keys (untimed); answers the injected now of the call
    prepare: Prepare
    refund: bool = False
    durations: list[int] = field(default_factory=list)  # SLOWLOG, us, warm
    cold: list[int] = field(default_factory=list)  # SLOWLOG, us, cold
    usec: list[int] = field(default_factory=list)  # commandstats usec of the EVALSHA
    commands: dict[str, int] = field(default_factory=dict)  # of the last round
    members: tuple[int, int] = (0, 0)  # LLEN summed over the keys before and after (last round)


Build = Callable[["Bench", list[str]], None]
Prepare = Callable[["Bench", list[str]], int]


def at(now: int, *builds: Build) -> Prepare:
    """A row's preparation: build these states under its keys, then call at ``now``."""

    def prepare(bench: Bench, keys: list[str]) -> int:
        for build in builds:
            build(bench, keys)
        return now

    return prepare


class Bench:
    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.script = client.register_script(SCRIPT_SOURCE)
        self.templates: dict[str, str] = {}

    def run(
        self,
        keys: list[str],
        calls: list[Call],
        now: int,
        costs: list[int] | None = None,
        refund: bool = False,
        client: redis.client.Pipeline | None = None,
    ) -> object:
        checks = [
            Check(k, c.algorithm, c.limit, c.period, c.cost if costs is None else costs[i])
            for i, (k, c) in enumerate(zip(keys, calls, strict=True))
        ]
        k, a = script_args(checks, now, refund=refund)
        return self.script(k, a, client=client)

    def fill_log(self, key: str, limit: int, costs: list[int], start: int) -> None:
        """One log request per cost, 1 us apart from ``start`` (pipelined, untimed)."""
        call = [Call("sliding_window_log", limit, DAY, 0)]
        pipe = self.client.pipeline(transaction=False)
        for i, cost in enumerate(costs):
            self.run([key], call, start + i, [cost], client=pipe)
            if len(pipe) >= 2000:
                pipe.execute()
        pipe.execute()

    def copy(self, name: str, build: Callable[[str], None], keys: list[str]) -> None:
        """Build a state once (under a template key) and copy it to every key."""
        template = self.templates.get(name)
        if template is None:
            template = f"template:{{x}}:{len(self.templates)}"
            build(template)
            self.client.persist(template)  # kept for every round
            self.templates[name] = template
        for key in keys:
            self.client.copy(template, key, replace=True)
            self.client.pexpire(key, DAY * 1000)


def _full_log(bench: Bench, keys: list[str]) -> None:
    """LOG_LIMIT requests of cost 1, the log's most entries (at T0 .. T0 + L - 1)."""
    bench.copy("full log", lambda t: bench.fill_log(t, LOG_LIMIT, [1] * LOG_LIMIT, T0), keys)


def _refund_log(bench: Bench, keys: list[str]) -> None:
    """L/2 - 1 requests of cost 1, one of cost L/2, one of 1: a refund of L/2 finds no entry
    of its cost newest (its own, which a rollback takes at once) and takes the oldest units,
    spread over L/2 entries."""
    half = LOG_LIMIT // 2
    bench.copy(
        "refund log",
        lambda t: bench.fill_log(t, LOG_LIMIT, [1] * (half - 1) + [half, 1], T0),
        keys,
    )


def _spent(algorithm: Algorithm, limit: int, period: int, when: int) -> Build:
    """A key of ``algorithm`` that consumed its whole limit at ``when``."""

    def build(bench: Bench, keys: list[str]) -> None:
        for key in keys:
            bench.run([key], [Call(algorithm, limit, period, limit)], when)

    return build


def rows() -> list[Row]:
    L, half = LOG_LIMIT, LOG_LIMIT // 2

    def log_day(cost: int) -> Call:
        return Call("sliding_window_log", L, DAY, cost)

    out: list[Row] = []
    # -- one limit per call: every algorithm at its largest limit and cost ---------------------
    for algorithm in COUNTERS:
        big = Call(algorithm, HUGE, YEAR, HUGE)
        out.append(
            Row(
                f"{algorithm} {HUGE_TEXT}/366 days, cost {HUGE_TEXT}: empty key, admitted",
                [big],
                at(T0),
            )
        )
        # spent: denied, with the retry computation (the counter: the previous window full)
        when = T0 - YEAR * 1_000_000 // 2 if algorithm == "sliding_window_counter" else T0
        spend = _spent(algorithm, HUGE, YEAR, when)
        out.append(
            Row(
                f"{algorithm} {HUGE_TEXT}/366 days, cost {HUGE_TEXT}: spent, denied",
                [big],
                at(T0 + 1, spend),
            )
        )
    fast = Call("gcra", FASTEST_GCRA, 1, FASTEST_GCRA)
    spend_fast = _spent("gcra", FASTEST_GCRA, 1, T0)
    out.append(
        Row(
            f"gcra {FASTEST_GCRA:,}/second (the fastest), cost {FASTEST_GCRA:,}: spent, denied",
            [fast],
            at(T0 + 1, spend_fast),
        )
    )
    # the log: L/2 of its L entries expired (a binary search, then one LTRIM of L/2 entries),
    # L/2 live; or all but the newest expired (an LTRIM of L - 1)
    half_gone = T0 + DAY * 1_000_000 + half
    all_but_one = T0 + DAY * 1_000_000 + L - 2
    out += [
        Row(f"sliding_window_log {L:,}/day, cost {L:,}: empty key, admitted", [log_day(L)], at(T0)),
        Row(
            f"sliding_window_log {L:,}/day: full ({L:,} requests of cost 1), cost 1, denied",
            [log_day(1)],
            at(T0 + L, _full_log),
        ),
        Row(
            f"sliding_window_log {L:,}/day: full, half of it expired, cost {L:,}, denied",
            [log_day(L)],
            at(half_gone, _full_log),
        ),
        Row(
            f"sliding_window_log {L:,}/day: full, half of it expired, cost {half:,}, admitted",
            [log_day(half)],
            at(half_gone, _full_log),
        ),
        Row(
            f"sliding_window_log {L:,}/day: full, all but the newest expired, cost 1, admitted",
            [log_day(1)],
            at(all_but_one, _full_log),
        ),
        Row(
            f"sliding_window_log: full at {L:,}/day, then the limit lowered to 1/day, cost 1",
            [Call("sliding_window_log", 1, DAY, 1)],
            at(T0 + L, _full_log),
        ),
        Row(
            f"sliding_window_log {L:,}/day, refund of cost {half:,} (Redis Cluster), not the "
            "newest entry's cost: the oldest units, in requests of cost 1",
            [log_day(half)],
            at(T0 + L, _refund_log),
            refund=True,
        ),
    ]
    # -- the most limits one request may carry, each in its worst state ------------------------
    n = MANY
    out += [
        Row(
            f"{n} x sliding_window_log {L:,}/day: full, half expired, cost {L:,}, denied",
            [log_day(L)] * n,
            at(half_gone, _full_log),
        ),
        Row(
            f"{n} x sliding_window_log {L:,}/day: full, half expired, cost {half:,}, admitted",
            [log_day(half)] * n,
            at(half_gone, _full_log),
        ),
        Row(
            f"{n} x sliding_window_log {L:,}/day: refund of cost {half:,}, not the newest "
            "entry's cost: the oldest units, in requests of cost 1",
            [log_day(half)] * n,
            at(T0 + L, _refund_log),
            refund=True,
        ),
    ]
    for algorithm in COUNTERS:
        when = T0 - YEAR * 1_000_000 // 2 if algorithm == "sliding_window_counter" else T0
        spend = _spent(algorithm, HUGE, YEAR, when)
        out.append(
            Row(
                f"{n} x {algorithm} {HUGE_TEXT}/366 days: spent, cost {HUGE_TEXT}, denied",
                [Call(algorithm, HUGE, YEAR, HUGE)] * n,
                at(T0 + 1, spend),
            )
        )
    return out


def _one_call(bench: Bench, row: Row, keys: list[str]) -> tuple[int, int, dict[str, int]]:
    """Build the row's state under ``keys`` and run its call once: (SLOWLOG us, commandstats
    us, the commands the script ran); ``row.members`` gets LLEN before and after."""
    client = bench.client
    client.delete(*keys)
    now = row.prepare(bench, keys)
    logs = [k for k, c in zip(keys, row.calls, strict=True) if c.algorithm == "sliding_window_log"]
    before = sum(client.llen(k) for k in logs)
    client.config_resetstat()
    client.slowlog_reset()
    bench.run(keys, row.calls, now, refund=row.refund)
    log = [e for e in client.slowlog_get(16) if e["command"].upper().startswith(b"EVALSHA")]
    stats = client.info("commandstats")
    row.members = (before, sum(client.llen(k) for k in logs))
    client.delete(*keys)  # freed now, not by a background thread during the next call
    commands = {
        name.removeprefix("cmdstat_").upper(): int(s["calls"])
        for name, s in stats.items()
        if not name.startswith(_OWN)
    }
    return int(log[0]["duration"]), int(stats["cmdstat_evalsha"]["usec"]), commands


def measure(bench: Bench, row: Row, round_number: int) -> None:
    """One cold call (right after the other rows' work), then the same call on a copy of the
    state run once just before (warm: the script's code paths in cache, as on a busy server)."""
    keys = [f"st:{{x}}:{round_number}:{i}:{c.algorithm}" for i, c in enumerate(row.calls)]
    duration, _, _ = _one_call(bench, row, keys)
    row.cold.append(duration)
    _one_call(bench, row, keys)  # the warm-up, untimed
    duration, usec, row.commands = _one_call(bench, row, keys)
    row.durations.append(duration)
    row.usec.append(usec)


@dataclass
class FreeRow:
    name: str
    members: int
    usec: list[int] = field(default_factory=list)


def measure_free(bench: Bench, rounds: int) -> list[FreeRow]:
    """DEL of a full log key: the same work as Redis expiring it (lazyfree-lazy-expire no)."""
    out = [FreeRow(f"DEL of a full sliding_window_log {LOG_LIMIT:,}/day key", 0)]
    for _ in range(rounds):
        _full_log(bench, ["free:{x}"])
        out[0].members = bench.client.llen("free:{x}")
        bench.client.config_resetstat()
        bench.client.delete("free:{x}")
        out[0].usec.append(int(bench.client.info("commandstats")["cmdstat_del"]["usec"]))
    return out


def render(
    table: list[Row], free: list[FreeRow], command: str, seconds: float, server: str, rounds: int
) -> str:
    worst = max(max(r.durations) for r in table)
    median_worst = max(statistics.median(r.durations) for r in table)
    cold_worst = max(max(r.cold) for r in table)
    cold_median_worst = max(statistics.median(r.cold) for r in table)
    calls = sum(len(r.durations) + len(r.cold) for r in table)
    over = sum(d > BOUND_US for r in table for d in (*r.durations, *r.cold))
    lines = [
        "# Script time: the worst case of one call",
        "",
        "Produced by `bench/bench_script_time.py` (its docstring explains the method). Command:",
        "",
        f"    {command}",
        "",
        f"Machine: {platform.machine()}, {platform.python_implementation()} "
        f"{platform.python_version()}, redis-py {redis.__version__}, redis-server {server}; "
        f"2 cores shared with other jobs; {rounds} rounds; run time {seconds:.0f} s. "
        f"Largest accepted: sliding_window_log {LOG_LIMIT:,} per window, gcra "
        f"{FASTEST_GCRA:,} per second, the others {HUGE:,} per 366 days; a cost up to the "
        f"limit; {MANY} limits per request.",
        "",
        f"**Worst call (warm): median {median_worst:,.0f} us, maximum {worst:,} us over all rows "
        f"and rounds (the bound: {BOUND_US:,} us). Cold: median {cold_median_worst:,.0f} us, "
        f"maximum {cold_worst:,} us. Calls over the bound: {over} of {calls:,}.**",
        "",
        "## One EVALSHA, in Redis's own accounting",
        "",
        "*Warm*: the same call ran once just before on a copy of the state (the script's code "
        "in the CPU's caches, as on a busy server, where a long call makes others wait). "
        "*Cold*: the call right after the other rows' work.",
        "",
        "| state and call | limits | SLOWLOG us, warm: median | max | cold: median | max "
        "| commands the script ran | log entries before -> after |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in table:
        commands = ", ".join(f"{name} {n}" for name, n in sorted(r.commands.items()))
        members = f"{r.members[0]:,} -> {r.members[1]:,}" if any(r.members) else "-"
        lines.append(
            f"| {r.name} | {len(r.calls)} | {statistics.median(r.durations):,.0f} | "
            f"{max(r.durations):,} | {statistics.median(r.cold):,.0f} | {max(r.cold):,} | "
            f"{commands} | {members} |"
        )
    lines += [
        "",
        "## Not a script call: freeing a full log key",
        "",
        "| operation | entries | us: median | max |",
        "|---|---:|---:|---:|",
    ]
    for f in free:
        lines.append(
            f"| {f.name} | {f.members:,} | {statistics.median(f.usec):,.0f} | {max(f.usec):,} |"
        )
    lines += [
        "",
        "## Reading the tables",
        "",
        "- The commands are the bound that does not depend on the machine: one hash or string "
        "command or three per limit for the counters; for the log at most 6 per limit (9 in a "
        "Redis Cluster refund, which gives back, then evaluates again) while at most 4 entries "
        "expired since its last call, and when more did an LLEN and a LINDEX per halving of "
        "the list (about 12 for 1,000 entries), whatever its limit and cost; every expired "
        "entry removed in one LTRIM, one written (the last column).",
        "- The time of a call grows with its limits: a request carries at most "
        f"{MANY}, each at most as costly as its worst row here. A production call also reads "
        "Redis's `TIME` (these inject their time): one command more.",
        "- The maxima are the machine's: rows whose script runs one command show spikes of "
        "several hundred microseconds too.",
        "- Freeing a log key (its TTL ending, or `DEL`) is not a script call but stops Redis as "
        "long; the log's largest limit keeps it short. `lazyfree-lazy-expire yes` moves it off "
        "Redis's main thread.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--only", help="run only the rows whose name contains this text")
    parser.add_argument("--write", type=Path, help="also write the Markdown page to this file")
    args = parser.parse_args()
    started = time.monotonic()
    from tests.servers import start_redis  # starts and stops redis-server by PID

    server = start_redis()
    try:
        client = server.client(socket_timeout=60)
        client.config_set("slowlog-log-slower-than", 0)
        client.config_set("slowlog-max-len", 1024)
        version = str(client.info("server")["redis_version"])
        bench = Bench(client)
        bench.run(["warm:{x}"], [Call("fixed_window", 1, 1, 0)], T0)  # loads the script
        table = [r for r in rows() if args.only is None or args.only in r.name]
        rng = random.Random(10)
        for n in range(args.rounds):
            order = list(table)
            rng.shuffle(order)
            for row in order:
                measure(bench, row, n)
            print(f"  round {n + 1}/{args.rounds}", file=sys.stderr)
        free = measure_free(bench, min(args.rounds, 10))
        client.close()
    finally:
        server.stop()
    command = "python bench/bench_script_time.py" + "".join(
        f" --{name} {value}"
        for name, value in (
            ("rounds", args.rounds if args.rounds != ROUNDS else None),
            ("only", args.only),
            ("write", args.write),
        )
        if value is not None
    )
    text = render(table, free, command, time.monotonic() - started, version, args.rounds)
    print(text)
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(text)


if __name__ == "__main__":
    main()
