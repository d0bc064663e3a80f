"""What a team coming from Flask-Limiter 4.1.1 expects of the forms it already writes (issue 33,
items 1-6): a callable limit under an outer decorator, both ``on_breach`` hooks, a hook that
raises, a ``key_func`` opting a request out, a Limiter never set up, the ``with`` form.

Each case runs on memory, fakeredis and a real redis-server (the ``backend`` fixture); each
pins the behaviour ``docs/migrating-from-flask-limiter.md`` describes.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
from flask import Flask, Response, g, request
from flask.views import MethodView

from flask_distlimit import Breach, ConfigurationError, Limiter
from flask_distlimit.storage.base import Storage
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import backend, clock, make_app

__all__ = ["backend", "clock"]  # fixtures used below

Backend = Callable[[], Storage]


def statuses(app: Flask, path: str, n: int, **kwargs: Any) -> list[int]:
    client = app.test_client()
    return [client.get(path, **kwargs).status_code for _ in range(n)]


def api_key_required(view: Callable[..., Any]) -> Callable[..., Any]:
    """An app's own decorator, above the limit: it sets what the limit's callables read."""

    @functools.wraps(view)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        key = request.headers.get("X-Api-Key")
        if key is None:
            return "no key", 401
        g.api_key = key
        g.rate_limit = "3/minute" if key == "gold" else "2/minute"
        return view(*args, **kwargs)

    return wrapper


# -- 1. a limit whose callables read what an outer decorator sets ---------------------------------


def test_a_callable_limit_below_a_decorator_reads_what_the_decorator_set(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(backend(), clock)

    @app.get("/translate")
    @api_key_required
    @limiter.limit(lambda: g.rate_limit, key_func=lambda: g.api_key)
    def translate() -> str:
        return "ok"

    assert statuses(app, "/translate", 3, headers={"X-Api-Key": "basic"}) == [200, 200, 429]
    assert statuses(app, "/translate", 4, headers={"X-Api-Key": "gold"}) == [200, 200, 200, 429]
    # The decorator answered first: the limit never ran, as in Flask-Limiter.
    assert statuses(app, "/translate", 3) == [401, 401, 401]


def test_a_method_view_handler_limit_reads_what_the_class_decorators_set(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(backend(), clock)

    class Translate(MethodView):
        decorators: ClassVar[list[Callable[..., Any]]] = [api_key_required]

        @limiter.limit(lambda: g.rate_limit, key_func=lambda: g.api_key)
        def get(self) -> str:
            return "ok"

        def post(self) -> str:
            return "posted"

    app.add_url_rule("/translate", view_func=Translate.as_view("translate"))
    assert statuses(app, "/translate", 3, headers={"X-Api-Key": "basic"}) == [200, 200, 429]
    client = app.test_client()
    posts = [client.post("/translate", headers={"X-Api-Key": "basic"}) for _ in range(3)]
    assert [r.status_code for r in posts] == [200, 200, 200]  # the limit is the GET handler's


def test_global_limits_still_count_beside_a_limit_decided_below_a_decorator(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, counting = make_app(backend(), clock, DISTLIMIT_GLOBAL_LIMITS="10/minute")

    @app.get("/translate")
    @api_key_required
    @limiter.limit(lambda: g.rate_limit, key_func=lambda: g.api_key)
    def translate() -> str:
        return "ok"

    assert statuses(app, "/translate", 4, headers={"X-Api-Key": "gold"}) == [200, 200, 200, 429]
    # per request: the global limit at the gate, then the route's limit where it runs
    assert [[c.key.rsplit(":", 2)[-2] for c in checks] for checks in counting.checks[:2]] == [
        ["g_10/60"],
        ["r_translate_dyn_3/60"],
    ]
    assert statuses(app, "/translate", 7, headers={"X-Api-Key": "basic"})[-1] == 429


@pytest.mark.parametrize(("policy", "expected"), [("open", 200), ("closed", 503), ("local", 503)])
def test_a_limit_whose_options_raise_still_limits_whatever_the_failure_policy(
    backend: Backend,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
    policy: str,
    expected: int,
) -> None:
    """A client who can make a limit's ``key_func`` or ``cost`` raise (input it reads) must not
    switch the limit off: under ``open`` it once admitted such a request. A value that cannot be
    evaluated has no rate to apply: the failure policy answers, loudly."""
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_FAILURE_POLICY=policy)

    @app.get("/orders")
    @limiter.limit(lambda: g.missing)  # nothing sets g.missing: AttributeError
    def orders() -> str:
        return "ok"

    @app.get("/keyed")
    @limiter.limit("5/minute", key_func=lambda: g.missing)
    def keyed() -> str:
        return "ok"

    @app.get("/costly")
    @limiter.limit("5/minute", cost=lambda: g.missing)
    def costly() -> str:
        return "ok"

    @app.get("/negative")
    @limiter.limit("5/minute", cost=lambda: -1)  # not a cost
    def negative() -> str:
        return "ok"

    @app.get("/double")  # its cost stands when its key_func fails: no twice the quota
    @limiter.limit("10/minute", key_func=lambda: g.missing, cost=2)
    def double() -> str:
        return "ok"

    @app.get("/deducted")  # the cost is asked after the response: 1 reserved before the view
    @limiter.limit("5/minute", key_func=lambda: g.missing, cost=lambda: 1, deduct_when=bool)
    def deducted() -> str:
        return "ok"

    with caplog.at_level(logging.ERROR, logger="flask_distlimit"):
        response = app.test_client().get("/orders")  # never a 500, never silent
        assert response.status_code == expected
        if expected == 200:  # admitted, marked degraded
            assert response.headers["X-RateLimit-Degraded"] == "true"
        else:
            assert "could not be evaluated" in response.get_json()["detail"]
        for path in ("/keyed", "/costly", "/negative", "/deducted"):  # as if not given
            assert statuses(app, path, 6) == [200] * 5 + [429], path
        assert statuses(app, "/double", 6) == [200] * 5 + [429]
        other = {"REMOTE_ADDR": "192.0.2.9"}  # the key_func's fallback: the client's identity
        assert statuses(app, "/keyed", 1, environ_base=other) == [200]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("AttributeError" in e and "failure policy" in e for e in errors), errors
    assert any("AttributeError" in e and "The limit applies" in e for e in errors), errors
    assert any("TypeError" in e and "int >= 0" in e for e in errors), errors
    assert len(errors) == 6  # one line per limit, not one per request


def test_a_limit_own_on_failure_decides_for_an_unevaluable_limit(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(backend(), clock)  # DISTLIMIT_FAILURE_POLICY: open

    @app.get("/orders")
    @limiter.limit(lambda: g.missing, on_failure="closed")
    def orders() -> str:
        return "ok"

    assert statuses(app, "/orders", 2) == [503, 503]


# -- 2 and 3. on_breach ---------------------------------------------------------------------------


def test_the_app_hook_and_the_limit_hook_are_both_told(backend: Backend, clock: FakeClock) -> None:
    app, limiter, _ = make_app(backend(), clock)
    told: list[str] = []

    @limiter.on_breach
    def audit(breach: Breach) -> Response:
        told.append("app")
        return Response("from the app hook", status=429)

    def route_hook(breach: Breach) -> None:
        told.append("route")

    def route_answers(breach: Breach) -> Response:
        told.append("route answers")
        return Response("from the route hook", status=429)

    @app.get("/quiet")
    @limiter.limit("1/minute", on_breach=route_hook)
    def quiet() -> str:
        return "ok"

    @app.get("/loud")
    @limiter.limit("1/minute", on_breach=route_answers)
    def loud() -> str:
        return "ok"

    client = app.test_client()
    client.get("/quiet")
    refused = client.get("/quiet")
    # The route's hook answered None: the app hook's response is sent.
    assert (refused.status_code, refused.get_data(as_text=True)) == (429, "from the app hook")
    assert told == ["app", "route"]
    client.get("/loud")
    refused = client.get("/loud")
    assert (refused.status_code, refused.get_data(as_text=True)) == (429, "from the route hook")
    assert told == ["app", "route", "app", "route answers"]


def test_a_breach_hook_that_cannot_be_hashed_is_told_once(
    backend: Backend, clock: FakeClock
) -> None:
    """A callable dataclass (``__eq__`` and no ``__hash__``) as both hooks: told once, not a 500."""

    @dataclasses.dataclass
    class RecordBreaches:
        seen: list[Breach] = dataclasses.field(default_factory=list)

        def __call__(self, breach: Breach) -> None:
            self.seen.append(breach)

    hook = RecordBreaches()
    app, limiter, _ = make_app(backend(), clock)
    limiter.on_breach(hook)

    @app.get("/")
    @limiter.limit("1/minute", on_breach=hook)
    def index() -> str:
        return "ok"

    assert statuses(app, "/", 2) == [200, 429]
    assert len(hook.seen) == 1


def test_a_breach_hook_that_raises_still_gives_the_429(
    backend: Backend, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    app, limiter, _ = make_app(backend(), clock)

    @limiter.on_breach
    def broken(breach: Breach) -> None:
        raise RuntimeError("alerting is down")

    @app.get("/orders")
    @limiter.limit("1/minute", on_breach=broken)
    def orders() -> str:
        return "ok"

    with caplog.at_level(logging.ERROR, logger="flask_distlimit"):
        assert statuses(app, "/orders", 2) == [200, 429]
        response = app.test_client().get("/orders")
        assert statuses(app, "/orders", 20) == [429] * 20  # a client may refuse itself at will
    assert response.status_code == 429
    assert response.mimetype == "application/problem+json"
    logged = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert logged and "on_breach hook" in logged[0].getMessage() and logged[0].exc_info
    assert len(logged) == 1  # once a minute per route, not a traceback per refusal


def test_a_breach_words_its_rate_as_flask_limiter_does_on_request(
    backend: Backend, clock: FakeClock
) -> None:
    """``on_breach`` gets a ``Breach``: ``str(breach.limit)`` is ``1/second``, the form limits
    are written in; ``breach.limit.in_words()`` is Flask-Limiter's ``"1 per 1 second"``, the
    guide's port for a hook that shows ``request_limit.limit``."""
    app, limiter, _ = make_app(backend(), clock)

    @limiter.on_breach
    def explain(breach: Breach) -> Response:
        return Response(f"{breach.limit.in_words()} @ {request.path} ({breach.limit})", 429)

    @app.get("/t1")
    @limiter.limit("1/second")
    def t1() -> str:
        return "ok"

    client = app.test_client()
    assert client.get("/t1").status_code == 200
    refused = client.get("/t1")
    assert (refused.status_code, refused.get_data(as_text=True)) == (
        429,
        "1 per 1 second @ /t1 (1/second)",
    )


