"""How many bytes of Redis does one client cost, per limit? Measured with MEMORY USAGE.

    python bench/key_memory.py                       # ~10 s; starts its own redis-server
    python bench/key_memory.py --write docs/bench/key-memory.md

Every (client, limit) pair is one key (``<prefix>:{<20 hex tag>}:<scope>:<algorithm>``), and
every key carries a TTL of at most two periods: a client costs the keys of the limits it hit in
their last periods, never more. What one key weighs depends on its algorithm and, for the
sliding window log alone, on how many requests it holds (one list entry per admitted request
while the window lasts: at most the limit).

For each algorithm and limit the benchmark drives one key to its worst state (``limit`` single
requests, the log full), through ``RedisStorage.evaluate`` exactly as requests do, and reads:

- **MEMORY USAGE <key> SAMPLES 0** (every member counted): the bytes of that key;
- **INFO memory used_memory** before and after 1,000 such clients: the bytes per client the
  server really spends, the key's dictionary entry and expiry entry included.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout this file is in, before any installed copy

from flask_distlimit.core.decision import Check  # noqa: E402
from flask_distlimit.storage.redis import RedisStorage  # noqa: E402
from tests.servers import start_redis  # noqa: E402

ALGORITHMS = (
    "fixed_window",
    "sliding_window_counter",
    "token_bucket",
    "gcra",
    "sliding_window_log",
)
LIMITS = (10, 100, 1000)
CLIENTS = 1000
PERIOD = 3600


def key_of(client: int, algorithm: str) -> str:
    return f"ratelimit:{{{client:020x}}}:route:search:{algorithm}"


def drive(storage: RedisStorage, key: str, algorithm: str, limit: int, now_us: int) -> None:
    check = Check(key, algorithm, limit, PERIOD, 1)  # type: ignore[arg-type]
    for i in range(limit):
        storage.evaluate([check], now_us=now_us + i)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="write the Markdown table to this file")
    parser.add_argument("--clients", type=int, default=CLIENTS)
    options = parser.parse_args()
    server = start_redis()
    client = server.client()
    storage = RedisStorage(host="127.0.0.1", port=server.port, timeout=5.0)
    now_us = 1_700_000_000_000_000
    rows = []
    try:
        version = client.info("server")["redis_version"]
        for algorithm in ALGORITHMS:
            for limit in LIMITS:
                client.flushall(asynchronous=False)
                for n in range(10):  # warm-up: the dictionaries' first allocations
                    drive(storage, key_of(10**9 + n, algorithm), algorithm, min(limit, 10), now_us)
                one = key_of(0, algorithm)
                drive(storage, one, algorithm, limit, now_us)
                usage = int(client.memory_usage(one, samples=0) or 0)
                ttl = client.pttl(one)
                clients = options.clients if limit <= 100 else max(1, options.clients // 10)
                before = int(client.info("memory")["used_memory"])
                for n in range(1, clients + 1):
                    drive(storage, key_of(n, algorithm), algorithm, limit, now_us)
                after = int(client.info("memory")["used_memory"])
                rows.append((algorithm, limit, usage, (after - before) / clients, ttl / 1000))
    finally:
        storage.close()
        client.close()
        server.stop()
    lines = [
        f"Redis {version}, {platform.machine()}; `python bench/key_memory.py`. One key per "
        "(client, limit), driven to its worst state (`limit` requests in one period of "
        f"{PERIOD} s).",
        "",
        "| algorithm | limit | MEMORY USAGE (bytes) | used_memory per client (bytes) | TTL (s) |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [f"| {a} | {lim} | {u} | {p:.0f} | {t:.0f} |" for a, lim, u, p, t in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if options.write:
        options.write.write_text(text)


if __name__ == "__main__":
    main()
