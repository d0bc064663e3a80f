"""What a request takes is given back once, however its response ends (issue 24, finding 1 and
item 1): ``send_file`` bodies (werkzeug serves them with ``direct_passthrough``, never calling
the response's ``close()``), streams, generators that raise, exceptions that escape Flask. In one
process with the test client; ``tests/defences/test_lifecycle_gunicorn.py`` is the matrix on real
gunicorn.
"""

from __future__ import annotations

import asyncio
import gc
import io
import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from asgiref.wsgi import WsgiToAsgi
from flask import Flask, Response, request, send_file, stream_with_context
from gunicorn.http.wsgi import FileWrapper
from werkzeug.test import EnvironBuilder

from flask_distlimit import Limiter
from flask_distlimit.defences.lifecycle import Ledger
from flask_distlimit.storage.base import Storage
from flask_distlimit.storage.memory import MemoryStorage
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import QUIET, backend, clock, make_app

__all__ = ["backend", "clock"]  # fixtures used below

Backend = Callable[[], Storage]


@pytest.fixture
def download(tmp_path: Path) -> Path:
    path = tmp_path / "report.csv"
    path.write_bytes(b"a,b\n" * 10_000)
    return path


def _app(storage: Storage, clock: FakeClock, download: Path) -> tuple[Flask, Limiter]:
    app, limiter, _ = make_app(
        storage, clock, DISTLIMIT_WORKER_THREADS=4, DISTLIMIT_FLEET_CAPACITY=10
    )

    @app.get("/download")
    @limiter.concurrency(2)
    def fetch() -> Response:
        return send_file(download)

    @app.get("/stream")
    @limiter.concurrency(2, scope="stream")
    def stream() -> Response:
        return Response(iter([b"a", b"b"]))

    @app.get("/broken")
    @limiter.concurrency(1, scope="broken")
    def broken() -> Response:
        def body() -> Iterator[bytes]:
            yield b"first"
            raise RuntimeError("the generator failed")

        return Response(body())

    @app.get("/aside")
    @limiter.concurrency(1, scope="aside")
    def aside() -> Response:
        send_file(download).close()  # a file the view makes and closes: not the body
        return send_file(download)

    return app, limiter


def _held(app: Flask) -> tuple[int, int]:
    """(this process's requests in flight, the fleet's slots in use)."""
    state = Limiter.state(app)
    assert state.shedding.load is not None
    health = state.health()
    return state.shedding.load.in_flight, health["fleet"]["in_flight"]  # type: ignore[index]


def test_sequential_downloads_give_back_their_slot_place_and_fleet_slot(
    backend: Backend, clock: FakeClock, download: Path
) -> None:
    """Today's code: the 3rd download is refused (concurrency 2) and the worker's count stays
    at 3 (with 4 threads every default request is then shed)."""
    app, _ = _app(backend(), clock, download)
    client = app.test_client()
    for _ in range(4):
        with client.get("/download") as response:  # closed, as a server closes it
            assert response.status_code == 200
            assert response.get_data() == download.read_bytes()
    assert _held(app) == (0, 0)


def test_a_download_holds_until_the_server_closes_it(
    backend: Backend, clock: FakeClock, download: Path
) -> None:
    app, _ = _app(backend(), clock, download)
    client = app.test_client()
    open_ = [client.get("/download") for _ in range(2)]
    assert [r.status_code for r in open_] == [200, 200]
    assert _held(app) == (2, 2)
    with client.get("/download") as refused:
        assert refused.status_code == 429  # two downloads in flight: the limit
    for response in open_:
        response.close()
    assert _held(app) == (0, 0)


