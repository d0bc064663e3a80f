"""The app :mod:`tests.defences.test_concurrency_gunicorn` runs under gunicorn.

Configured from the environment: ``DISTLIMIT_STORAGE_URL`` (a real Redis),
``CONCURRENCY_TEST_N`` (the N of ``/slow``), ``DISTLIMIT_CONCURRENCY_LEASE`` (seconds) and
``CONCURRENCY_TEST_PREFIX`` (the key prefix, and the head of the test's own bookkeeping keys),
``CONCURRENCY_TEST_FLEET`` (``DISTLIMIT_FLEET_CAPACITY``; a request's priority is its ``?p=``).

The handler holds its request open on a server-side barrier, not a sleep: it waits on a Redis
list (``BLPOP <prefix>:go``) that the test fills when it has seen what it needs. On entry it counts
itself in flight (``INCR``) and records the count it saw and its PID, so the test reads the
largest number in flight at once across every process, from the server side.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import redis
from flask import Flask, Response, request

from flask_distlimit import Limiter

N = int(os.environ.get("CONCURRENCY_TEST_N", "3"))
PREFIX = os.environ.get("CONCURRENCY_TEST_PREFIX", "cc-test")

app = Flask(__name__)
app.config.update(
    DISTLIMIT_STORAGE_URL=os.environ["DISTLIMIT_STORAGE_URL"],
    DISTLIMIT_KEY_PREFIX=PREFIX,
    DISTLIMIT_CONCURRENCY_LEASE=int(os.environ.get("DISTLIMIT_CONCURRENCY_LEASE", "60")),
    # Exactness, not outages: a slow answer on a busy machine must not become an outage.
    DISTLIMIT_REDIS_TIMEOUT=5.0,
    DISTLIMIT_FAILURE_POLICY="closed",
    DISTLIMIT_FLEET_CAPACITY=int(os.environ.get("CONCURRENCY_TEST_FLEET", "0")),
)
limiter = Limiter(app)
book = redis.Redis.from_url(os.environ["DISTLIMIT_STORAGE_URL"])


@app.get("/health")
@limiter.exempt
def health() -> str:
    return f"ok {os.getpid()}"


@app.after_request
def answered(response: Response) -> Response:
    """Every answer (429s too) records the PID that gave it."""
    book.rpush(f"{PREFIX}:answered", os.getpid())
    return response


def _held() -> str:
    seen = book.incr(f"{PREFIX}:inflight")
    book.rpush(f"{PREFIX}:seen", seen)
    book.rpush(f"{PREFIX}:pids", os.getpid())
    try:
        book.blpop([f"{PREFIX}:go"], timeout=60)
    finally:
        book.decr(f"{PREFIX}:inflight")
    return f"done {os.getpid()}"


@app.get("/slow")
@limiter.concurrency(N)
def slow() -> str:
    return _held()


@limiter.priority_resolver
def from_query() -> str | None:
    return request.args.get("p")


@app.get("/work")
def work() -> str:
    return _held()


@app.get("/one")
@limiter.concurrency(1, scope="one")
def one() -> str:
    return _held()


@app.get("/long-stream")
@limiter.concurrency(1, scope="long")
def long_stream() -> Response:
    """24 chunks, 0.25 s apart: a stream that outlives a short lease several times."""

    def body() -> Iterator[bytes]:
        for i in range(24):
            if i:
                time.sleep(0.25)
            yield b"%02d\n" % i

    return Response(body(), mimetype="text/plain")
