"""Rate-limit headers: legacy X-RateLimit-*, IETF RateLimit/RateLimit-Policy, the limit closest
to denial, Retry-After only on 429/503."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from flask import Flask, Response, request
from werkzeug.test import EnvironBuilder

from flask_distlimit import Limiter
from flask_distlimit.declare.policy_items import sf_string
from flask_distlimit.request.headers import Report, rate_limit_headers
from flask_distlimit.storage.base import Storage
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import QUIET, backend, clock, make_app

__all__ = ["backend", "clock"]

Backend = Callable[[], Storage]


def _report(name: str = "p", **kw: float) -> Report:
    return Report(
        name=name,
        limit=int(kw.get("limit", 10)),
        period=int(kw.get("period", 60)),
        remaining=int(kw.get("remaining", 5)),
        reset_after=kw.get("reset_after", 30.0),
        retry_after=kw.get("retry_after", 0.0),
    )


def test_sf_string_quotes_escapes_and_stays_ascii() -> None:
    assert sf_string("orders:100/minute") == '"orders:100/minute"'
    assert sf_string('a"b\\c') == '"a\\"b\\\\c"'
    assert sf_string("caf\u00e9\n") == '"caf??"'


def test_both_header_families_when_allowed() -> None:
    headers = dict(
        rate_limit_headers("both", _report(reset_after=16.2), 1_700_000_000.5, denied=False)
    )
    assert headers == {
        "X-RateLimit-Limit": "10",
        "X-RateLimit-Remaining": "5",
        "X-RateLimit-Reset": str(1_700_000_017),  # ceil(now + 16.2): one rounding, not two
        "RateLimit-Policy": '"p";q=10;w=60',
        "RateLimit": '"p";r=5;t=17',
    }
    assert "Retry-After" not in headers


def test_denied_reports_zero_and_the_retry_time_rounded_up() -> None:
    report = _report(remaining=3, reset_after=50, retry_after=4.01)
    headers = dict(rate_limit_headers("both", report, 100.0, denied=True))
    assert headers["X-RateLimit-Remaining"] == "0"
    # the later of the window's reset (what a 200 said) and the retry time: never earlier
    assert headers["X-RateLimit-Reset"] == "150"
    assert headers["RateLimit"] == '"p";r=0;t=5'


@pytest.mark.parametrize(
    ("mode", "names"),
    [
        ("legacy", {"X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset"}),
        ("ietf", {"RateLimit-Policy", "RateLimit"}),
        ("none", set()),
    ],
)
def test_modes(mode: str, names: set[str]) -> None:
    got = {n for n, _ in rate_limit_headers(mode, _report(), 0.0, denied=False)}  # type: ignore[arg-type]
    assert got == names


def test_headers_report_the_limit_closest_to_denial(backend: Backend, clock: FakeClock) -> None:
    app, limiter, _ = make_app(
        backend(), clock, DISTLIMIT_GLOBAL_LIMITS="4/minute", DISTLIMIT_ALGORITHM="fixed_window"
    )

    @app.get("/")
    @limiter.limit("10/minute")
    def index() -> str:
        return "ok"

    client = app.test_client()
    first = client.get("/")
    assert first.headers["X-RateLimit-Limit"] == "4"
    # every policy that applied, the one reported first
    assert first.headers["RateLimit-Policy"] == (
        '"global:4/minute";q=4;w=60, "index:10/minute";q=10;w=60'
    )
    assert first.headers["RateLimit"] == '"global:4/minute";r=3;t=60'
    assert first.headers["X-RateLimit-Reset"] == str(1_700_000_040 + 60)
    assert "Retry-After" not in first.headers


def test_a_tie_in_units_left_reports_the_limit_whole_again_last(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_ALGORITHM="fixed_window")

    @app.get("/")
    @limiter.limit("2/second;2/hour;2/minute")
    def index() -> str:
        return "ok"

    first = app.test_client().get("/")
    # one unit left on each: the hour's window, the last to reset, is the one reported
    assert first.headers["RateLimit"] == '"index:2/hour";r=1;t=2760'  # aligned windows
    assert first.headers["RateLimit-Policy"].startswith('"index:2/hour";q=2;w=3600, ')


def test_headers_mode_none_still_sends_retry_after(backend: Backend, clock: FakeClock) -> None:
    app, limiter, _ = make_app(
        backend(), clock, DISTLIMIT_HEADERS="none", DISTLIMIT_ALGORITHM="fixed_window"
    )

    @app.get("/")
    @limiter.limit("1/minute")
    def index() -> str:
        return "ok"

    client = app.test_client()
    ok = client.get("/")
    assert not any(n.lower().startswith(("x-ratelimit", "ratelimit")) for n, _ in ok.headers)
    denied = client.get("/")
    assert denied.status_code == 429 and denied.headers["Retry-After"] == "60"
    assert not any(n.lower().startswith(("x-ratelimit", "ratelimit")) for n, _ in denied.headers)


def test_limits_refusing_together_report_the_longest_wait(
    backend: Backend, clock: FakeClock
) -> None:
    """Two limits refuse one request: ``Retry-After`` and the rate-limit headers are those of
    the one the client waits longest for, and the problem names both, in declared order."""
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_ALGORITHM="fixed_window")

    @app.get("/")
    @limiter.limit("1/second;1/minute")
    def index() -> str:
        return "ok"

    client = app.test_client()
    assert client.get("/").status_code == 200
    denied = client.get("/")
    assert denied.status_code == 429 and denied.headers["Retry-After"] == "60"
    assert denied.get_json()["violated-policies"] == ["index:1/second", "index:1/minute"]
    assert denied.headers["RateLimit"] == '"index:1/minute";r=0;t=60'


def test_a_429_of_the_app_itself_gets_no_retry_after_from_us(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(backend(), clock)

    @app.get("/")
    @limiter.limit("5/minute")
    def index() -> tuple[str, int]:
        return "busy", 429

    response = app.test_client().get("/")
    assert response.status_code == 429
    assert "Retry-After" not in response.headers
    assert response.headers["X-RateLimit-Remaining"] == "4"


_FAMILIES = {
    "legacy": ("X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset"),
    "ietf": ("RateLimit-Policy", "RateLimit"),
}
_MODE_NAMES = {
    "legacy": _FAMILIES["legacy"],
    "ietf": _FAMILIES["ietf"],
    "both": _FAMILIES["legacy"] + _FAMILIES["ietf"],
    "none": (),
}


def _assert_each_header_once(response: object, mode: str) -> None:
    headers = response.headers  # type: ignore[attr-defined]
    for name in _MODE_NAMES["both"]:
        assert len(headers.getlist(name)) == (name in _MODE_NAMES[mode]), (mode, name)
    assert len(headers.getlist("Retry-After")) == (response.status_code == 429)  # type: ignore[attr-defined]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["legacy", "ietf", "both", "none"])
def test_each_header_once_with_several_limits_in_every_mode(
    backend: Backend, clock: FakeClock, mode: str
) -> None:
    app, limiter, _ = make_app(
        backend(),
        clock,
        DISTLIMIT_HEADERS=mode,
        DISTLIMIT_GLOBAL_LIMITS="50/minute",
        DISTLIMIT_ALGORITHM="fixed_window",
    )
    shared = Response("shared")  # one response object returned by every request

    @app.get("/")
    @limiter.limit("3/minute")
    @limiter.limit("10/second;100/hour")
    def index() -> str:
        return "ok"

    @app.get("/shared")
    @limiter.limit("3/minute")
    def same_object() -> Response:
        return shared

    client = app.test_client()
    statuses = []
    for path in ("/", "/shared"):
        for _ in range(4):
            response = client.get(path)
            statuses.append(response.status_code)
            _assert_each_header_once(response, mode)
    assert statuses == [200, 200, 200, 429] * 2


def test_limits_of_huge_numbers_give_whole_headers(backend: Backend, clock: FakeClock) -> None:
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_ALGORITHM="fixed_window")

    @app.get("/")
    @limiter.limit(f"{10**12}/day")
    def index() -> str:
        return "ok"

    response = app.test_client().get("/")
    assert response.headers["X-RateLimit-Limit"] == str(10**12)
    assert response.headers["X-RateLimit-Remaining"] == str(10**12 - 1)
    assert f";r={10**12 - 1};t=" in response.headers["RateLimit"]
    _assert_each_header_once(response, "both")
    huge = _report(limit=10**30, remaining=10**30, reset_after=1e300, retry_after=1e300)
    for denied in (False, True):
        values = dict(rate_limit_headers("both", huge, 1_700_000_000.5, denied=denied))
        assert all(v.isprintable() and "e+" not in v and "inf" not in v for v in values.values())


def test_headers_are_sent_once_however_the_response_is_made(
    backend: Backend, clock: FakeClock
) -> None:
    """Our headers go out as the response starts (werkzeug's checks of the app's own headers
    cost a request more than the minimal limiter's whole Python): not on the response object,
    which an error in a later hook replaces, nor lost when the app is driven by hand, outside
    the WSGI call."""
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_HEADERS="legacy")
    broken: list[bool] = []

    @app.after_request  # registered after the limiter's hook: runs before it
    def break_once(response: Response) -> Response:
        if broken:
            return response
        broken.append(True)
        raise RuntimeError("a hook of the app")

    @app.get("/")
    @limiter.limit("5/minute")
    def index() -> str:
        return "ok"

    failed = app.test_client().get("/")  # the 500 passes the hooks again
    assert failed.status_code == 500
    assert failed.headers.getlist("X-RateLimit-Remaining") == ["4"]
    assert app.test_client().get("/").headers.getlist("X-RateLimit-Remaining") == ["3"]
    with app.test_request_context("/", environ_base={"REMOTE_ADDR": "127.0.0.1"}):
        by_hand = app.full_dispatch_request()
    assert by_hand.headers.getlist("X-RateLimit-Remaining") == ["2"]


def test_an_app_run_inside_another_s_request_keeps_each_limiter_s_headers(
    backend: Backend, clock: FakeClock
) -> None:
    """A view that serves another WSGI app with a limiter of its own on the request's very
    environ: each limiter's headers go out with its own app's response."""
    inner, inner_limiter, _ = make_app(backend(), clock, name="inner", DISTLIMIT_HEADERS="legacy")
    outer, outer_limiter, _ = make_app(backend(), clock, name="outer", DISTLIMIT_HEADERS="legacy")

    @inner.get("/")
    @inner_limiter.limit("3/minute")
    def inner_index() -> str:
        return "inner"

    @outer.get("/")
    @outer_limiter.limit("5/minute")
    def outer_index() -> Response:
        started: list[list[tuple[str, str]]] = []
        body = b"".join(inner(request.environ, lambda status, headers: started.append(headers)))
        return Response(body, headers=started[0])

    response = outer.test_client().get("/")
    assert response.get_data() == b"inner"
    assert sorted(response.headers.getlist("X-RateLimit-Limit")) == ["3", "5"]


Hook = Callable[[Response], Response]


def _one_a_minute(
    storage: Storage,
    clock: FakeClock,
    *,
    middleware: Callable[..., Any] | None = None,
    before_init: Sequence[Hook] = (),
    after_init: Sequence[Hook] = (),
) -> Flask:
    """An app limited to 1 a minute whose 429 is its own (without ``Retry-After``): its
    ``wsgi_app`` wrapped in ``middleware`` and the ``after_request`` hooks ``before_init``
    registered before ``init_app`` (inside the limiter's WSGI wrapper; Flask runs such hooks
    after the limiter's), ``after_init`` after it (run before the limiter's)."""
    app = Flask("one-a-minute")
    app.config.update(QUIET, DISTLIMIT_KEY_PREFIX=f"t{id(app):x}")
    if middleware is not None:
        app.wsgi_app = middleware(app.wsgi_app)  # type: ignore[method-assign]
    for hook in before_init:
        app.after_request(hook)
    limiter = Limiter(clock=clock)
    limiter.init_app(app, storage=storage)
    for hook in after_init:
        app.after_request(hook)

    @app.get("/")
    @limiter.limit("1/minute")
    def index() -> str:
        return "ok"

    @app.errorhandler(429)
    def slow_down(e: Exception) -> tuple[str, int]:
        return "slow down", 429

    return app


def test_the_app_s_own_retry_after_and_wsgi_quirks_keep_one_header_each(
    backend: Backend, clock: FakeClock
) -> None:
    """Our headers go out as the response starts, so a hook of the app registered before
    ``init_app`` (run after ours) that adds a ``Retry-After`` to a 429 lacking one does not
    see ours: its own is sent, alone. A middleware inside the wrapper that passes the headers
    as a tuple, or starts its own error response (``exc_info``), gets ours added to the first
    and none to the second."""

    def retry_after(response: Response) -> Response:
        if response.status_code in (429, 503):
            response.headers.setdefault("Retry-After", "60")
        return response

    client = _one_a_minute(backend(), clock, before_init=[retry_after]).test_client()
    client.get("/")
    assert client.get("/").headers.getlist("Retry-After") == ["60"]

    def as_tuple(inner: Callable[..., Any]) -> Callable[..., Any]:
        return lambda environ, sr: inner(environ, lambda s, h, *x: sr(s, tuple(h), *x))

    tupled = _one_a_minute(backend(), clock, middleware=as_tuple).test_client().get("/")
    assert tupled.status_code == 200 and tupled.headers["X-RateLimit-Remaining"] == "0"

    def failing_late(inner: Callable[..., Any]) -> Callable[..., Any]:
        def app(environ: dict[str, Any], sr: Callable[..., Any]) -> list[bytes]:
            inner(environ, sr)  # started, then its body fails before a byte is sent
            sr("500 INTERNAL SERVER ERROR", [("Content-Type", "text/plain")], (None, None, None))
            return [b"failed"]

        return app

    started: list[list[tuple[str, str]]] = []
    environ = EnvironBuilder("/", environ_base={"REMOTE_ADDR": "127.0.0.1"}).get_environ()
    _one_a_minute(backend(), clock, middleware=failing_late)(
        environ, lambda s, h, *x: started.append(h)
    )
    assert [("X-RateLimit-Remaining" in dict(h)) for h in started] == [True, False]


def test_a_response_made_after_an_error_in_the_hooks_carries_no_stale_headers(
    backend: Backend, clock: FakeClock
) -> None:
    """A hook of the app (run after ours) raises on a 429, and another (run before ours)
    raises on the 500 that replaces it, so Flask sends that 500 without running ours: the
    headers ours left for the 429 are not sent with it (the review of the headers' move)."""

    def fail_on_429(response: Response) -> Response:
        if response.status_code == 429:
            raise RuntimeError("a hook of the app")
        return response

    def fail_on_500(response: Response) -> Response:
        if response.status_code == 500:
            raise RuntimeError("another hook of the app")
        return response

    app = _one_a_minute(backend(), clock, before_init=[fail_on_429], after_init=[fail_on_500])
    client = app.test_client()
    assert client.get("/").headers["X-RateLimit-Remaining"] == "0"
    failed = client.get("/")
    assert failed.status_code == 500
    if importlib.util.find_spec("blinker") is not None:  # Flask's signals (2.2 may lack them)
        assert not {"X-RateLimit-Remaining", "RateLimit", "Retry-After"} & set(failed.headers)


def test_the_app_s_own_got_request_exception_outside_a_request_is_not_ours_to_break(
    backend: Backend, clock: FakeClock
) -> None:
    """Error-reporting code may send Flask's ``got_request_exception`` itself, outside a
    request: our receiver (it drops the headers left for a failed response) does nothing then,
    and the receivers after it are still called."""
    from flask import got_request_exception

    app, _, _ = make_app(backend(), clock)
    if importlib.util.find_spec("blinker") is None:
        return  # Flask 2.2 without blinker sends no signal: init_app did not connect one
    heard: list[BaseException] = []

    def after_ours(sender: object, exception: BaseException, **extra: object) -> None:
        heard.append(exception)

    got_request_exception.connect(after_ours, app)
    with app.app_context():
        got_request_exception.send(app, exception=ValueError("reported"))
    assert len(heard) == 1