@pytest.mark.parametrize(
    ("option", "wrong"),
    [
        ("on_breach", lambda: None),  # Flask-Limiter answers 500 on each refusal
        ("deduct_when", lambda: True),
        ("settle", lambda: 1),
        ("key_func", lambda request: "x"),
        ("exempt_when", lambda request: False),
        ("cost", lambda response: 2),
    ],
)
def test_a_callable_option_that_cannot_take_its_arguments_is_refused_when_declared(
    option: str, wrong: Callable[..., Any]
) -> None:
    with pytest.raises(ConfigurationError, match=rf"{option}=.* is called with"):
        Limiter().limit("1/second", **{option: wrong})


def test_an_app_breach_hook_that_cannot_take_the_breach_is_refused_when_set() -> None:
    with pytest.raises(ConfigurationError, match=r"on_breach=.* is called with one argument"):
        Limiter(on_breach=lambda: None)
    with pytest.raises(ConfigurationError, match=r"on_breach=.* is called with one argument"):
        Limiter().on_breach(lambda: None)


@pytest.mark.parametrize(
    ("hook", "wrong"),
    [
        ("identity_loader", lambda user_id: (user_id, None)),  # Flask-Login's user_loader form
        ("api_key_verifier", lambda key, request: None),
        ("tier_resolver", lambda: "free"),
        ("request_filter", lambda request: True),
        ("priority_resolver", lambda request: None),
        ("identity_loader", 5),
    ],
)
def test_a_hook_that_cannot_take_its_arguments_is_refused_when_registered(
    hook: str, wrong: Any
) -> None:
    """Not on every request of the app: a 500 each (or, for a filter, never exempting)."""
    with pytest.raises(ConfigurationError, match=rf"{hook}=.* (is called with|is not callable)"):
        getattr(Limiter(), hook)(wrong)
    if hook == "request_filter":
        with pytest.raises(ConfigurationError, match=r"request_filter=.* is called with"):
            Limiter(request_filter=wrong)


