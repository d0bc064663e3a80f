"""``unit="content-bytes"`` (issue 35 item 2): a limit of the bytes of the response bodies sent,
settled when the body ends (complete bodies, streams, ``send_file`` and byte ranges, HEAD = 0,
a client that goes away: what it was sent), on memory, fakeredis and a real redis-server."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from flask import Flask, Response, send_file

from flask_distlimit import Limiter
from flask_distlimit.request.deduction import SETTLE_EVERY_US
from flask_distlimit.storage.base import Storage
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import backend, clock, make_app

__all__ = ["backend", "clock"]  # fixtures used below

Backend = Callable[[], Storage]


def bytes_app(storage: Storage, clock: FakeClock, path: Path) -> tuple[Flask, Limiter]:
    app, limiter, _ = make_app(storage, clock)
    path.write_bytes(b"x" * 400)

    @app.get("/page")
    @limiter.limit("1000/hour", unit="content-bytes", scope="bytes")
    def page() -> str:
        return "p" * 300

    @app.get("/stream")
    @limiter.limit("1000/hour", unit="content-bytes", scope="bytes")
    def stream() -> Response:
        def chunks() -> Iterator[bytes]:
            for _ in range(3):
                yield b"s" * 100

        return Response(chunks())

    @app.get("/file")
    @limiter.limit("1000/hour", unit="content-bytes", scope="bytes")
    def file() -> Response:
        return send_file(path, mimetype="application/octet-stream")

    @app.get("/left")
    @limiter.limit("1000/hour", unit="content-bytes", scope="bytes")
    def left() -> str:
        return ""  # 0 bytes: tells what is left

    return app, limiter


def test_a_bytes_limit_beside_a_limit_of_requests_of_the_same_rate_has_a_name_of_its_own(
    backend: Backend, clock: FakeClock
) -> None:
    """Both are listed in ``RateLimit-Policy``, and the headers report the one closest to
    denial: with one name, the bytes limit's settlement replaced the requests limit's report,
    and a client was told 5 left until its 429."""
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_ALGORITHM="fixed_window")

    @app.get("/d")
    @limiter.limit("5/hour", unit="content-bytes")
    @limiter.limit("5/hour")
    def d() -> str:
        return ""  # no bytes: the requests limit is the closer to denial

    client = app.test_client()
    answers = [client.get("/d") for _ in range(6)]
    assert [a.status_code for a in answers] == [200] * 5 + [429]
    assert [a.headers["X-RateLimit-Remaining"] for a in answers[:5]] == ["4", "3", "2", "1", "0"]
    policy = answers[0].headers["RateLimit-Policy"]
    assert '"d:5/hour";q=5;w=3600' in policy  # old code: only the bytes limit, named alike
    assert '"d:5/hour content-bytes";q=5;w=3600;qu="content-bytes"' in policy


def test_every_kind_of_body_is_counted_in_bytes(
    backend: Backend, clock: FakeClock, tmp_path: Path
) -> None:
    app, _ = bytes_app(backend(), clock, tmp_path / "f.bin")
    client = app.test_client()

    def left() -> int:
        return int(client.get("/left").headers["X-RateLimit-Remaining"])

    response = client.get("/page")
    assert response.headers["X-RateLimit-Remaining"] == "700"  # a complete body: settled now
    assert 'qu="content-bytes"' in response.headers["RateLimit-Policy"]
    assert left() == 700
    with client.get("/stream") as streamed:  # a stream: settled when the server closes it
        assert len(streamed.data) == 300
    assert left() == 400
    assert client.head("/page").status_code == 200  # HEAD sends no body
    assert left() == 400
    ranged = client.get("/file", headers={"Range": "bytes=0-99"})
    assert (ranged.status_code, len(ranged.data)) == (206, 100)
    ranged.close()
    assert left() == 300
    whole = client.get("/file")
    assert len(whole.data) == 400
    whole.close()
    assert left() == 0  # 100 in debt: the quota is refused until it is repaid
    assert client.get("/page").status_code == 429


def test_a_client_that_goes_away_is_charged_what_it_was_sent(
    backend: Backend, clock: FakeClock, tmp_path: Path
) -> None:
    app, _ = bytes_app(backend(), clock, tmp_path / "f.bin")
    client = app.test_client()
    response = client.get("/stream", buffered=False)
    body = iter(response.response)
    assert next(body) == b"s" * 100  # one chunk taken, then the client is gone
    response.close()
    assert int(client.get("/left").headers["X-RateLimit-Remaining"]) == 900


def test_settle_of_a_streamed_body_reads_the_response_when_the_body_ends(
    backend: Backend, clock: FakeClock
) -> None:
    """A streamed LLM answer knows its tokens once the stream is done: ``settle`` is called
    then, with the response the stream wrote them on."""
    app, limiter, _ = make_app(backend(), clock)

    @app.get("/complete")
    @limiter.limit("100/day", cost=10, settle=lambda response: response.tokens_used)
    def complete() -> Response:
        def tokens() -> Iterator[str]:
            yield from ("one ", "two ", "three")
            response.tokens_used = 3  # type: ignore[attr-defined]  # the app's own field

        response = Response(tokens())
        return response

    client = app.test_client()
    with client.get("/complete") as streamed:
        assert streamed.headers["X-RateLimit-Remaining"] == "90"  # the reservation, so far
        assert streamed.data == b"one two three"
    with client.get("/complete") as again:
        assert again.headers["X-RateLimit-Remaining"] == "87"  # 3 used, 7 given back


def test_a_long_stream_is_charged_while_it_lasts(backend: Backend, clock: FakeClock) -> None:
    """At least every few seconds (SETTLE_EVERY_US, on the local clock read at each chunk), the
    bytes a stream sent so far are charged; the rest when it ends. No thread: a stream that
    sends nothing has nothing to charge."""
    app, limiter, _ = make_app(backend(), clock)

    @app.get("/long")
    @limiter.limit("1000/hour", unit="content-bytes", scope="bytes")
    def long() -> Response:
        return Response(b"l" * 100 for _ in range(5))

    @app.get("/left")
    @limiter.limit("1000/hour", unit="content-bytes", scope="bytes")
    def left() -> str:
        return ""

    client = app.test_client()
    response = client.get("/long", buffered=False)
    body = iter(response.response)
    next(body)
    clock.advance(SETTLE_EVERY_US / 1e6 - 0.5)  # not yet due
    next(body)
    assert client.get("/left").headers["X-RateLimit-Remaining"] == "999"  # the reservation
    clock.advance(1)  # due (main settled only at half the 60 s lease)
    next(body)
    assert client.get("/left").headers["X-RateLimit-Remaining"] == "700"  # 300 sent so far
    next(body)
    clock.advance(SETTLE_EVERY_US / 1e6)
    next(body)
    assert client.get("/left").headers["X-RateLimit-Remaining"] == "500"  # 500 sent so far
    assert list(body) == []
    response.close()
    assert client.get("/left").headers["X-RateLimit-Remaining"] == "500"


def test_current_limits_tell_the_unit(backend: Backend, clock: FakeClock, tmp_path: Path) -> None:
    app, limiter = bytes_app(backend(), clock, tmp_path / "f.bin")
    with app.test_request_context("/page"):
        app.preprocess_request()
        app.view_functions["page"]()
        assert [(x.unit, x.limit, x.remaining) for x in limiter.current_limits] == [
            ("content-bytes", 1000, 999)  # the reservation, before the body is known
        ]