def test_the_servers_file_wrapper_is_kept_for_sendfile_and_its_close_gives_back(
    backend: Backend, clock: FakeClock, download: Path
) -> None:
    """gunicorn sends a body with sendfile(2) only when it is its own wsgi.file_wrapper: the
    body must reach it unwrapped, and the server's close() of it must give everything back."""
    app, _ = _app(backend(), clock, download)
    app.test_client().get("/stream").close()  # the first request finalizes the app
    environ = EnvironBuilder(path="/download").get_environ()
    environ["wsgi.file_wrapper"] = FileWrapper
    body = app.wsgi_app(environ, lambda status, headers, exc_info=None: lambda data: None)
    assert type(body) is FileWrapper  # the server's own: sendfile stays possible
    assert environ["wsgi.file_wrapper"] is FileWrapper  # put back for the server's check
    assert body.filelike.fileno() > 0  # the proxy keeps the file's descriptor for sendfile
    assert _held(app) == (1, 1)
    assert b"".join(body) == download.read_bytes()
    body.close()
    assert _held(app) == (0, 0)


def test_only_the_bodys_file_gives_back_when_closed(
    backend: Backend, clock: FakeClock, download: Path
) -> None:
    """A file the view wraps and closes itself ends nothing: it gave back the request's slot,
    place and fleet slot while the view still ran (4 of concurrency 1 served at once)."""
    app, _ = _app(backend(), clock, download)
    app.test_client().get("/stream").close()  # the first request finalizes the app
    statuses: list[str] = []

    def call() -> Any:
        environ = EnvironBuilder(path="/aside").get_environ()
        environ["wsgi.file_wrapper"] = FileWrapper
        return app.wsgi_app(environ, lambda status, *_: statuses.append(status))

    body = call()
    assert type(body) is FileWrapper and _held(app) == (1, 1)
    call().close()
    assert statuses == ["200 OK", "429 TOO MANY REQUESTS"] and _held(app) == (1, 1)
    body.close()
    assert _held(app) == (0, 0)


def test_a_slot_taken_in_a_streamed_body_is_given_back_when_it_is_sent(
    backend: Backend, clock: FakeClock, download: Path
) -> None:
    """A ``with`` block in a stream takes its slot after the app returned the body: it was
    never given back (the next stream's block raised, refused, for the whole lease) when the
    request held nothing before (no worker or fleet limit)."""
    app, limiter, _ = make_app(backend(), clock)

    @app.get("/late")
    def late() -> Response:
        @stream_with_context
        def rows() -> Iterator[bytes]:
            with limiter.concurrency(1, scope="late"):  # decided once the response is made
                yield b"row"

        return Response(rows() if request.args.get("bare") else map(bytes.upper, rows()))

    client = app.test_client()
    for path in ("/late", "/late?bare=1") * 3:  # a generator, and any other iterable body
        with client.get(path) as response:
            assert response.get_data().lower() == b"row"


def test_a_stream_and_a_raising_generator_give_back_when_closed(
    backend: Backend, clock: FakeClock, download: Path
) -> None:
    app, _ = _app(backend(), clock, download)
    client = app.test_client()
    with client.get("/stream") as response:
        assert _held(app) == (1, 1)
        assert response.get_data() == b"ab"
    assert _held(app) == (0, 0)
    for _ in range(3):  # concurrency 1: a slot kept by a failed stream would refuse the next
        response = client.get("/broken")
        assert response.status_code == 200
        with pytest.raises(RuntimeError, match="the generator failed"):
            response.get_data()
        response.close()
    assert _held(app) == (0, 0)


def test_an_exception_that_escapes_flask_gives_back(clock: FakeClock, download: Path) -> None:
    app, limiter = _app(MemoryStorage(clock=clock), clock, download)
    app.testing = True  # the exception propagates out of the WSGI app

    @app.get("/fails")
    @limiter.concurrency(1, scope="fails")
    def fails() -> str:
        raise RuntimeError("the view failed")

    client = app.test_client()
    for _ in range(3):
        with pytest.raises(RuntimeError, match="the view failed"):
            client.get("/fails")
    assert _held(app) == (0, 0)


