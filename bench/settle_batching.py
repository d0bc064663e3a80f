"""Do the settlements of concurrent requests share the decisions' batches? (issue 35 item 5)

    python bench/settle_batching.py --threads 32 --rounds 5

One Flask app in this process on a private redis-server, ``--threads`` threads each making one
request at once (a barrier inside the view holds them all in flight, then lets them go
together), per round: ``/plain`` reserves 10 units of a limit never reached; ``/settled`` the
same, settled to 7 after the response (one more script call each). Per route and round: Redis
``EVALSHA`` calls (``INFO commandstats``) and the socket reads Redis made (``INFO stats``
``total_reads_processed``: one per write of a batch, whatever its calls), and their ratio; a
ratio below 1 means calls shared writes. The settlements go through the same
:meth:`RedisStorage.evaluate <flask_distlimit.storage.redis.RedisStorage.evaluate>`, hence the
same :class:`~flask_distlimit.storage.pipeline.Pipeline`, as the decisions.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flask import Flask  # noqa: E402

from flask_distlimit import Limiter  # noqa: E402
from tests.servers import start_redis  # noqa: E402


def counters(client: Any) -> tuple[int, int]:
    """(EVALSHA calls, socket reads) of the server so far."""
    calls = client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    return int(calls), int(client.info("stats")["total_reads_processed"])


def make_app(url: str, barrier: threading.Barrier) -> Flask:
    app = Flask("settle-batching")
    app.config.update(
        DISTLIMIT_STORAGE_URL=url,
        DISTLIMIT_TIERS={"anonymous": ""},
        DISTLIMIT_REDIS_TIMEOUT=5.0,
        DISTLIMIT_FAILURE_POLICY="closed",
        SECRET_KEY="settle-batching-" + "x" * 20,
    )
    limiter = Limiter(app)

    @app.get("/plain")
    @limiter.limit("1000000000/day", cost=10, key_func=lambda: "plain")
    def plain() -> str:
        barrier.wait(timeout=60)
        return "ok"

    @app.get("/settled")
    @limiter.limit("1000000000/day", cost=10, key_func=lambda: "settled", settle=lambda r: 7)
    def settled() -> str:
        barrier.wait(timeout=60)
        return "ok"

    return app


def burst(app: Flask, path: str, n: int) -> None:
    statuses: list[int] = []

    def one() -> None:
        with app.test_client() as client:
            statuses.append(client.get(path).status_code)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert statuses == [200] * n, statuses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    options = parser.parse_args()
    server = start_redis()
    try:
        client = server.client()
        barrier = threading.Barrier(options.threads)
        app = make_app(server.url, barrier)
        burst(app, "/plain", options.threads)  # warm: scripts loaded, connections made
        print("route     calls  reads  reads/call  (per round)")
        for _ in range(options.rounds):
            for path in ("/plain", "/settled"):
                calls0, reads0 = counters(client)
                burst(app, path, options.threads)
                calls1, reads1 = counters(client)
                calls, reads = calls1 - calls0, reads1 - reads0 - 2  # less the 2 INFO reads
                print(f"{path:9} {calls:5}  {reads:5}  {reads / calls:10.2f}")
        Limiter.state(app).storage.close()
        client.close()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
