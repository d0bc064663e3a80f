"""The engine on a real Redis: speed, round trips and memory of each algorithm.

    python bench/bench_engine.py                            # ~1-2 minutes on 2 cores
    python bench/bench_engine.py --write docs/bench/engine.md

A private redis-server (loopback, started and stopped here, no persistence) and the production
path: ``from_url("redis://...")`` -> :class:`RedisStorage` -> one ``EVALSHA`` per decision.

- **us/decision, decisions/s**: one client thread calling ``evaluate`` back to back, with 1 and
  3 limits per call (the 3 limits of a call are in one hash slot, as one client's limits are).
  Clients rotate over 1,000 identities with limits never reached, so every call is a full
  allowed decision that writes. The floor: a bare redis-py ``EVALSHA`` of a script doing one
  ``GET``. Rounds are interleaved (each of 8 rounds runs a batch of 400 calls of every row in a
  shuffled order) and the median batch is reported, so machine noise spreads over all rows.
- **Redis us/call**: the server's own time per ``EVALSHA`` (``usec_per_call`` of INFO
  commandstats), from an untimed pass of 1,000 calls per row: the Lua's cost without the network
  and Python, steadier than the wall clock on a shared machine.
- **round trips/decision**: in the same untimed pass, redis-py ``send_packed_command`` calls
  counted by a connection subclass, and the server's ``cmdstat_evalsha`` calls; both must be
  exactly 1.00.
- **bytes/client**: 10,000 clients, each with one limit of the algorithm filled to 99 % of its
  limit (pipelined ``EVALSHA`` with cost = 99 % of the limit; the log, which keeps one entry per
  request whatever its cost, with that many requests of cost 1, its worst case: built once and
  copied), ``MEMORY USAGE key SAMPLES 0`` (exact) summed over each client's keys, averaged;
  and the growth of ``used_memory`` divided by the number of clients (includes the keyspace's
  own overhead). The sliding window log at 1,000/minute is **sampled**: 500 clients are filled
  (990 entries each) and the per-client figure is projected to 10,000 clients.
"""

from __future__ import annotations

import argparse
import math
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis

from flask_distlimit.algorithms import ALGORITHMS, Algorithm
from flask_distlimit.decision import Check
from flask_distlimit.digests import IdentityTags
from flask_distlimit.keys import limit_key
from flask_distlimit.scripts import SCRIPT_SOURCE, script_args
from flask_distlimit.storage.cluster import ClusterStorage
from flask_distlimit.storage.redis import RedisStorage

#: Keys need well-formed tags only: any fixed digest key will do.
TAGS = IdentityTags.fixed(b"bench")

ROOT = Path(__file__).resolve().parent.parent
CLIENTS = 10_000
IDENTITIES = 1_000
ROUNDS = 8
BATCH = 400
COUNTED = 1_000


class CountingConnection(redis.Connection):
    """Counts what redis-py sends: one packed send is one round trip."""

    sends = 0

    def send_packed_command(self, command: object, check_health: bool = True) -> None:
        CountingConnection.sends += 1
        super().send_packed_command(command, check_health)


@dataclass
class SpeedRow:
    name: str
    limits: int
    us: float
    per_second: float
    sends_per_decision: float
    evalsha_per_decision: float
    server_us: float  # Redis' own time per EVALSHA (INFO commandstats usec_per_call)


@dataclass
class MemoryRow:
    name: str
    clients: int
    filled: int  # units consumed per client
    bytes_per_client: float
    used_memory_per_client: float
    sampled: bool


def evalsha_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats").get("cmdstat_evalsha", {"calls": 0})
    return int(stats["calls"])


def checks_for(algorithm: Algorithm, identity: int, limits: int) -> list[Check]:
    huge = 1_000_000 if algorithm != "sliding_window_log" else 1_000
    return [
        Check(
            limit_key("bench", f"ip:{identity}", f"limit{n}", algorithm, TAGS), algorithm, huge, 60
        )
        for n in range(limits)
    ]


