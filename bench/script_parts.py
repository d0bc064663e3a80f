"""What the parts of a limiter's script cost Redis, one Lua statement at a time.

    python bench/script_parts.py                 # 7 passes of 2,000 calls per probe
    python bench/script_parts.py --passes 3 --calls 500

A private redis-server (``tests.servers.start_redis``: loopback, stopped by PID). Each probe is a
tiny script doing one thing our fast path or the minimal limiter of ``bench_overhead.py`` does
(parse the argument, read the clock, read or write a key, format the reply). Reported: the
server's own time per ``EVALSHA`` (``usec_per_call`` of INFO commandstats), the median over
passes that alternate the probes, and each probe's cost over a bare ``return 1``. Every probe
gets the same KEYS and ARGV (keys rotate over 50 per probe, so reads find a key after the
first pass); the figures are the server's time, not the network's or Python's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import redis

ARGUMENT = "1733450000000000,0,1,100,3600000000,1"  # now, mode, code, limit, period, cost
MATCH = "string.match(ARGV[1], '^(%-?%d+),0,(%d+),([1-9]%d*),([1-9]%d*),(%d+)$')"
PROBES: dict[str, str] = {
    "return 1 (EVALSHA itself)": "return 1",
    "string.match of the argument": f"local a, b, c, d, e = {MATCH} return 1",
    "+ four tonumber": f"local a, b, c, d, e = {MATCH} "
    "local w, x, y, z = tonumber(a), tonumber(c), tonumber(d), tonumber(e) return 1",
    "TIME": "local t = redis.call('TIME') return 1",
    "HMGET of two fields": "local v = redis.pcall('HMGET', KEYS[1], 'w', 'n') return 1",
    "HSET of one field": "redis.call('HSET', KEYS[1], 'n', 5) return 1",
    "HMGET, then HSET": "local v = redis.pcall('HMGET', KEYS[1], 'w', 'n') "
    "redis.call('HSET', KEYS[1], 'n', 5) return 1",
    "INCR": "redis.call('INCR', KEYS[1]) return 1",
    "INCR, PTTL, a table reply (the minimal limiter)": "local n = redis.call('INCR', KEYS[1]) "
    "return {n, redis.call('PTTL', KEYS[1])}",
    "a reply of seven fields, string.format": "return string.format('%d,%s,%s,%d,%d,%d,%s', "
    "1733450000000000, '1', '100', 99, 3600000000, 0, '0')",
    "a reply of seven fields, ..": "local l, r, t = 99, 3600000000, 0 "
    "return ARGV[1] .. ',1,100,' .. l .. ',' .. r .. ',' .. t .. ',0'",
}


def measure(client: redis.Redis, passes: int, calls: int) -> dict[str, float]:
    shas = {name: client.script_load(source) for name, source in PROBES.items()}
    seen: dict[str, list[float]] = {name: [] for name in PROBES}
    for _ in range(passes):
        for n, name in enumerate(PROBES):
            client.config_resetstat()
            for i in range(calls):
                client.evalsha(shas[name], 1, f"probe{n}:{i % 50}", ARGUMENT)
            stats = client.info("commandstats")["cmdstat_evalsha"]
            seen[name].append(float(stats["usec_per_call"]))
    return {name: statistics.median(values) for name, values in seen.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.servers import start_redis  # starts and stops redis-server by PID

    server = start_redis()
    try:
        client = server.client()
        costs = measure(client, args.passes, args.calls)
        version = client.info("server")["redis_version"]
        client.close()
    finally:
        server.stop()
    bare = costs["return 1 (EVALSHA itself)"]
    print(f"| probe (Redis {version}) | us per call | over `return 1` |")
    print("|---|---:|---:|")
    for name, us in costs.items():
        print(f"| {name} | {us:.2f} | {us - bare:+.2f} |")
    print(f"\nMedians over {args.passes} alternating passes of {args.calls} calls per probe.")


if __name__ == "__main__":
    main()
