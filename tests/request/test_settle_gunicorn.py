"""Black box, issue 35: reservations under gunicorn (2 instances x 3 gthread workers x 4
threads, one real Redis). Concurrent wrong passwords never take more than the limit to the view;
settlements past the limit put the quota in debt by exactly what the requests in flight used
beyond their reservations, each charged once."""

from __future__ import annotations

import http.client
import os
import socket
import tempfile
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.gunicorn_servers import Gunicorn, launch, status_of, until, wait_ready
from tests.servers import RedisProcess

pytestmark = [pytest.mark.gunicorn, pytest.mark.redis, pytest.mark.slow]


@pytest.fixture
def deployed(redis_server: RedisProcess) -> Iterator[tuple[list[Gunicorn], str]]:
    """Two gunicorn instances of ``tests/apps/settle_app.py`` on the session's Redis, and the
    key prefix they use."""
    client = redis_server.client()
    client.flushall()
    prefix = f"settle-{os.getpid()}"
    env = {"DISTLIMIT_STORAGE_URL": redis_server.url, "SETTLE_TEST_PREFIX": prefix}
    with tempfile.TemporaryDirectory(prefix="distlimit-settle-") as logdir:
        env["SETTLE_TEST_DIR"] = logdir
        servers = [launch("tests.apps.settle_app:app", env, Path(logdir)) for _ in range(2)]
        try:
            for server in servers:
                wait_ready(server)
            yield servers, prefix
        finally:
            for server in servers:
                server.stop()
            client.flushall()
            client.close()


def test_thirty_simultaneous_wrong_passwords_admit_at_most_five(
    deployed: tuple[list[Gunicorn], str], redis_server: RedisProcess
) -> None:
    (one, two), prefix = deployed
    book = redis_server.client()
    n = 30
    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [
            pool.submit(status_of, (one, two)[i % 2].port, "/login", "POST") for i in range(n)
        ]

        def entered() -> int:
            return int(book.get(f"{prefix}:entered:login") or 0)

        # The limit's 5 are in the view, held: every other request must be refused, now and
        # after the barrier opens (their failures stay charged). A worker whose 4 threads are
        # all held answers its next connections only then.
        until(lambda: entered() >= 5, "5 requests in the view")
        book.rpush(f"{prefix}:go", *["go"] * n)
        statuses = Counter(f.result() for f in futures)
    assert entered() == 5  # a peek before the view let 8 to 11 in (measured on main)
    assert statuses == Counter({401: 5, 429: n - 5})
    assert status_of(one.port, "/login", "POST") == 429


def test_debt_is_what_the_requests_in_flight_used_beyond_their_reservations(
    deployed: tuple[list[Gunicorn], str], redis_server: RedisProcess
) -> None:
    """8 requests in flight at once against 100/day, each reserving 10 and using 20: all 8 are
    admitted (80 reserved), and their settlements put the count at 160, exactly: 60 over the
    limit, within the bound of 8 x 10 excess, no settlement lost or made twice."""
    (one, two), prefix = deployed
    book = redis_server.client()
    n = 8
    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [
            pool.submit(status_of, (one, two)[i % 2].port, "/complete?reserve=10&used=20", "POST")
            for i in range(n)
        ]
        until(lambda: int(book.get(f"{prefix}:entered:complete") or 0) == n, "8 in flight")
        book.rpush(f"{prefix}:go", *["go"] * n)
        assert [f.result() for f in futures] == [200] * n
    (key,) = [k for k in book.scan_iter(match=f"{prefix}:*fixed_window", count=1000)]
    assert int(book.hget(key, "n") or 0) == 160
    assert status_of(one.port, "/complete?reserve=1&used=0", "POST") == 429  # in debt: refused


def _get(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=90)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read(), response.getheader("RateLimit-Policy") or ""
    finally:
        conn.close()


def test_bytes_sent_by_sendfile_and_by_a_stream_are_charged(
    deployed: tuple[list[Gunicorn], str], redis_server: RedisProcess
) -> None:
    """Issue 35 item 2 as served: a ``send_file`` body, a byte range of it and a stream each
    charge the bytes of their body, settled when gunicorn closes it; HEAD charges nothing."""
    (one, two), prefix = deployed
    book = redis_server.client()

    def counted() -> int:
        (key,) = [k for k in book.scan_iter(match=f"{prefix}:*bytes*", count=1000)]
        return int(book.hget(key, "c") or 0)  # the sliding window counter's current count

    status, body, policy = _get(one.port, "/download")
    assert (status, len(body)) == (200, 1000)
    assert 'qu="content-bytes"' in policy
    until(lambda: counted() == 1000, "the file's bytes settled")
    status, body, _ = _get(two.port, "/download", {"Range": "bytes=0-99"})
    assert (status, len(body)) == (206, 100)
    until(lambda: counted() == 1100, "the range's bytes settled")
    status, body, _ = _get(one.port, "/stream")
    assert (status, len(body)) == (200, 300)
    until(lambda: counted() == 1400, "the stream's bytes settled")
    conn = http.client.HTTPConnection("127.0.0.1", two.port, timeout=90)
    conn.request("HEAD", "/download")
    assert conn.getresponse().status == 200
    conn.close()
    assert _get(one.port, "/left")[0] == 200
    until(lambda: counted() == 1400, "the reservations of HEAD and /left given back")


def test_a_client_that_leaves_a_file_part_way_is_charged_about_what_it_was_sent(
    deployed: tuple[list[Gunicorn], str], redis_server: RedisProcess
) -> None:
    """A client reads 256 KiB of a 64 MiB ``send_file`` body and closes its connection: the
    bytes limit is charged what gunicorn took of the body before its write failed, bounded by
    the socket buffers between them (a client buffer of 64 KiB, the server's of at most 4 MiB
    on Linux), never the file's whole ``Content-Length``."""
    (one, _), prefix = deployed
    book = redis_server.client()
    size = 64 << 20
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # before connect: no tuning
    sock.settimeout(90)
    sock.connect(("127.0.0.1", one.port))
    sock.sendall(b"GET /big HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    received = b""
    while len(received) < 256 << 10:
        chunk = sock.recv(65536)
        assert chunk, received[:200]
        received += chunk
    assert received.startswith(b"HTTP/1.1 200")
    sock.close()  # unread data: a reset, gunicorn's next write fails and it closes the body

    def counted() -> int:
        keys = list(book.scan_iter(match=f"{prefix}:*huge*", count=1000))
        return int(book.hget(keys[0], "c") or 0) if keys else -1

    until(lambda: counted() > 1, "the reservation settled")
    assert 256 << 10 <= counted() < size // 4  # the file's whole length before (measured: 64 MiB)
