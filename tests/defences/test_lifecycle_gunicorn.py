"""The lifecycle matrix on real gunicorn (issue 24, item 2): every way a response can end x every
defence. One gunicorn (1 worker process, so ``/_debug`` reads the process that served each cell)
serves ``tests/apps/lifecycle_app.py``, where every defended route carries all of them at once:
worker shedding, fleet shedding, a global limit, one concurrency slot shared by every route, a
rate limit, a ``deduct_when`` limit and a leased limit. After each cell, this process's requests
in flight, the shared slot and the fleet's slots are back to zero (waited for: the server closes
a body just after its last bytes), and each limit was charged what the docs say:

- the global limit: every request but an exempt one (404s, hooks' answers and Flask's own
  ``OPTIONS`` too, counted after the response);
- the route's rate limit and its leased limit: every request whose view gate ran (not a hook's
  answer, not Flask's own ``OPTIONS``); a leased limit's count in Redis is what was spent plus
  what the lease holds;
- the ``deduct_when`` limit: when its callable says so on the response Flask made (status >= 400
  here), before the body is sent: a stream that fails midway was a 200.

gthread, and gevent (``-k gevent --worker-connections 1000``) when it is installed.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gunicorn_servers import Gunicorn, launch, until, wait_ready
from tests.servers import RedisProcess

pytestmark = [pytest.mark.gunicorn, pytest.mark.redis, pytest.mark.slow]

WORKERS = [
    pytest.param(("--worker-class", "gthread", "--threads", "4"), id="gthread"),
    # gevent comes with the [test] extra: without it this cell fails, it never skips.
    pytest.param(("--worker-class", "gevent", "--worker-connections", "1000"), id="gevent"),
]


@pytest.fixture(params=WORKERS)
def server(request: pytest.FixtureRequest, redis_server: RedisProcess) -> Iterator[Gunicorn]:
    worker: tuple[str, ...] = request.param
    with tempfile.TemporaryDirectory(prefix="distlimit-lifecycle-") as logdir:
        env = {
            "DISTLIMIT_STORAGE_URL": redis_server.url,
            "LIFECYCLE_TEST_PREFIX": f"lc-{os.getpid()}-{next(_prefixes)}",
            "LIFECYCLE_TEST_DIR": logdir,
        }
        workers = ("--workers", "1", *worker)
        running = launch("tests.apps.lifecycle_app:app", env, Path(logdir), workers)
        try:
            wait_ready(running, path="/exempt")
            yield running
        finally:
            running.stop()


_prefixes = itertools.count()


def _call(
    port: int, method: str, path: str, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, headers=headers or {})
        response = conn.getresponse()
        try:
            body = response.read()
        except http.client.IncompleteRead as cut:  # a stream that failed midway
            body = cut.partial
        return response.status, body
    finally:
        conn.close()


def _disconnect_mid_body(port: int, path: str) -> tuple[int, bytes]:
    """Read the status line and some of the body, then go away."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        received = b""
        while len(received) < 200_000:
            chunk = sock.recv(65_536)
            if not chunk:
                break
            received += chunk
    return int(received.split(b" ", 2)[1]), received


def _debug(port: int) -> dict[str, object]:
    status, body = _call(port, "GET", "/_debug")
    assert status == 200, body
    found: dict[str, object] = json.loads(body)
    return found


def _idle(state: dict[str, object]) -> bool:
    used = state["used"]
    assert isinstance(used, dict)
    return state["in_flight"] == 0 and state["fleet"] == 0 and used["slot:1 in flight"] == 0


#: (cell, method, path, status, charged to global, to the route's rate and leased limits,
#: to the deduct_when limit)
CELLS = [
    ("plain", "GET", "/plain", 200, 1, 1, 0),
    ("send_file", "GET", "/file", 200, 1, 1, 0),
    ("send_file, a byte range", "RANGE", "/file", 206, 1, 1, 0),
    ("streamed", "GET", "/stream", 200, 1, 1, 0),
    ("streamed and raising", "GET", "/stream-raises", 200, 1, 1, 0),
    ("view raising", "GET", "/raises", 500, 1, 1, 1),
    ("abort(403)", "GET", "/aborts", 403, 1, 1, 1),
    ("error handler", "GET", "/teapot", 418, 1, 1, 1),
    ("client disconnects mid-body", "DISCONNECT", "/endless", 200, 1, 1, 0),
    ("client disconnects mid-export", "DISCONNECT", "/export", 200, 1, 1, 0),
    ("HEAD of an export", "HEAD", "/export", 200, 1, 1, 0),
    ("HEAD", "HEAD", "/plain", 200, 1, 1, 0),
    ("HEAD of send_file", "HEAD", "/file", 200, 1, 1, 0),
    ("OPTIONS, Flask's own", "OPTIONS", "/plain", 200, 1, 0, 0),
    ("OPTIONS, the view's", "OPTIONS", "/own-options", 204, 1, 1, 0),
    ("exempt view", "GET", "/exempt", 200, 0, 0, 0),
    ("before_request hook answers", "GET", "/hooked", 401, 1, 0, 0),
    ("no route (404)", "GET", "/nowhere", 404, 1, 0, 0),
]