def speed(storage: RedisStorage, admin: redis.Redis) -> list[SpeedRow]:
    """Interleaved timed rounds (every round runs a batch of each configuration in a shuffled
    order, so machine noise spreads over all of them), then an untimed counting pass."""
    floor_script = storage.client.register_script("return redis.call('GET', KEYS[1])")
    configs: list[tuple[str, int, Callable[[int], object]]] = [
        ("bare EVALSHA (one GET), the floor", 0, lambda i: floor_script(["bench:floor"], []))
    ]
    for limits in (1, 3):
        for algorithm in ALGORITHMS:
            prepared = [checks_for(algorithm, n, limits) for n in range(IDENTITIES)]
            configs.append(
                (algorithm, limits, lambda i, p=prepared: storage.evaluate(p[i % IDENTITIES]))
            )
    for _, _, run in configs:
        run(0)  # connects, loads the scripts
    samples: dict[int, list[float]] = {n: [] for n in range(len(configs))}
    order = list(range(len(configs)))
    rng = random.Random(7)
    counter = 0
    for round_number in range(ROUNDS):
        rng.shuffle(order)
        for n in order:
            run = configs[n][2]
            started = time.perf_counter()
            for _ in range(BATCH):
                counter += 1
                run(counter)
            samples[n].append((time.perf_counter() - started) / BATCH * 1e6)
        print(f"  round {round_number + 1}/{ROUNDS}", file=sys.stderr)
    rows = []
    for n, (name, limits, run) in enumerate(configs):
        admin.config_resetstat()
        sends = CountingConnection.sends
        for _ in range(COUNTED):
            counter += 1
            run(counter)
        stats = admin.info("commandstats")["cmdstat_evalsha"]
        us = statistics.median(samples[n])
        rows.append(
            SpeedRow(
                name,
                limits,
                us,
                1e6 / us,
                (CountingConnection.sends - sends) / COUNTED,
                int(stats["calls"]) / COUNTED,
                float(stats["usec_per_call"]),
            )
        )
    return rows


def memory(admin: redis.Redis, algorithm: Algorithm, limit: int, clients: int) -> MemoryRow:
    admin.flushall()
    script = admin.register_script(SCRIPT_SOURCE)
    filled = max(1, math.floor(limit * 0.99))
    admin.script_load(SCRIPT_SOURCE)
    template = ""
    if algorithm == "sliding_window_log":
        # The log keeps one entry per request, whatever its cost: its worst case is `filled`
        # requests of cost 1. Built once, then copied to every client (COPY keeps the TTL).
        template = limit_key("mem", "template", "limit", algorithm, TAGS)
        pipe = admin.pipeline(transaction=False)
        for _ in range(filled):
            k, a = script_args([Check(template, algorithm, limit, 60, 1)])
            script(k, a, client=pipe)
        pipe.execute()
    before = int(admin.info("memory")["used_memory"])
    keys = []
    pipe = admin.pipeline(transaction=False)
    for n in range(clients):
        check = Check(
            limit_key("mem", f"ip:{n}", "limit", algorithm, TAGS), algorithm, limit, 60, filled
        )
        if template:
            pipe.copy(template, check.key)
        else:
            k, a = script_args([check])
            script(k, a, client=pipe)
        keys.append(check.key)
        if len(pipe) >= 500:
            pipe.execute()
    pipe.execute()
    after = int(admin.info("memory")["used_memory"])
    total = 0
    for start in range(0, len(keys), 500):
        pipe = admin.pipeline(transaction=False)
        for key in keys[start : start + 500]:
            pipe.memory_usage(key, samples=0)
        total += sum(int(x or 0) for x in pipe.execute())
    name = f"{algorithm} {limit}/minute"
    print(f"  memory {name}: {total / clients:.0f} B/client", file=sys.stderr)
    admin.flushall()
    return MemoryRow(
        name, CLIENTS, filled, total / clients, (after - before) / clients, clients < CLIENTS
    )