def test_a_file_like_object_download_gives_back(clock: FakeClock, download: Path) -> None:
    app, limiter = _app(MemoryStorage(clock=clock), clock, download)

    @app.get("/memory")
    @limiter.concurrency(1, scope="memory")
    def memory() -> Response:
        return send_file(io.BytesIO(b"in memory"), mimetype="text/plain")

    client = app.test_client()
    for _ in range(3):
        with client.get("/memory") as response:
            assert response.get_data() == b"in memory"
    assert _held(app) == (0, 0)


# -- deadlines and renewal ---------------------------------------------------------------------


def _long_stream_app(storage: Storage, clock: FakeClock) -> tuple[Flask, Limiter]:
    """Lease 30 s; ``/long`` streams 4 chunks, 20 s apart (the stream outlives its lease)."""
    app, limiter, _ = make_app(
        storage, clock, DISTLIMIT_CONCURRENCY_LEASE=30, DISTLIMIT_WORKER_THREADS=2
    )

    @app.get("/long")
    @limiter.concurrency(1)
    @limiter.priority("critical")
    def long() -> Response:
        def body() -> Iterator[bytes]:
            yield b"0"
            for i in range(1, 4):
                clock.advance(20)
                yield str(i).encode()

        return Response(body())

    @app.get("/page")
    @limiter.priority("sheddable")
    def page() -> str:
        return "page"

    return app, limiter


def test_a_long_stream_renews_its_slot_and_place_while_it_streams(
    backend: Backend, clock: FakeClock
) -> None:
    """Issue 24, finding 7: a stream's slot was never renewed, so past the lease a second
    stream got in under concurrency(1)."""
    app, _ = _long_stream_app(backend(), clock)
    client = app.test_client()
    first = client.get("/long")
    body = iter(first.response)
    assert [next(body), next(body), next(body)] == [b"0", b"1", b"2"]  # 40 s in: past its lease
    with client.get("/long") as second:
        assert second.status_code == 429  # the stream still holds its one slot
    with client.get("/page") as page:
        assert page.status_code == 503  # and its place among the 2 threads
    assert list(body) == [b"3"]
    first.close()
    with client.get("/long") as third:
        assert third.status_code == 200 and third.get_data() == b"0123"


def test_a_place_nobody_gives_back_ends_at_its_deadline(clock: FakeClock) -> None:
    """A request whose end never comes (its thread was killed, a server that never closes the
    body) holds its place in flight only until its deadline, the lease."""
    app, _ = _long_stream_app(MemoryStorage(clock=clock), clock)
    client = app.test_client()
    abandoned = client.get("/long")  # never iterated further, never closed
    assert abandoned.status_code == 200
    assert client.get("/page").status_code == 503
    clock.advance(29)
    assert client.get("/page").status_code == 503
    clock.advance(1)
    assert client.get("/page").status_code == 200  # the lost place was dropped
    state = Limiter.state(app)
    assert state.shedding.load is not None and state.shedding.load.in_flight == 0


def test_a_middleware_that_copies_the_environ_inside_the_wrapper(
    clock: FakeClock, download: Path
) -> None:
    """A middleware wrapped around ``wsgi_app`` before ``init_app`` runs inside the lifecycle's
    wrapper; one that hands the app a copy of the environ must not hide the request's ledger."""
    app = Flask(__name__)
    app.config.update(QUIET)
    inner = app.wsgi_app

    def copying(environ: dict[str, object], start_response: Callable[..., object]) -> object:
        return inner(dict(environ), start_response)  # type: ignore[arg-type]

    app.wsgi_app = copying  # type: ignore[assignment]
    limiter = Limiter(app, storage=MemoryStorage(clock=clock), clock=clock)

    @app.get("/one")
    @limiter.concurrency(1)
    def one() -> str:
        return "one"

    @app.get("/download")
    @limiter.concurrency(1, scope="download")
    def fetch() -> Response:
        return send_file(download)

    client = app.test_client()
    assert [client.get("/one").status_code for _ in range(3)] == [200] * 3
    environ = EnvironBuilder(path="/download").get_environ()
    environ["wsgi.file_wrapper"] = FileWrapper
    for _ in range(3):
        body = app(environ.copy(), lambda status, headers, exc_info=None: lambda data: None)
        assert type(body) is FileWrapper  # still the server's own, for sendfile
        body.close()