def test_every_response_gives_back_what_it_took_and_is_charged_as_documented(
    server: Gunicorn,
) -> None:
    port = server.port
    before = _debug(port)
    assert _idle(before)
    pid = before["pid"]
    failures: list[str] = []
    for _ in range(2):  # twice: a slot a cell kept would refuse its second round (1 slot)
        for cell, method, path, status, every, route, deducted in CELLS:
            if method == "DISCONNECT":
                got, body = _disconnect_mid_body(port, path)
            elif method == "RANGE":
                got, body = _call(port, "GET", path, {"Range": "bytes=100-199"})
            else:
                got, body = _call(port, method, path)
            if got != status:
                failures.append(f"{cell}: status {got}, not {status}: {body[:300]!r}")
            state: dict[str, object] = {}

            def settled(holder: dict[str, object] = state) -> bool:
                holder.clear()
                holder.update(_debug(port))
                return _idle(holder)

            try:
                until(settled, f"{cell} to give back what it took", timeout=15)
            except AssertionError:
                failures.append(f"{cell}: still held after its end: {state}")
                continue
            used, was = state["used"], before["used"]
            assert isinstance(used, dict) and isinstance(was, dict)
            charged = {name: used[name] - was[name] for name in used}
            leased = charged["leased:99998/day"] - (
                int(state["lease_held"]) - int(before["lease_held"])  # type: ignore[call-overload]
            )
            expected = {
                "global:100000/day": every,
                "rate:100000/day": route,
                "deducted:99999/day": deducted,
                "leased (spent)": route,
            }
            seen = {
                "global:100000/day": charged["global:100000/day"],
                "rate:100000/day": charged["rate:100000/day"],
                "deducted:99999/day": charged["deducted:99999/day"],
                "leased (spent)": leased,
            }
            if seen != expected:
                failures.append(f"{cell}: charged {seen}, documented {expected}")
            if state["pid"] != pid:
                failures.append(f"{cell}: the worker was replaced ({pid} -> {state['pid']})")
            before = state
    assert not failures, "\n".join(failures) + "\n" + server.log.read_text()[-3000:]


EXPORT_BYTES = 16 * 1024 * 1024  # tests/apps/lifecycle_app.py's /export


def _start_export(port: int) -> tuple[socket.socket, int]:
    """Ask for ``/export`` with a small receive buffer and read its headers only: a client
    that then stalls. Answers the socket and the body bytes read with the headers."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65_536)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"GET /export HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(65_536)
        assert chunk, received
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert f"content-length: {EXPORT_BYTES}".encode() in head.lower(), head
    return sock, len(body)


def _holding_the_export(port: int) -> None:
    """While the export is being read: another request of the client is refused by the
    concurrency limit (one slot), and the worker and the fleet count it in flight."""
    got, body = _call(port, "GET", "/plain")
    assert got == 429 and b"concurrency-limit-exceeded" in body, (got, body[:300])
    state = _debug(port)
    used = state["used"]
    assert isinstance(used, dict)
    assert (state["in_flight"], state["fleet"], used["slot:1 in flight"]) == (1, 1, 1), state


def test_a_complete_body_holds_while_a_slow_client_reads_it(server: Gunicorn) -> None:
    """Issue 34, finding 1: a 16 MB body made in memory gave back its slot, its place in flight
    and its fleet slot before the server wrote it, so a client reading it slowly (or not at
    all) ran any number of exports at once and worker shedding saw 0 in flight. Now they are
    held until the server has written the body, under a stalled and then a slow reader."""
    port = server.port
    assert _idle(_debug(port))
    sock, read = _start_export(port)
    try:
        _holding_the_export(port)  # stalled: headers read, no body
        checked = False
        while read < EXPORT_BYTES:  # slow: in small reads, checked once a quarter is in
            chunk = sock.recv(16_384)
            assert chunk, f"the export ended after {read} bytes"
            read += len(chunk)
            if not checked and read > EXPORT_BYTES // 4:  # 12 MB left: more than buffered
                _holding_the_export(port)
                checked = True
        assert read == EXPORT_BYTES and checked
    finally:
        sock.close()
    until(lambda: _idle(_debug(port)), "the export to give back what it took", timeout=15)
    assert _call(port, "GET", "/plain")[0] == 200