def test_a_storage_url_or_a_clock_that_is_no_function_is_refused_by_the_constructor() -> None:
    with pytest.raises(TypeError, match="a URL goes in DISTLIMIT_STORAGE_URL"):
        Limiter(storage="memory://")  # type: ignore[arg-type]  # Flask-Limiter's storage_uri
    with pytest.raises(TypeError, match="clock= a function answering microseconds"):
        Limiter(clock=5)  # type: ignore[arg-type]


def test_a_scope_callable_that_cannot_take_the_endpoint_is_refused_when_declared() -> None:
    """Its first binding would fail every route of the app on its first request."""
    with pytest.raises(ConfigurationError, match=r"scope=.* is called with one argument"):
        Limiter().shared_limit("10/minute", scope=lambda: "search")


class _Hook:
    def __call__(self, breach: Breach) -> None:
        return None


@pytest.mark.parametrize(
    "hook",
    [lambda breach: None, lambda *args: None, functools.partial(lambda a, b: None, 1), _Hook()],
)
def test_a_breach_hook_that_takes_the_breach_is_accepted(hook: Callable[..., Any]) -> None:
    Limiter(on_breach=hook)
    Limiter().limit("1/second", on_breach=hook)


# -- 4. a key_func answering None -----------------------------------------------------------------