@dataclass
class ClusterRow:
    name: str
    groups: int
    us: float
    evalsha_per_decision: float


def cluster_speed() -> list[ClusterRow]:
    """3 fixed-window limits per call on a real 3-primary cluster, in 1, 2 or 3 slot groups:
    the production path (every group's EVALSHA written before any reply is read), and the same
    groups sent one after the other for comparison. Interleaved rounds, median batch."""
    from tests.servers import start_cluster

    cluster = start_cluster(replicas=0)
    try:
        storage = ClusterStorage(cluster.startup_nodes, timeout=5.0)
        tags: dict[int, str] = {}
        for n in range(2000):
            port = cluster.primary_for(f"{{t{n}}}").port
            tags.setdefault(port, f"t{n}")
        a, b, c = list(tags.values())[:3]

        def checks(spread: tuple[str, str, str], i: int) -> list[Check]:
            return [
                Check(f"bench:{{{tag}}}:id{i % IDENTITIES}:l{n}:fixed_window", "fixed_window",
                      1_000_000, 60)
                for n, tag in enumerate(spread)
            ]  # fmt: skip

        def sequential(i: int) -> None:
            call = checks((a, b, c), i)
            for part in storage.groups(call):
                storage._call([call[j] for j in part], None)

        configs: list[tuple[str, int, Callable[[int], object]]] = [
            ("one slot group", 1, lambda i: storage.evaluate(checks((a, a, a), i))),
            (
                "two slot groups, in flight at once",
                2,
                lambda i: storage.evaluate(checks((a, a, b), i)),
            ),
            (
                "three slot groups, in flight at once",
                3,
                lambda i: storage.evaluate(checks((a, b, c), i)),
            ),
            ("three slot groups, one after the other (comparison)", 3, sequential),
        ]
        for _, _, run in configs:
            run(0)
        samples: dict[int, list[float]] = {n: [] for n in range(len(configs))}
        rng = random.Random(11)
        order = list(range(len(configs)))
        counter = 0
        for _ in range(ROUNDS):
            rng.shuffle(order)
            for n in order:
                started = time.perf_counter()
                for _ in range(BATCH // 2):
                    counter += 1
                    configs[n][2](counter)
                samples[n].append((time.perf_counter() - started) / (BATCH // 2) * 1e6)
        rows = []
        clients = [node.client() for node in cluster.primary_nodes()]
        for n, (name, groups, run) in enumerate(configs):
            before = sum(_evalsha(cl) for cl in clients)
            for _ in range(200):
                counter += 1
                run(counter)
            calls = (sum(_evalsha(cl) for cl in clients) - before) / 200
            rows.append(ClusterRow(name, groups, statistics.median(samples[n]), calls))
        for cl in clients:
            cl.close()
        storage.close()
        return rows
    finally:
        cluster.stop()


def _evalsha(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_evalsha", {"calls": 0})["calls"])


def render(
    speed_rows: list[SpeedRow],
    memory_rows: list[MemoryRow],
    cluster_rows: list[ClusterRow],
    command: str,
    seconds: float,
    server: str,
) -> str:
    lines = [
        "# Engine benchmark",
        "",
        "Produced by `bench/bench_engine.py` (its docstring explains the method). Command:",
        "",
        f"    {command}",
        "",
        f"Machine: {platform.machine()}, {platform.python_implementation()} "
        f"{platform.python_version()}, redis-py {redis.__version__}, redis-server {server}; "
        "loopback; "
        f"one client thread; run time {seconds:.0f} s. Absolute figures depend on the machine "
        "(this one is shared with other jobs); the round trips do not.",
        "",
        "## Speed and round trips (one client thread, back to back)",
        "",
        "| algorithm | limits per call | us/decision | decisions/s | Redis us/call "
        "| round trips/decision (client sends) | EVALSHA/decision (server) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in speed_rows:
        limits = "-" if r.limits == 0 else str(r.limits)
        lines.append(
            f"| {r.name} | {limits} | {r.us:.1f} | {r.per_second:,.0f} | {r.server_us:.1f} | "
            f"{r.sends_per_decision:.2f} | {r.evalsha_per_decision:.2f} |"
        )
    lines += [
        "",
        f"## Redis memory per client ({CLIENTS:,} clients, one limit each, filled to 99 %)",
        "",
        "| algorithm and limit | units held per client | MEMORY USAGE per client (bytes) "
        "| used_memory growth per client (bytes) | projected for 10,000 clients |",
        "|---|---:|---:|---:|---:|",
    ]
    for m in memory_rows:
        projected = m.used_memory_per_client * CLIENTS / 2**20
        note = " (sampled: 500 clients filled, projected)" if m.sampled else ""
        lines.append(
            f"| {m.name}{note} | {m.filled} | {m.bytes_per_client:,.0f} | "
            f"{m.used_memory_per_client:,.0f} | {projected:,.1f} MiB |"
        )
    lines += [
        "",
        "## Redis Cluster: one request's limits in several hash slots",
        "",
        "3 fixed-window limits per call on a real 3-primary cluster (started by the benchmark), "
        "whose keys fall in 1, 2 or 3 slot groups on different primaries.",
        "",
        "| request | slot groups | us/decision | EVALSHA/decision (all primaries) |",
        "|---|---:|---:|---:|",
    ]
    for c in cluster_rows:
        lines.append(f"| {c.name} | {c.groups} | {c.us:.1f} | {c.evalsha_per_decision:.2f} |")
    lines += [
        "",
        "## Reading the tables",
        "",
        "- Round trips: exactly one per decision on a single node whatever the number of limits "
        "(counted on the client and on the server); on a cluster, one script call per slot "
        "group, the groups in flight at once.",
        "- The gap between a decision and the floor is mostly the Lua's own time in Redis "
        "(Redis us/call) and the bigger reply; the storage's Python (arguments, reply parsing, "
        "error mapping) is a few microseconds.",
        "- Memory: the counters (fixed window, sliding window counter, token bucket, GCRA) cost "
        "about the same small hash per client and limit whatever the limit. The sliding window "
        "log keeps one sorted-set entry per request admitted in the window (here all of cost "
        "1, its worst case): memory grows with the limit (at 1,000/minute, the largest it "
        "accepts, the last row). Prefer the sliding window counter or GCRA for large limits.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="also write the Markdown table to this file")
    args = parser.parse_args()
    started = time.monotonic()
    sys.path.insert(0, str(ROOT))  # tests.servers starts and stops redis-server by PID
    from tests.servers import start_redis

    server = start_redis()
    try:
        admin = server.client()
        version = str(admin.info("server")["redis_version"])
        # A generous timeout: this measures speed, not outages (the machine may be shared).
        storage = RedisStorage(
            host="127.0.0.1", port=server.port, connection_class=CountingConnection, timeout=5.0
        )
        print("speed ...", file=sys.stderr)
        speed_rows = speed(storage, admin)
        print("memory ...", file=sys.stderr)
        memory_rows = [memory(admin, a, 100, CLIENTS) for a in ALGORITHMS]
        memory_rows.append(memory(admin, "sliding_window_log", 1_000, 500))
        storage.close()
        admin.close()
    finally:
        server.stop()
    print("cluster ...", file=sys.stderr)
    cluster_rows = cluster_speed()
    command = "python bench/bench_engine.py" + (f" --write {args.write}" if args.write else "")
    text = render(
        speed_rows, memory_rows, cluster_rows, command, time.monotonic() - started, version
    )
    print(text)
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(text)


if __name__ == "__main__":
    main()
