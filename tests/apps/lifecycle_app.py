"""The app :mod:`tests.defences.test_lifecycle_gunicorn` serves: one route per way a response can
end, each behind every defence (issue 24, item 2).

Configured from the environment: ``DISTLIMIT_STORAGE_URL`` (a real Redis) and
``LIFECYCLE_TEST_PREFIX`` (the key prefix). Every defence is on: worker shedding (4 threads),
fleet shedding, a global limit, and on every defended route one pool of ONE concurrency slot
shared by all of them (a slot any cell kept would refuse the next cell's request), a shared
rate limit, a shared ``deduct_when`` limit charged for responses of status 400 and up, and a
shared leased limit. The limiter runs on a frozen clock: no window, lease or deadline ends
during the test, so every count read is exact and nothing is given back by a deadline instead of
its release.

``/_debug`` (exempt) answers this process's requests in flight, the fleet's slots in use and
each limit's count (a peek of every limit, at the frozen time), and the units each quota lease
holds: the test reads them after every cell.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from flask import Flask, Response, abort, jsonify, request, send_file

from flask_distlimit import Limiter
from flask_distlimit.testing import FakeClock

F = TypeVar("F", bound=Callable[..., object])

app = Flask(__name__)
app.config.update(
    DISTLIMIT_STORAGE_URL=os.environ["DISTLIMIT_STORAGE_URL"],
    DISTLIMIT_KEY_PREFIX=os.environ.get("LIFECYCLE_TEST_PREFIX", "lifecycle"),
    DISTLIMIT_REDIS_TIMEOUT=5.0,  # exactness, not outages, on a busy machine
    DISTLIMIT_FAILURE_POLICY="closed",
    DISTLIMIT_WORKER_THREADS=4,
    DISTLIMIT_FLEET_CAPACITY=50,
    DISTLIMIT_GLOBAL_LIMITS="100000/day",
    DISTLIMIT_TIERS={"anonymous": ""},
    SECRET_KEY="lifecycle-test-secret-" + "x" * 20,
)
clock = FakeClock(start=1_700_000_040.0)  # frozen: never advanced
limiter = Limiter(app, clock=clock)

# the test's own temporary folder, removed with it
DOWNLOAD = Path(os.environ.get("LIFECYCLE_TEST_DIR") or tempfile.mkdtemp()) / "download.bin"
DOWNLOAD.write_bytes(os.urandom(256 * 1024))
CHUNK = b"x" * 65_536
#: a large export made in memory: more than the kernel buffers between server and client
EXPORT = b"e" * (16 * 1024 * 1024)


def defended(view: F) -> F:
    """Every per-route defence, shared by every defended route."""
    view = limiter.concurrency(1, scope="slot")(view)
    view = limiter.shared_limit("100000/day", scope="rate")(view)
    view = limiter.shared_limit(
        "99999/day", scope="deducted", deduct_when=lambda response: response.status_code >= 400
    )(view)
    return limiter.shared_limit("99998/day", scope="leased", lease=10)(view)


class Teapot(Exception):
    pass


@app.errorhandler(Teapot)
def teapot(exc: Teapot) -> tuple[str, int]:
    return "a teapot", 418


@app.before_request
def hook_answers() -> Response | None:
    """Registered after init_app: answers ``/hooked`` itself (as an auth hook answers 401)."""
    if request.path == "/hooked":
        return Response("no credentials", status=401)
    return None


@app.get("/plain")
@defended
def plain() -> str:
    return "plain"


@app.get("/export")
@defended
def export() -> Response:
    """A complete body (not streamed), sent as long as the client takes to read it."""
    return Response(EXPORT, mimetype="text/csv")


@app.get("/file")
@defended
def file() -> Response:
    return send_file(DOWNLOAD, mimetype="application/octet-stream")


@app.get("/stream")
@defended
def stream() -> Response:
    def body() -> Iterator[bytes]:
        for _ in range(8):
            yield CHUNK

    return Response(body(), mimetype="application/octet-stream")


@app.get("/stream-raises")
@defended
def stream_raises() -> Response:
    def body() -> Iterator[bytes]:
        yield CHUNK
        raise RuntimeError("the generator failed mid-body")

    return Response(body(), mimetype="application/octet-stream")


@app.get("/endless")
@defended
def endless() -> Response:
    """A stream that ends only when the client goes away."""

    def body() -> Iterator[bytes]:
        while True:
            yield CHUNK

    return Response(body(), mimetype="application/octet-stream")


@app.get("/raises")
@defended
def raises() -> str:
    raise RuntimeError("the view failed")


@app.get("/aborts")
@defended
def aborts() -> str:
    abort(403)


@app.get("/teapot")
@defended
def brews() -> str:
    raise Teapot


@app.route("/own-options", methods=["GET", "OPTIONS"])
@defended
def own_options() -> Response:
    if request.method == "OPTIONS":
        return Response(status=204, headers={"Allow": "GET, OPTIONS"})
    return Response("own")


@app.get("/exempt")
@limiter.exempt
def exempt() -> str:
    return "exempt"


@app.get("/hooked")
@defended
def hooked() -> str:  # never runs: the hook answers first
    return "unreachable"


@app.get("/_debug")
@limiter.exempt
def debug() -> Response:
    state = Limiter.state()
    assert state.shedding.load is not None and state.enforcer.fleet is not None
    named = state.checks_for("ip:127.0.0.1")
    evaluation = state.storage.evaluate([c for _, c in named], now_us=state.storage_now())
    decisions = evaluation.decisions
    used = {name: c.limit - d.remaining for (name, c), d in zip(named, decisions, strict=True)}
    fleet = state.enforcer.fleet.health(state.storage, now_us=state.storage_now())
    leases = state.health().get("leases", {})
    held = sum(int(v["held"]) for v in leases.values()) if isinstance(leases, dict) else 0
    return jsonify(
        in_flight=state.shedding.load.in_flight,
        fleet=fleet["in_flight"],
        used=used,
        lease_held=held,
        pid=os.getpid(),
    )
