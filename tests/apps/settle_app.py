"""The app :mod:`tests.request.test_settle_gunicorn` runs under gunicorn.

Configured from the environment: ``DISTLIMIT_STORAGE_URL`` (a real Redis) and
``SETTLE_TEST_PREFIX`` (the key prefix, and the head of the test's own bookkeeping keys).
``/download`` sends a file of 1000 bytes, ``/stream`` streams 300 bytes, ``/left`` sends none: all
three count against one bytes limit; ``/big`` sends a file of 64 MiB against a bytes limit of its
own (scope ``huge``).
Each view counts itself in (``INCR <prefix>:entered:<view>``) and holds on a server-side
barrier (``BLPOP <prefix>:go``) that the test opens, so every request of a burst is in flight
at once.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import redis
from flask import Flask, Response, request, send_file
from flask.typing import ResponseReturnValue

from flask_distlimit import Limiter

PREFIX = os.environ.get("SETTLE_TEST_PREFIX", "settle-test")

app = Flask(__name__)
app.config.update(
    DISTLIMIT_STORAGE_URL=os.environ["DISTLIMIT_STORAGE_URL"],
    DISTLIMIT_KEY_PREFIX=PREFIX,
    # Exactness, not outages: a slow answer on a busy machine must not become an outage.
    DISTLIMIT_REDIS_TIMEOUT=5.0,
    DISTLIMIT_FAILURE_POLICY="closed",
    SECRET_KEY="settle-test-" + "x" * 20,  # one identity digest key in every process at once
)
limiter = Limiter(app)
# The barrier's BLPOP waits up to 60 s: longer than redis-py 8's default socket timeout (5 s),
# after which a held view would fail (a 500, whose reservation is given back).
book = redis.Redis.from_url(os.environ["DISTLIMIT_STORAGE_URL"], socket_timeout=90)


def _held(view: str) -> None:
    book.incr(f"{PREFIX}:entered:{view}")
    book.blpop([f"{PREFIX}:go"], timeout=60)


@app.get("/health")
@limiter.exempt
def health() -> str:
    return "ok"


@app.post("/login")
@limiter.limit("5/minute", deduct_when=lambda response: response.status_code == 401)
def login() -> ResponseReturnValue:
    _held("login")
    return "wrong password", 401


@app.post("/complete")
@limiter.limit(
    "100/day",
    algorithm="fixed_window",
    key_func=lambda: "tenant",
    cost=lambda: int(request.args["reserve"]),
    settle=lambda response: int(request.args["used"]),
)
def complete() -> ResponseReturnValue:
    _held("complete")
    return "ok"


# the test's own temporary folder, removed with it
FILE = Path(os.environ.get("SETTLE_TEST_DIR") or tempfile.mkdtemp()) / "download.bin"
FILE.write_bytes(b"d" * 1000)


@app.get("/download")
@limiter.shared_limit("5000/hour", scope="bytes", unit="content-bytes")
def download() -> Response:
    return send_file(FILE, mimetype="application/octet-stream")


BIG = FILE.with_name("big.bin")
with BIG.open("wb") as big:
    big.truncate(64 << 20)  # sparse: nothing is written


@app.get("/big")
@limiter.shared_limit("10000000000/hour", scope="huge", unit="content-bytes")
def big() -> Response:
    return send_file(BIG, mimetype="application/octet-stream")


@app.get("/stream")
@limiter.shared_limit("5000/hour", scope="bytes", unit="content-bytes")
def stream() -> Response:
    def chunks() -> Iterator[bytes]:
        for _ in range(3):
            yield b"s" * 100

    return Response(chunks())


@app.get("/left")
@limiter.shared_limit("5000/hour", scope="bytes", unit="content-bytes")
def left() -> str:
    return ""