def test_a_key_func_answering_none_skips_the_limit(backend: Backend, clock: FakeClock) -> None:
    app, limiter, counting = make_app(backend(), clock)

    @app.get("/orders")
    @limiter.limit("1/minute", key_func=lambda: request.headers.get("X-Tenant"))
    def orders() -> str:
        return "ok"

    assert statuses(app, "/orders", 3) == [200, 200, 200]  # opted out: never counted
    assert counting.checks == []
    assert statuses(app, "/orders", 2, headers={"X-Tenant": "acme"}) == [200, 429]
    assert statuses(app, "/orders", 1, headers={"X-Tenant": ""}) == [200]


# -- 5. a Limiter never set up on the app ---------------------------------------------------------


@pytest.mark.parametrize(("on_failure", "expected"), [(None, 200), ("closed", 503)])
def test_limits_of_a_limiter_never_set_up_answer_by_policy_and_say_so(
    backend: Backend,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
    on_failure: str | None,
    expected: int,
) -> None:
    app, _, _ = make_app(backend(), clock)
    stray = Limiter(clock=clock)  # never init_app'd

    @app.get("/orders")
    @stray.limit("1/minute", on_failure=on_failure)
    def orders() -> str:
        return "ok"

    with caplog.at_level(logging.ERROR, logger="flask_distlimit"):
        assert statuses(app, "/orders", 3) == [expected] * 3
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1  # once per app and view
    assert "never set up" in errors[0] and "limiter.init_app(app)" in errors[0]


def test_an_app_with_no_limiter_at_all_is_never_a_500(clock: FakeClock) -> None:
    app = Flask("bare")
    stray = Limiter(clock=clock)

    @app.get("/orders")
    @stray.limit("1/minute")
    def orders() -> str:
        return "ok"

    @app.get("/inline")
    def inline() -> str:
        with stray.limit("1/minute"):
            return "ok"

    assert statuses(app, "/orders", 2) == [200, 200]
    assert statuses(app, "/inline", 2) == [200, 200]


# -- 6. the with form -----------------------------------------------------------------------------


def test_a_with_block_decides_its_limit_where_it_starts(backend: Backend, clock: FakeClock) -> None:
    app, limiter, _ = make_app(backend(), clock)
    reached: list[str] = []
    told: list[Breach] = []
    limiter.on_breach(told.append)

    @app.get("/report")
    def report() -> str:
        reached.append("before")
        with limiter.limit("2/minute"):
            reached.append("inside")
        return "ok"

    assert statuses(app, "/report", 3) == [200, 200, 429]
    assert reached == ["before", "inside", "before", "inside", "before"]
    refused = app.test_client().get("/report")
    assert refused.mimetype == "application/problem+json"
    assert refused.get_json()["violated-policies"] == ["report:2/minute"]
    assert len(told) == 2