# -- held until sent (issue 34, finding 1 and item 1; finding 7 and item 5) ---------------------


def _export_app(storage: Storage, clock: FakeClock, download: Path) -> Flask:
    """``/export``: a complete body (made in memory); ``/feed``: a stream; ``/download``: a
    ``send_file``; one slot each."""
    app, limiter, _ = make_app(
        storage, clock, DISTLIMIT_WORKER_THREADS=4, DISTLIMIT_FLEET_CAPACITY=10
    )

    @app.get("/export")
    @limiter.concurrency(1)
    def export() -> Response:
        return Response([b"a,b\n" * 1000, b"c,d\n" * 1000], mimetype="text/csv")

    @app.get("/feed")
    @limiter.concurrency(1, scope="feed")
    def feed() -> Response:
        return Response(iter([b"one", b"two"]))

    @app.get("/download")
    @limiter.concurrency(1, scope="download")
    def fetch() -> Response:
        return send_file(download)

    return app


def _serve(app: Flask, method: str = "GET", path: str = "/export") -> Iterable[bytes]:
    """The body a WSGI server gets for one request, before it writes any of it."""
    environ = EnvironBuilder(path=path, method=method).get_environ()
    environ["REMOTE_ADDR"] = "127.0.0.1"  # the test client's: one identity
    return app(environ, lambda status, headers, exc_info=None: lambda data: None)  # type: ignore[no-any-return]


def test_a_complete_body_holds_until_the_server_has_written_it(
    backend: Backend, clock: FakeClock, download: Path
) -> None:
    """Issue 34, finding 1: a body Flask made whole gave back its slot, its place in flight and
    its fleet slot when the app returned, before the server wrote a byte of it: a client that
    read a large export slowly ran any number of them at once."""
    app = _export_app(backend(), clock, download)
    body = _serve(app)
    assert _held(app) == (1, 1)
    with app.test_client().get("/export") as refused:  # the first is still being sent
        assert refused.status_code == 429
        assert refused.get_json()["type"].endswith("#concurrency-limit-exceeded")
    chunks = iter(body)
    assert len(next(chunks)) == len(next(chunks)) == 4000  # the last chunk, being written
    assert _held(app) == (1, 1)
    assert next(chunks, None) is None  # the server asks past it: every byte is written
    assert _held(app) == (0, 0)
    body.close()  # type: ignore[attr-defined]
    assert _held(app) == (0, 0)


@pytest.mark.parametrize("method", ["HEAD", "GET"])
def test_a_body_closed_unread_gives_back(
    backend: Backend, clock: FakeClock, download: Path, method: str
) -> None:
    """A HEAD, or a client gone before the body: the server closes it (PEP 3333)."""
    app = _export_app(backend(), clock, download)
    for _ in range(3):  # one slot: a kept one would refuse the next round
        body = _serve(app, method)
        assert _held(app) == (1, 1)
        body.close()  # type: ignore[attr-defined]
        assert _held(app) == (0, 0)


def test_a_body_let_go_of_unfinished_gives_back(
    backend: Backend, clock: FakeClock, download: Path
) -> None:
    """A server that never closes the body (asgiref's WsgiToAsgi stops at Content-Length): the
    end comes when it lets go of the body; in the garbage collector, at the next request."""
    app = _export_app(backend(), clock, download)
    chunks = iter(_serve(app))
    next(chunks)
    assert _held(app) == (1, 1)
    del chunks  # dropped (reference counting): at once
    assert _held(app) == (0, 0)
    cycle: list[object] = [iter(_serve(app))]
    next(cycle[0])  # type: ignore[call-overload]
    cycle.append(cycle)
    del cycle
    gc.collect()  # no storage call from inside the collector
    assert _held(app) == (1, 1)
    with app.test_client().get("/export") as next_request:  # given back first
        assert next_request.status_code == 200
    assert _held(app) == (0, 0)


