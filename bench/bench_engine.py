"""The engine on a real Redis: speed, round trips and memory of each algorithm.

    python bench/bench_engine.py                            # ~1-2 minutes on 2 cores
    python bench/bench_engine.py --write docs/bench/engine.md
    python bench/bench_engine.py --functions --write docs/bench/engine.md  # FCALL vs EVALSHA only
    python bench/bench_engine.py --lua-parts    # where one check's Redis time goes, stage by stage
    python bench/bench_engine.py --compare main  # the script's Redis time: main's against ours

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
- **Redis Functions** (``--functions``): the same Lua loaded once with ``FUNCTION LOAD`` and run
  with ``FCALL``, against ``EVALSHA`` of :data:`SCRIPT_SOURCE`, on one redis-py ``Connection``
  through its public ``pack_command`` / ``send_packed_command`` / ``read_response`` (both calls
  alike), with the KEYS and ARGV of :func:`script_args` for real checks. Two functions: the
  script's text as the function's body (every helper and algorithm loader defined on every
  call, exactly as under ``EVALSHA``), and the helpers and algorithms built once per library
  (the driver alone runs per call: what an adoption would ship). Each of
  ``FUNCTIONS_ROUNDS`` rounds runs a batch of every call in a shuffled order, in a tight loop
  and inside a bare Flask request (``before_request``); a call's time in a round is its batch's
  median, and the saving in a round is ``EVALSHA`` minus ``FCALL``. Reported: the median saving
  over the rounds, its interquartile range, and the share of rounds in which ``FCALL`` was
  faster; the server's own time per call (INFO commandstats) from an untimed pass.
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
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis

if __name__ == "__main__":  # run from a checkout: this checkout's package, whatever is installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from intervals import median_ci  # beside this file

from flask_distlimit.core.algorithms import ALGORITHMS, Algorithm
from flask_distlimit.core.decision import Check
from flask_distlimit.declare.keys import limit_key
from flask_distlimit.engine.scripts import SCRIPT_SOURCE, script_args
from flask_distlimit.identity.digests import IdentityTags, tag_secret
from flask_distlimit.storage.cluster import ClusterStorage
from flask_distlimit.storage.redis import RedisStorage

#: Keys need well-formed tags only: any fixed digest key will do.
TAGS = IdentityTags(tag_secret(b"bench"))

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


FUNCTIONS_ROUNDS = 250
FUNCTIONS_BATCH = 20
#: Interleaved passes of COUNTED calls each that measure Redis's own time per call.
FUNCTIONS_PASSES = 31
#: The saving that would make Redis Functions worth adopting (issue 14), us per request.
FUNCTIONS_WORTH = 5.0
#: A top-level ``local`` of a Lua file (a helper, a constant, an algorithm's loader).
_TOP_LEVEL_LOCAL = re.compile(r"^local\s+(?:function\s+)?([A-Za-z_]\w*)", re.MULTILINE)
_FUNCTIONS_BEGIN = "<!-- functions: generated by bench/bench_engine.py --functions -->"
_FUNCTIONS_END = "<!-- end of functions -->"


def function_library() -> str:
    """The script as a Redis Functions library ``distlimit_bench`` with two functions.

    ``as_is``: the whole script's text as the function's body (the same work per call as
    ``EVALSHA``). ``built_once``: the helpers and algorithms built on the first call and kept by
    the library, the algorithm loaders' results too; the driver runs per call. (Redis 7.0 runs a
    library's top level without ``math``, so building is deferred to the first call.)
    """
    from flask_distlimit.engine.scripts import _PARTS  # the bench takes the script apart

    # the constants and the fast path build nothing: they run per call; the driver is last
    constants, fast, algorithms, driver = _PARTS
    if driver.count("local loaded = {}") != 1:
        raise SystemExit("evaluate.lua changed: update function_library() in bench_engine.py")
    # Everything the parts before the fast path and the driver define at top level, handed on.
    names = ", ".join(dict.fromkeys(_TOP_LEVEL_LOCAL.findall(constants + algorithms)))
    return "\n".join(
        [
            "#!lua name=distlimit_bench",
            "local function as_is(KEYS, ARGV)",
            SCRIPT_SOURCE,
            "end",
            "local BUILT = nil",
            "local LOADED = {}",
            "local function build()",
            constants,
            algorithms,
            f"return {{{names}}}",
            "end",
            "local function built_once(KEYS, ARGV)",
            "if BUILT == nil then BUILT = build() end",
            constants,
            fast,
            f"local {names} = unpack(BUILT)",
            driver.replace("local loaded = {}", "local loaded = LOADED"),
            "end",
            "redis.register_function('as_is', as_is)",
            "redis.register_function('built_once', built_once)",
        ]
    )


@dataclass
class FunctionsRow:
    workload: str
    where: str  # "loop" or "request"
    evalsha_us: float
    savings: dict[str, list[float]]  # function name -> EVALSHA minus FCALL in each round, us
    server_us: dict[str, float]  # "EVALSHA" or function name -> Redis us/call (median of passes)
    #: function name -> EVALSHA minus FCALL in Redis's own us/call, in each pass
    server_savings: dict[str, list[float]]


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def functions(port: int, rounds: int, batch: int) -> list[FunctionsRow]:
    """FCALL against EVALSHA of the same Lua, connection and KEYS/ARGV (see the docstring)."""
    import gc

    from flask import Flask
    from werkzeug.test import EnvironBuilder

    from flask_distlimit.engine.scripts import parse_reply

    connection = redis.Connection(host="127.0.0.1", port=port, socket_timeout=5.0)
    admin = redis.Redis(host="127.0.0.1", port=port)
    admin.function_load(function_library(), replace=True)
    sha = admin.script_load(SCRIPT_SOURCE)
    heads = {"EVALSHA": ("EVALSHA", sha), "as_is": ("FCALL", "as_is"),
             "built_once": ("FCALL", "built_once")}  # fmt: skip
    workloads: list[tuple[str, Algorithm, int]] = [
        (f"{algorithm} x1", algorithm, 1) for algorithm in ALGORITHMS
    ]
    workloads.append(("fixed_window x3", "fixed_window", 3))

    def caller(head: tuple[str, str], prepared: list[list[Check]]) -> Callable[[], object]:
        args = [script_args(checks) for checks in prepared]
        counter = [0]

        def call() -> object:
            counter[0] += 1
            keys, argv = args[counter[0] % IDENTITIES]
            connection.send_packed_command(
                connection.pack_command(*head, len(keys), *keys, *argv), check_health=False
            )
            return connection.read_response()

        return call

    def in_request(call: Callable[[], object], name: str) -> Callable[[], object]:
        app = Flask(f"functions-{name}")
        app.add_url_rule("/", view_func=lambda: "ok")

        @app.before_request
        def limit() -> None:
            call()

        environ = EnvironBuilder(path="/").get_environ()

        def request() -> object:
            body = app(environ.copy(), lambda status, headers, exc_info=None: None)
            return b"".join(body)

        return request

    subjects: dict[tuple[str, str, str], Callable[[], object]] = {}
    for workload, algorithm, limits in workloads:
        prepared = [checks_for(algorithm, n, limits) for n in range(IDENTITIES)]
        for name, head in heads.items():
            call = caller(head, prepared)
            parse_reply(call(), prepared[1])  # the same well-formed reply from every variant
            subjects[(workload, "loop", name)] = call
            if workload == "fixed_window x1":
                subjects[(workload, "request", name)] = in_request(caller(head, prepared), name)
    per_round: dict[tuple[str, str, str], list[float]] = {key: [] for key in subjects}
    for call in subjects.values():  # warm up
        for _ in range(50):
            call()
    rng = random.Random(13)
    order = list(subjects)
    clock = time.perf_counter_ns
    for number in range(rounds):
        rng.shuffle(order)
        for key in order:
            call = subjects[key]
            samples = []
            gc.collect()
            gc.disable()
            try:
                for _ in range(batch):
                    started = clock()
                    call()
                    samples.append(clock() - started)
            finally:
                gc.enable()
            per_round[key].append(statistics.median(samples) / 1000)
        if (number + 1) % 50 == 0:
            print(f"  functions round {number + 1}/{rounds}", file=sys.stderr)
    # Redis's own time per call, in FUNCTIONS_PASSES interleaved passes (a shuffled order in each)
    server_passes: dict[tuple[str, str], list[float]] = {
        (workload, name): [] for workload, _, _ in workloads for name in heads
    }
    passes = list(server_passes)
    for _ in range(FUNCTIONS_PASSES):
        rng.shuffle(passes)
        for workload, name in passes:
            admin.config_resetstat()
            call = subjects[(workload, "loop", name)]
            for _ in range(COUNTED):
                call()
            stat = "cmdstat_evalsha" if name == "EVALSHA" else "cmdstat_fcall"
            usec = float(admin.info("commandstats")[stat]["usec_per_call"])
            server_passes[(workload, name)].append(usec)
    server = {key: statistics.median(v) for key, v in server_passes.items()}
    rows = []
    for workload, where in dict.fromkeys((w, wh) for w, wh, _ in subjects):
        base = per_round[(workload, where, "EVALSHA")]
        savings = {
            name: [e - f for e, f in zip(base, per_round[(workload, where, name)], strict=True)]
            for name in heads
            if name != "EVALSHA"
        }
        servers = {name: server[(workload, name)] for name in heads}
        server_base = server_passes[(workload, "EVALSHA")]
        server_savings = {
            name: [e - f for e, f in zip(server_base, server_passes[(workload, name)], strict=True)]
            for name in heads
            if name != "EVALSHA"
        }
        rows.append(
            FunctionsRow(workload, where, statistics.median(base), savings, servers, server_savings)
        )
    connection.disconnect()
    admin.close()
    return rows


def render_functions(
    rows: list[FunctionsRow], command: str, rounds: int, batch: int, note: str = ""
) -> str:
    lines = [
        _FUNCTIONS_BEGIN,
        "## Redis Functions: FCALL against EVALSHA (issue 14)",
        "",
        f"Command: `{command}` ({rounds} interleaved rounds of {batch} calls of each; the method "
        f"is in the benchmark's docstring). Measured {_stamp()}.",
        "",
        *([f"**{note}**", ""] if note else []),
        "Saving per call = EVALSHA minus FCALL in each round (positive: FCALL is faster); "
        "median over the rounds [interquartile range] (95 % confidence interval of the median); "
        "share of rounds in which FCALL was faster. "
        f"Redis us/call: the server's own time (INFO commandstats), median over "
        f"{FUNCTIONS_PASSES} interleaved untimed passes of {COUNTED:,} calls each.",
        "",
        "| checks | where | EVALSHA us/call | saving, script text as the function body "
        "| saving, built once per library | Redis us/call EVALSHA / as is / built once |",
        "|---|---|---:|---|---|---|",
    ]
    for r in rows:
        cells = []
        for name in ("as_is", "built_once"):
            v = r.savings[name]
            faster = sum(1 for x in v if x > 0) / len(v)
            low, high = median_ci(v)
            cells.append(
                f"{statistics.median(v):+.1f} us [{_quantile(v, 0.25):+.1f}, "
                f"{_quantile(v, 0.75):+.1f}] ({low:+.1f} to {high:+.1f}), {faster:.0%} of rounds"
            )
        where = "inside a bare Flask request" if r.where == "request" else "tight loop"
        servers = " / ".join(f"{r.server_us[n]:.1f}" for n in ("EVALSHA", "as_is", "built_once"))
        lines.append(
            f"| {r.workload} | {where} | {r.evalsha_us:.1f} | {cells[0]} | {cells[1]} | {servers} |"
        )
    request = next(r for r in rows if r.where == "request")
    saving = statistics.median(request.savings["built_once"])
    low, high = median_ci(request.savings["built_once"])
    server_saving = statistics.median(request.server_savings["built_once"])
    server_low, server_high = median_ci(request.server_savings["built_once"])
    on_server = (
        f"Redis's own time, the only work that differs (the client packs and reads the same "
        f"bytes but for the command's name), saves {server_saving:+.1f} us per call "
        f"({server_low:+.1f} to {server_high:+.1f})"
    )
    if low >= FUNCTIONS_WORTH:
        verdict = (
            f"qualifies (at least {FUNCTIONS_WORTH:g} us, beyond the noise): adopt, keeping "
            "EVALSHA for servers without functions"
        )
    elif high < FUNCTIONS_WORTH:
        verdict = (
            f"does not qualify (less than {FUNCTIONS_WORTH:g} us, beyond the noise); "
            f"{on_server}: keep EVALSHA"
        )
    else:  # adoption needs the saving shown; a wide interval does not show it
        verdict = (
            f"does not qualify: a saving of at least {FUNCTIONS_WORTH:g} us is not shown (95 % "
            f"interval of the median {low:+.1f} to {high:+.1f} us), and {on_server}: keep "
            "EVALSHA"
        )
    lines += [
        "",
        "Reading it: *script text as the function body* runs exactly the per-call work of "
        "EVALSHA (every helper and algorithm loader defined again on each call), so it isolates "
        "what FCALL itself costs against EVALSHA; *built once per library* keeps the helpers and "
        "the algorithms' functions in the library between calls, and the driver alone runs per "
        "call: that is what an adoption would ship. Redis 7.0 runs a library's top level "
        "without `math`, so the building happens on the first call. An adoption also needs: "
        "`FUNCTION LOAD` once per server (each Cluster primary), the `@scripting` ACL "
        "commands `FCALL` and `FUNCTION`, and `EVALSHA` kept for servers older than 7.0; in "
        "return, functions are kept in RDB/AOF and replicated, so a restart or a failover never "
        "answers `NOSCRIPT`.",
        "",
        f"**Decision rule** (issue 14): adopt Redis Functions only if they save at least "
        f"{FUNCTIONS_WORTH:g} us per request. Measured inside a request, one fixed-window "
        f"check, the library as an adoption would ship it (built once): {saving:+.1f} us, "
        f"which {verdict}.",
        _FUNCTIONS_END,
    ]
    return "\n".join(lines)


MINIMAL_SCRIPT = (
    "local n = redis.call('INCR', KEYS[1]) "
    "if n == 1 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end "
    "return {n, redis.call('PTTL', KEYS[1])}"
)  # the minimal limiter's script (bench/bench_overhead.py)


def lua_parts(port: int, passes: int = 9, calls: int = 1000) -> str:
    """Where one fixed-window check's Redis time goes: the server's own time per call (INFO
    commandstats) of our script cut after each stage, against the minimal limiter's script.

    Every variant gets the same KEYS/ARGV; passes alternate the variants; medians over passes.
    Inner commands: their time per script call, over every pass (a command a pass did not run
    counts 0 there).
    """
    from flask_distlimit.engine.scripts import _PARTS

    # the general path: the script without its fast paths (the inlined ones of the algorithms
    # whose files mark regions, but for their `parsed, args`, which the driver reads; the driver's
    # for one check of any algorithm), and without the request token
    constants, _, algorithms, driver = _PARTS
    defined = constants + "local parsed, args\n" + algorithms
    general = defined + driver.replace("if n == 1 and #ARGV == 1 then", "if false then", 1)
    cut = general.index("local now, mode = args[1], args[2]")
    variants = {
        "`return 1` (EVALSHA itself)": "return 1",
        "+ the helpers and algorithm loaders defined": defined + "\nreturn 1",
        "+ cjson.decode and the argument checks": general[:cut] + "\nreturn 1",
        "+ the fixed window's functions built": general[:cut]
        + "\nlocal fw = LOADERS[1]()\nreturn 1",
        "general path, whole (TIME, HMGET, decide, HSET, reply)": general,
        "the driver's one-check fast path, whole": defined + driver,
        "ours, whole: the fixed-window fast path": SCRIPT_SOURCE,
        "ours as a Redis Function, built once (FCALL)": "",
        "the minimal limiter's script (INCR, PTTL)": MINIMAL_SCRIPT,
    }
    admin = redis.Redis(host="127.0.0.1", port=port)
    admin.function_load(function_library(), replace=True)
    shas = {name: admin.script_load(src) for name, src in variants.items() if src}
    prepared = [script_args(checks_for("fixed_window", n, 1)) for n in range(IDENTITIES)]
    totals: dict[str, list[float]] = {name: [] for name in variants}
    inner: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for _ in range(passes):
        for name in variants:
            admin.config_resetstat()
            for i in range(calls):
                keys, args = prepared[i % IDENTITIES]
                if name not in shas:
                    admin.fcall("built_once", 1, *keys, *args)
                elif variants[name] is MINIMAL_SCRIPT:
                    admin.evalsha(shas[name], 1, f"rl:{i % IDENTITIES}", 3_600_000)
                else:
                    admin.evalsha(shas[name], 1, *keys, *args)
            stats = admin.info("commandstats")
            top = "cmdstat_evalsha" if name in shas else "cmdstat_fcall"
            totals[name].append(float(stats[top]["usec_per_call"]))
            inner[name].append(
                {
                    key.removeprefix("cmdstat_"): float(value["usec"]) / calls
                    for key, value in stats.items()
                    if key not in (top, "cmdstat_config|resetstat", "cmdstat_config")
                }
            )
    admin.close()
    lines = [
        "| script (one fixed-window check) | Redis us/call | of which inner commands |",
        "|---|---:|---|",
    ]
    for name in variants:
        commands = sorted({c for d in inner[name] for c in d})
        parts = ", ".join(
            f"{c} {statistics.median([d.get(c, 0.0) for d in inner[name]]):.2f}" for c in commands
        )
        lines.append(f"| {name} | {statistics.median(totals[name]):.1f} | {parts or '-'} |")
    lines += ["", f"Medians over {passes} alternating passes of {calls} calls each."]
    return "\n".join(lines)


def script_source_at(revision: str) -> str:
    """:data:`SCRIPT_SOURCE` as the package at a git revision of this checkout builds it (its
    ``flask_distlimit/`` extracted with ``git archive`` and imported in a child process)."""
    import os
    import subprocess
    import tarfile
    import tempfile

    show = (
        "import sys\n"
        "try:\n"
        "    from flask_distlimit.engine.scripts import SCRIPT_SOURCE\n"
        "except ImportError:  # before the subpackages\n"
        "    from flask_distlimit.scripts import SCRIPT_SOURCE\n"
        "sys.stdout.write(SCRIPT_SOURCE)\n"
    )
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "package.tar"
        subprocess.run(
            ["git", "archive", "-o", str(archive), revision, "flask_distlimit"],
            cwd=ROOT,
            check=True,
        )
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        shown = subprocess.run(
            [sys.executable, "-c", show],
            cwd=tmp,
            env={**os.environ, "PYTHONPATH": tmp},
            capture_output=True,
            text=True,
            check=True,
        )
    return shown.stdout


def compare_scripts(
    port: int, revision: str, passes: int, calls: int
) -> list[tuple[str, int, float, float, float, float]]:
    """The server's own time per call (INFO commandstats) of the script at ``revision`` and of this
    checkout's, loaded into the same redis-server; in each pass every (algorithm, checks, script)
    runs a batch of ``calls`` in a shuffled order, on its own keys (so old and new never share
    state). Rows: (algorithm, checks, old median, new median, old-minus-new median of the
    per-pass differences, share of passes where new was faster).
    """
    admin = redis.Redis(host="127.0.0.1", port=port)
    shas = {
        "old": admin.script_load(script_source_at(revision)),
        "new": admin.script_load(SCRIPT_SOURCE),
    }
    cases = [(a, n) for n in (1, 2, 3) for a in ALGORITHMS]
    prepared = {
        (a, n, which): [
            script_args(
                [
                    Check(c.key.replace("bench", f"bench-{which}", 1), a, c.limit, c.period)
                    for c in checks_for(a, i, n)
                ]
            )
            for i in range(IDENTITIES)
        ]
        for a, n in cases
        for which in shas
    }
    times: dict[tuple[str, int, str], list[float]] = {key: [] for key in prepared}
    order = list(prepared)
    for _ in range(passes):
        random.shuffle(order)
        for a, n, which in order:
            admin.config_resetstat()
            for i in range(calls):
                keys, args = prepared[(a, n, which)][i % IDENTITIES]
                admin.evalsha(shas[which], len(keys), *keys, *args)
            stat = admin.info("commandstats")["cmdstat_evalsha"]
            times[(a, n, which)].append(float(stat["usec_per_call"]))
    admin.close()
    rows = []
    for a, n in cases:
        old, new = times[(a, n, "old")], times[(a, n, "new")]
        saving = [o - w for o, w in zip(old, new, strict=True)]
        faster = sum(1 for d in saving if d > 0) / len(saving)
        rows.append(
            (
                a,
                n,
                statistics.median(old),
                statistics.median(new),
                statistics.median(saving),
                faster,
            )
        )
    return rows


_COMPARE_BEGIN = "<!-- script time: generated by bench/bench_engine.py --compare -->"
_COMPARE_END = "<!-- end of script time -->"


def render_compare(
    rows: list[tuple[str, int, float, float, float, float]],
    parts: str,
    command: str,
    revision: str,
    passes: int,
    calls: int,
) -> str:
    lines = [
        _COMPARE_BEGIN,
        "## The script's own time: one, two and three checks (issue 36)",
        "",
        f"Command: `{command}`. Measured {_stamp()}.",
        "",
        f"Both scripts (`{revision}`'s and this checkout's) are loaded into one redis-server; "
        f"each of {passes} passes runs a batch of {calls} calls of every row and script in a "
        "shuffled order, each script on its own keys, every call an allowed decision that writes. "
        "Redis us/call: the server's own time per `EVALSHA` (INFO commandstats), median over the "
        "passes; the saving is the median of the per-pass differences (positive: this checkout "
        "is faster), with the share of passes in which it was faster.",
        "",
        f"| algorithm | checks | Redis us/call, {revision} | Redis us/call, this checkout | "
        "saving per call | passes where faster |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for a, n, old, new, saving, faster in rows:
        lines.append(
            f"| {a} | {n} | {old:.1f} | {new:.1f} | {saving:+.1f} us ({saving / old:+.0%}) "
            f"| {faster:.0%} |"
        )
    lines += [
        "",
        "Where one fixed-window check's time goes now (`--lua-parts`, same run; the first rows "
        "cut the general path after each stage):",
        "",
        parts,
        "",
        "Where the time goes, and why the fast paths pay: every function in the script is a "
        "closure built again on every call (`EVALSHA` runs the whole chunk), and building the "
        "algorithm loaders and one algorithm's functions, cjson, the per-check flag tables and "
        "the tables each decision returns cost about as much as a check's Redis commands. One "
        "check of an algorithm whose file marks its regions (every rate algorithm), at a rate of "
        "at most one unit per 2 us, is decided inline at the top of the script, "
        "before anything is built: one `string.match`, one reply `string.format`. Several such "
        "checks (any mix, enforced or shadow, evaluated) take a second inline path, generated "
        "from the same regions (`lua/fast_path.lua`): a plain argument read once by cjson "
        "(faster than `string.match` and a `tonumber` per field for several checks: measured), "
        "every check checked, then each read and decided, then, only when none but a shadow "
        "check denies, each written, in order, exactly as the driver's two phases; one table "
        "per check (the r its general function returns, which the write reads back). Any other "
        "request (concurrency, a release, a debt, a meta check, a refund, a faster rate) takes "
        "the driver, which reuses that parse. Same Redis commands in the same order, same replies, "
        "state and TTLs: `tests/engine/test_script_fastpath.py` runs every case, stored garbage "
        "and malformed arguments included, on a fast path and on the general path and compares.",
        _COMPARE_END,
    ]
    return "\n".join(lines)


def _block(path: Path, begin: str, end: str) -> str:
    """The generated section between ``begin`` and ``end`` already in ``path``, or ``""``."""
    if not path.exists():
        return ""
    text = path.read_text()
    if begin not in text or end not in text:
        return ""
    return begin + text.split(begin, 1)[1].split(end, 1)[0] + end


def write_block(path: Path, block: str, begin: str, end: str) -> None:
    """Replace the section of ``path`` between ``begin`` and ``end``, or append ``block``."""
    text = path.read_text() if path.exists() else ""
    old = _block(path, begin, end)
    text = text.replace(old, block) if old else text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def _stamp() -> str:
    import datetime
    import os

    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"{now}, load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}"


def _functions_block(path: Path) -> str:
    """The functions section already in ``path``, kept when the rest is rewritten."""
    if not path.exists():
        return ""
    text = path.read_text()
    if _FUNCTIONS_BEGIN not in text or _FUNCTIONS_END not in text:
        return ""
    return (
        _FUNCTIONS_BEGIN
        + text.split(_FUNCTIONS_BEGIN, 1)[1].split(_FUNCTIONS_END, 1)[0]
        + (_FUNCTIONS_END)
    )


def write_functions(path: Path, block: str) -> None:
    """Replace the functions section of ``path`` (between its markers), or append it."""
    text = path.read_text() if path.exists() else ""
    old = _functions_block(path)
    text = text.replace(old, block) if old else text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


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
    parser.add_argument(
        "--functions",
        action="store_true",
        help="only time FCALL against EVALSHA (with --write: rewrites that section only)",
    )
    parser.add_argument(
        "--lua-parts", action="store_true", help="only print where one check's Redis time goes"
    )
    parser.add_argument("--rounds", type=int, default=FUNCTIONS_ROUNDS, help="with --functions")
    parser.add_argument("--batch", type=int, default=FUNCTIONS_BATCH, help="with --functions")
    parser.add_argument("--note", default="", help="with --functions: a line above the table")
    parser.add_argument(
        "--compare",
        metavar="REVISION",
        help="only compare the script's Redis time per call at a git revision with this checkout's",
    )
    parser.add_argument("--passes", type=int, default=15, help="with --compare")
    parser.add_argument("--calls", type=int, default=500, help="with --compare: per batch")
    args = parser.parse_args()
    started = time.monotonic()
    sys.path.insert(0, str(ROOT))  # tests.servers starts and stops redis-server by PID
    from tests.servers import start_redis

    if args.compare:
        server = start_redis()
        try:
            rows = compare_scripts(server.port, args.compare, args.passes, args.calls)
            parts = lua_parts(server.port)
        finally:
            server.stop()
        command = f"python bench/bench_engine.py --compare {args.compare} --passes {args.passes}"
        command += f" --calls {args.calls}" + (f" --write {args.write}" if args.write else "")
        block = render_compare(rows, parts, command, args.compare, args.passes, args.calls)
        print(block)
        if args.write:
            write_block(args.write, block, _COMPARE_BEGIN, _COMPARE_END)
        return
    if args.lua_parts:
        server = start_redis()
        try:
            print(lua_parts(server.port))
        finally:
            server.stop()
        return
    if args.functions:
        server = start_redis()
        try:
            rows = functions(server.port, args.rounds, args.batch)
        finally:
            server.stop()
        command = f"python bench/bench_engine.py --functions --rounds {args.rounds}"
        command += f" --batch {args.batch}" + (f" --write {args.write}" if args.write else "")
        block = render_functions(rows, command, args.rounds, args.batch, args.note)
        print(block)
        if args.write:
            write_functions(args.write, block)
        return

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
        kept = _functions_block(args.write)  # --functions writes that section on its own
        compared = _block(args.write, _COMPARE_BEGIN, _COMPARE_END)  # and --compare this one
        args.write.write_text(
            text + "".join("\n" + block + "\n" for block in (kept, compared) if block)
        )


if __name__ == "__main__":
    main()