def test_a_with_block_counts_only_the_methods_it_names(backend: Backend, clock: FakeClock) -> None:
    app, limiter, _ = make_app(backend(), clock)

    @app.route("/items", methods=["GET", "POST"])
    def items() -> str:
        with limiter.limit("1/minute", methods=["POST"]):
            return "ok"

    assert statuses(app, "/items", 3) == [200, 200, 200]
    client = app.test_client()
    assert [client.post("/items").status_code for _ in range(2)] == [200, 429]


def test_a_with_block_in_an_exempt_view_or_a_filtered_request_is_not_counted(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(backend(), clock)
    limiter.request_filter(lambda: request.headers.get("X-Internal") == "yes")

    @app.get("/health")
    @limiter.exempt
    def health() -> str:
        with limiter.limit("1/minute"):
            return "ok"

    @app.get("/report")
    def report() -> str:
        with limiter.shared_limit("1/minute", scope="reports"):
            return "ok"

    assert statuses(app, "/health", 2) == [200, 200]
    assert statuses(app, "/report", 2, headers={"X-Internal": "yes"}) == [200, 200]
    assert statuses(app, "/report", 2) == [200, 429]


def test_a_with_block_scoped_by_a_view_argument_counts_each_value_apart(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(backend(), clock)

    @app.get("/orders/<int:order>")
    def order(order: int) -> str:
        with limiter.limit("1/minute", scope=order):
            return "ok"

    assert statuses(app, "/orders/1", 2) == [200, 429]
    assert statuses(app, "/orders/2", 2) == [200, 429]


def test_a_handler_on_limiter_logger_hears_each_breach_once_a_window(
    backend: Backend, clock: FakeClock
) -> None:
    """Flask-Limiter's ``limiter.logger``: a handler added there hears the limiter's lines."""
    app, limiter, _ = make_app(backend(), clock)
    heard: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = heard.append  # type: ignore[method-assign]
    limiter.logger.addHandler(handler)
    level = limiter.logger.level
    limiter.logger.setLevel(logging.INFO)

    @app.get("/t1")
    @limiter.limit("1/minute")
    def t1() -> str:
        return "42"

    try:
        assert statuses(app, "/t1", 3) == [200, 429, 429]
    finally:
        limiter.logger.removeHandler(handler)
        limiter.logger.setLevel(level)
    assert limiter.logger is logging.getLogger("flask_distlimit")
    assert [r.getMessage().split(":")[0] for r in heard] == ["Rate limit exceeded"]


def test_limiter_enabled_false_switches_every_limit_off_until_it_is_true_again(
    backend: Backend, clock: FakeClock
) -> None:
    """Flask-Limiter's run-time switch, which a test suite flips: it did nothing here."""
    app, limiter, counting = make_app(backend(), clock, DISTLIMIT_GLOBAL_LIMITS="100/minute")

    @app.before_request
    def hook_limited() -> None:
        if request.path == "/hooked":
            with limiter.limit("1/minute"):
                pass

    @app.get("/one")
    @limiter.limit("1/minute")
    def one() -> str:
        return "ok"

    @app.get("/hooked")
    def hooked() -> str:
        return "ok"

    @app.get("/login")
    def login() -> str:
        with limiter.limit("5/minute", scope="login"):
            return str(limiter.clear("login"))  # nothing counted: nothing cleared, no error

    client = app.test_client()
    assert client.get("/one").status_code == 200
    assert client.get("/hooked").status_code == 200
    calls = counting.evaluations
    limiter.enabled = False
    assert client.get("/login").get_data(as_text=True) == "0"
    answers = [client.get(path) for path in ("/one", "/hooked", "/missing") for _ in range(3)]
    assert [r.status_code for r in answers] == [200] * 6 + [404] * 3
    assert not [h for r in answers for h, _ in r.headers if "ratelimit" in h.lower()]
    assert counting.evaluations == calls  # not even the global limit was asked
    limiter.enabled = True
    assert client.get("/one").status_code == 429
    assert client.get("/hooked").status_code == 429