class _CloseRaises:
    """An app's body whose ``close()`` fails."""

    def __iter__(self) -> Iterator[bytes]:
        return iter([b"one", b"two"])

    def close(self) -> None:
        raise RuntimeError("the app's close failed")


def test_a_dropped_body_whose_close_raises_is_no_500_for_the_next_request(
    backend: Backend, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A body the garbage collector let go of is closed when the next request comes: its app's
    ``close()`` raising is logged, and that other request is served all the same."""
    app, limiter, _ = make_app(
        backend(), clock, DISTLIMIT_WORKER_THREADS=4, DISTLIMIT_FLEET_CAPACITY=10
    )

    @app.get("/feed")
    @limiter.concurrency(1)
    def feed() -> Response:
        return Response(_CloseRaises())

    @app.get("/other")
    def other() -> str:
        return "ok"

    cycle: list[object] = [iter(_serve(app, path="/feed"))]
    next(cycle[0])  # type: ignore[call-overload]
    cycle.append(cycle)
    del cycle
    gc.collect()
    assert _held(app) == (1, 1)
    with (
        caplog.at_level(logging.ERROR, logger="flask_distlimit"),
        app.test_client().get("/other") as next_request,  # given back first
    ):
        assert next_request.status_code == 200
    assert "the app's close failed" in caplog.text
    assert _held(app) == (0, 0)


def _asgi_call(app: Flask, path: str) -> list[tuple[dict[str, Any], tuple[int, int]]]:
    """One request through asgiref's ``WsgiToAsgi``, as uvicorn calls it: each message sent,
    with what the app held when it was sent."""
    sent: list[tuple[dict[str, Any], tuple[int, int]]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append((message, _held(app)))

    scope = {
        "type": "http", "http_version": "1.1", "method": "GET", "scheme": "http",
        "path": path, "root_path": "", "query_string": b"", "headers": [],
        "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000),
    }  # fmt: skip
    asyncio.run(WsgiToAsgi(app)(scope, receive, send))
    return sent


@pytest.mark.parametrize("path", ["/export", "/feed", "/download"])
def test_served_through_asgiref_every_body_gives_back_once_sent(
    backend: Backend, clock: FakeClock, download: Path, path: str
) -> None:
    """Issue 34, finding 7: asgiref's WsgiToAsgi never calls the body's close(), so a stream or
    a download kept its slot until the lease: the second request of each was refused."""
    app = _export_app(backend(), clock, download)
    for _ in range(3):
        sent = _asgi_call(app, path)
        statuses = [m["status"] for m, _ in sent if m["type"] == "http.response.start"]
        assert statuses == [200]
        bodies = [held for m, held in sent if m.get("body")]
        assert bodies and all(held == (1, 1) for held in bodies)  # held while it is sent
        assert _held(app) == (0, 0)


def test_a_holding_cut_short_by_a_base_exception_keeps_no_other_from_release() -> None:
    """A gevent timeout during one give-back stopped the ledger: the holdings after it (a bytes
    limit's settlement, another slot) were never released."""

    class Interrupted(BaseException):
        pass

    released: list[str] = []

    class Held:
        def __init__(self, name: str, fails: bool = False) -> None:
            self.name, self.fails = name, fails

        def release(self) -> None:
            released.append(self.name)
            if self.fails:
                raise Interrupted

        def renew(self) -> None:
            pass

    ledger = Ledger(lambda: 0, 1_000_000)
    for held in (Held("place"), Held("slot", fails=True), Held("bytes")):
        ledger.take(held)
    with pytest.raises(Interrupted):
        ledger.end()
    assert released == ["place", "slot", "bytes"] and ledger.ended
