"""Limits land exactly where they are declared, and run after the app's own hooks (issue 9).

Each test is an app written the way Flask apps are written (class-based views with
``decorators=``, wrappers without ``functools.wraps``, view factories, renamed and nested
blueprints, hooks registered after ``init_app``), on memory, fakeredis and a real redis-server.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
from flask import Blueprint, Flask, abort, g, request
from flask.views import MethodView, View

from flask_distlimit import ConfigurationError, Limiter
from flask_distlimit.storage.base import Storage
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import QUIET, backend, clock, make_app

__all__ = ["backend", "clock"]  # fixtures used below

Backend = Callable[[], Storage]


def statuses(app: Flask, path: str, n: int, method: str = "GET", **kwargs: Any) -> list[int]:
    client = app.test_client()
    return [client.open(path, method=method, **kwargs).status_code for _ in range(n)]


# -- view identity ---------------------------------------------------------------------------


def test_methodview_decorators_limit_only_their_own_class(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(backend(), clock)

    class Login(MethodView):
        decorators: ClassVar[list[Callable[..., Any]]] = [limiter.limit("2/minute")]

        def get(self) -> str:
            return "login"

    class Catalogue(MethodView):
        def get(self) -> str:
            return "catalogue"

    app.add_url_rule("/login", view_func=Login.as_view("login"))
    app.add_url_rule("/catalogue", view_func=Catalogue.as_view("catalogue"))
    assert statuses(app, "/login", 3) == [200, 200, 429]
    assert statuses(app, "/catalogue", 5) == [200] * 5


def test_methodview_decorators_exempt_only_their_own_class(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_DEFAULT_LIMITS="2/minute")

    class Health(MethodView):
        decorators: ClassVar[list[Callable[..., Any]]] = [limiter.exempt]

        def get(self) -> str:
            return "ok"

    class Orders(MethodView):
        def get(self) -> str:
            return "orders"

    app.add_url_rule("/health", view_func=Health.as_view("health"))
    app.add_url_rule("/orders", view_func=Orders.as_view("orders"))
    health = app.test_client().get("/health")
    assert "X-RateLimit-Limit" not in health.headers
    assert statuses(app, "/health", 5) == [200] * 5
    assert statuses(app, "/orders", 3) == [200, 200, 429]


def test_a_limit_on_a_method_limits_that_method_only(backend: Backend, clock: FakeClock) -> None:
    app, limiter, counting = make_app(backend(), clock, DISTLIMIT_GLOBAL_LIMITS="100/minute")

    class Items(MethodView):
        def get(self) -> str:
            return "list"

        @limiter.limit("2/minute")
        def post(self) -> str:
            return "created"

    app.add_url_rule("/items", view_func=Items.as_view("items"))
    assert statuses(app, "/items", 3, method="POST") == [200, 200, 429]
    assert statuses(app, "/items", 5) == [200] * 5
    # The method's limit and the global limit: one storage call per request.
    assert counting.evaluations == 8
    assert {c.key.split("}:")[1].split("_")[0] for c in counting.checks[1]} == {"g", "r"}


def test_limits_on_two_methods_count_apart(backend: Backend, clock: FakeClock) -> None:
    app, limiter, _ = make_app(backend(), clock)

    class Items(MethodView):
        @limiter.limit("2/minute")
        def get(self) -> str:
            return "list"

        @limiter.limit("2/minute")
        def post(self) -> str:
            return "created"

    app.add_url_rule("/items", view_func=Items.as_view("items"))
    assert statuses(app, "/items", 2, method="POST") == [200, 200]
    assert statuses(app, "/items", 3) == [200, 200, 429]


def test_a_limit_on_a_view_class_follows_the_class_and_its_subclasses(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(backend(), clock)

    @limiter.limit("2/minute")
    class Report(View):
        def dispatch_request(self) -> str:
            return "report"

    class DetailedReport(Report):
        pass

    class Other(View):
        def dispatch_request(self) -> str:
            return "other"

    app.add_url_rule("/report", view_func=Report.as_view("report"))
    app.add_url_rule("/detailed", view_func=DetailedReport.as_view("detailed"))
    app.add_url_rule("/other", view_func=Other.as_view("other"))
    assert statuses(app, "/report", 3) == [200, 200, 429]
    assert statuses(app, "/detailed", 3) == [200, 200, 429]  # inherited, counted per endpoint
    assert statuses(app, "/other", 5) == [200] * 5


def _login_required(view: Callable[..., Any]) -> Callable[..., Any]:
    """An auth decorator as many apps write it: no functools.wraps."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if request.headers.get("X-User") is None:
            abort(401)
        return view(*args, **kwargs)

    return wrapper


def test_a_wrapper_without_wraps_neither_leaks_nor_loses_a_limit(
    backend: Backend, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    app, limiter, _ = make_app(backend(), clock)

    @app.get("/account", endpoint="account")
    @_login_required
    @limiter.limit("2/minute")
    def account() -> str:
        return "account"

    @app.get("/profile", endpoint="profile")
    @_login_required
    def profile() -> str:
        return "profile"

    user = {"headers": {"X-User": "alice"}}
    with caplog.at_level(logging.WARNING, logger="flask_distlimit"):
        assert statuses(app, "/account", 3, **user) == [200, 200, 429]
    assert statuses(app, "/profile", 5, **user) == [200] * 5
    # The first request named the limit it could not see before the view ran.
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "account" in warnings[0] and "functools.wraps" in warnings[0]


def test_a_decorator_with_wraps_over_a_limit_still_runs_and_counts_once(
    backend: Backend, clock: FakeClock
) -> None:
    """The gate calls the function under a limit wrapper directly once the route's plan decided
    its limits; a decorator above it with ``functools.wraps`` copies the wrapper's attributes,
    and must still run (it is not the wrapper)."""
    app, limiter, counting = make_app(backend(), clock)
    seen: list[str] = []

    def audited(view: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(view)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            seen.append(request.path)
            return view(*args, **kwargs)

        return wrapper

    @app.get("/audited")
    @audited
    @limiter.limit("2/minute")
    def audited_view() -> str:
        return "audited"

    @app.get("/plain")
    @limiter.limit("2/minute")
    def plain_view() -> str:
        return "plain"

    @app.get("/exempt")
    @limiter.exempt
    @audited
    @limiter.limit("2/minute")
    def exempt_view() -> str:
        return "exempt"

    assert statuses(app, "/audited", 3) == [200, 200, 429]
    assert seen == ["/audited", "/audited"]  # the decorator ran on each admitted request
    assert statuses(app, "/plain", 3) == [200, 200, 429]
    assert counting.evaluations == 6  # one storage call per request, never a second

    assert statuses(app, "/exempt", 3) == [200] * 3
    assert seen.count("/exempt") == 3  # exempt: the limits go, the decorator stays
    assert counting.evaluations == 6


def test_views_from_one_factory_keep_their_own_limits(backend: Backend, clock: FakeClock) -> None:
    app, limiter, _ = make_app(backend(), clock)

    def make_view(text: str) -> Callable[[], str]:
        return lambda: text

    app.add_url_rule("/a", "a", limiter.limit("2/minute")(make_view("a")))
    app.add_url_rule("/b", "b", make_view("b"))
    app.add_url_rule("/c", "c", limiter.exempt(make_view("c")))
    assert statuses(app, "/a", 3) == [200, 200, 429]
    assert statuses(app, "/b", 5) == [200] * 5
    assert statuses(app, "/c", 5) == [200] * 5


def test_a_view_under_two_endpoints_has_its_limits_under_each(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(backend(), clock)

    @limiter.limit("2/minute")
    def shared() -> str:
        return "ok"

    app.add_url_rule("/one", "one", shared)
    app.add_url_rule("/two", "two", shared)
    assert statuses(app, "/one", 3) == [200, 200, 429]
    assert statuses(app, "/two", 3) == [200, 200, 429]  # counted per endpoint


# -- blueprints by object ----------------------------------------------------------------------


def test_a_renamed_and_twice_registered_blueprint_keeps_its_limits(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(backend(), clock)
    api = Blueprint("api", __name__)

    @api.get("/things")
    def things() -> str:
        return "things"

    limiter.limit("2/minute")(api)
    app.register_blueprint(api, name="api_v1", url_prefix="/v1")
    app.register_blueprint(api, name="api_v2", url_prefix="/v2")
    assert statuses(app, "/v1/things", 3) == [200, 200, 429]
    assert statuses(app, "/v2/things", 3) == [200, 200, 429]


def test_exempting_a_nested_blueprint_exempts_it_and_its_children_only(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_DEFAULT_LIMITS="2/minute")
    v1 = Blueprint("v1", __name__)
    nested_api = Blueprint("api", __name__)
    child = Blueprint("child", __name__)
    other_api = Blueprint("api", __name__)  # another blueprint that happens to share the name

    @nested_api.get("/x")
    def nested_x() -> str:
        return "nested"

    @child.get("/y")
    def child_y() -> str:
        return "child"

    @other_api.get("/z")
    def other_z() -> str:
        return "other"

    nested_api.register_blueprint(child, url_prefix="/child")
    v1.register_blueprint(nested_api, url_prefix="/api")
    limiter.exempt(nested_api)
    app.register_blueprint(v1, url_prefix="/v1")
    app.register_blueprint(other_api, url_prefix="/api")
    assert statuses(app, "/v1/api/x", 4) == [200] * 4
    assert statuses(app, "/v1/api/child/y", 4) == [200] * 4
    assert statuses(app, "/api/z", 3) == [200, 200, 429]


# -- hooks in any order ------------------------------------------------------------------------


def test_key_func_cost_and_exempt_when_see_hooks_registered_after_init_app(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, counting = make_app(backend(), clock, DISTLIMIT_GLOBAL_LIMITS="100/minute")
    bp = Blueprint("orders", __name__)

    @bp.get("/orders")
    @limiter.limit(
        "4/minute",
        key_func=lambda: g.tenant_id,
        cost=lambda: g.weight,
        exempt_when=lambda: g.is_admin,
    )
    def orders() -> str:
        return "orders"

    @app.before_request  # app level, after init_app: the usual order in an app factory
    def load_tenant() -> None:
        g.tenant_id = request.headers.get("X-Tenant", "none")
        g.is_admin = request.headers.get("X-Admin") == "1"

    @bp.before_request  # blueprint level
    def load_weight() -> None:
        g.weight = int(request.headers.get("X-Weight", "1"))

    app.register_blueprint(bp)
    acme = {"headers": {"X-Tenant": "acme", "X-Weight": "2"}}
    assert statuses(app, "/orders", 3, **acme) == [200, 200, 429]
    assert statuses(app, "/orders", 5, headers={"X-Tenant": "globex"}) == [200] * 4 + [429]
    admin = {"headers": {"X-Tenant": "acme", "X-Admin": "1"}}
    assert statuses(app, "/orders", 3, **admin) == [200] * 3
    assert counting.evaluations == 11  # one storage call per request: global and route together


def test_the_identity_loader_sees_a_blueprint_hook_registered_after_init_app(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(
        backend(), clock, DISTLIMIT_TIERS={"anonymous": "100/minute", "pro": "2/minute"}
    )
    bp = Blueprint("api", __name__)

    @limiter.identity_loader
    def user() -> tuple[str, str | None] | None:
        return (g.user, "pro") if g.get("user") else None

    @bp.get("/me")
    def me() -> str:
        return "me"

    @bp.before_request
    def authenticate() -> None:
        g.user = request.headers.get("X-User")

    app.register_blueprint(bp)
    assert statuses(app, "/me", 3, headers={"X-User": "alice"}) == [200, 200, 429]
    assert statuses(app, "/me", 2, headers={"X-User": "bob"}) == [200, 200]


def test_a_request_a_hook_answers_still_meets_the_global_limit(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_GLOBAL_LIMITS="3/minute")

    @app.get("/private")
    @limiter.limit("100/minute", key_func=lambda: g.user)
    def private() -> str:
        return "private"

    @app.get("/health")
    @limiter.exempt
    def health() -> str:
        return "ok"

    @app.before_request
    def authenticate() -> Any:
        if request.endpoint != "health" and "X-User" not in request.headers:
            return "who are you?", 401  # answered before the view: no g.user
        g.user = request.headers.get("X-User")
        return None

    # Credential stuffing is counted: the 401s spend the per-IP budget, then the 429 comes.
    assert statuses(app, "/private", 4) == [401, 401, 401, 429]
    assert statuses(app, "/nowhere", 1) == [429]  # a 404 is counted as well
    assert statuses(app, "/health", 3) == [200] * 3  # exempt, whatever answers


def test_a_request_a_blueprints_hook_answers_meets_its_blueprint_and_default_limits(
    backend: Backend, clock: FakeClock
) -> None:
    """Flask-Limiter checks those in a hook of its own that runs first: guessing API keys
    against an auth hook meets them (a limit declared on the view is decided at the view, there
    too)."""
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_DEFAULT_LIMITS="4/minute")
    api, open_ = Blueprint("api", __name__), Blueprint("open", __name__)
    limiter.limit("2/minute")(api)

    @api.before_request
    def check_key() -> Any:
        return None if request.headers.get("X-Api-Key") == "good" else ("bad key", 401)

    api.get("/api/items")(lambda: "items")

    @open_.before_request
    def deny() -> Any:
        return "no", 403

    open_.get("/open")(lambda: "open")
    app.register_blueprint(api)
    app.register_blueprint(open_)
    assert statuses(app, "/api/items", 3) == [401, 401, 429]  # the blueprint's 2/minute
    assert statuses(app, "/open", 5) == [403] * 4 + [429]  # the default 4/minute


def test_a_route_without_limits_costs_nothing_after_its_view(
    backend: Backend, clock: FakeClock
) -> None:
    """No limit of every request: a route with none runs its view, and after it the limiter
    asks no request filter and counts nothing (it cannot tell it from a hook's answer by the
    missing request data alone: the route's plan says there is nothing to count)."""
    app, limiter, counting = make_app(backend(), clock)
    asked: list[str] = []
    limiter.request_filter(lambda: asked.append(request.path) or False)
    app.get("/free", endpoint="free")(lambda: "free")
    app.get("/paid", endpoint="paid")(limiter.limit("1/minute")(lambda: "paid"))
    client = app.test_client()
    responses = [client.get("/free") for _ in range(3)]
    assert [r.status_code for r in responses] == [200] * 3
    assert asked == [] and counting.evaluations == 0
    assert not any("RateLimit-Policy" in r.headers for r in responses)


# -- nothing implicit --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_an_app_with_only_a_storage_url_limits_nothing(
    kind: str, request: pytest.FixtureRequest
) -> None:
    url = "memory://"
    if kind == "redis":
        client = request.getfixturevalue("redis_client")
        kwargs = client.connection_pool.connection_kwargs
        url = f"redis://{kwargs['host']}:{kwargs['port']}/0"
    app = Flask(__name__)
    app.config["DISTLIMIT_STORAGE_URL"] = url
    Limiter(app)

    @app.get("/open")
    def open_route() -> str:
        return "ok"

    client = app.test_client()
    answers = [client.get("/open") for _ in range(1000)]
    assert {r.status_code for r in answers} == {200}
    assert not any("X-RateLimit-Limit" in r.headers for r in answers)
    assert client.get("/missing").status_code == 404


def test_a_route_limit_is_not_capped_by_a_hidden_tier(backend: Backend, clock: FakeClock) -> None:
    app = Flask(__name__)
    limiter = Limiter(app, storage=backend(), clock=clock)

    @app.get("/search")
    @limiter.limit("100/minute")
    def search() -> str:
        return "ok"

    assert statuses(app, "/search", 101) == [200] * 100 + [429]


# -- declaration closes ------------------------------------------------------------------------


def test_declaring_on_what_an_app_serves_after_its_first_request_raises(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(backend(), clock)
    bp = Blueprint("api", __name__)

    def index() -> str:
        return "ok"

    @bp.get("/things")
    def things() -> str:
        return "things"

    class Page(MethodView):
        def get(self) -> str:
            return "page"

    app.add_url_rule("/", "index", index)
    app.add_url_rule("/page", view_func=Page.as_view("page"))
    app.register_blueprint(bp)
    assert app.test_client().get("/").status_code == 200
    for target in (index, bp, Page, Page.get):
        with pytest.raises(ConfigurationError, match="first request"):
            limiter.limit("1/minute")(target)
        with pytest.raises(ConfigurationError, match="first request"):
            limiter.exempt(target)
    assert statuses(app, "/", 3) == [200] * 3  # nothing changed
    # A function no app serves may still be declared: e.g. for the next app of a factory.
    fresh = limiter.limit("1/minute")(lambda: "fresh")
    assert callable(fresh)


def test_the_first_request_warns_once_about_limits_that_match_no_endpoint(
    backend: Backend, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    app, limiter, _ = make_app(backend(), clock)
    unused_bp = Blueprint("unused", __name__)
    limiter.limit("5/minute")(unused_bp)

    @limiter.limit("3/minute")
    def never_routed() -> str:
        return "x"

    app.add_url_rule("/", "index", lambda: "ok")
    with caplog.at_level(logging.WARNING, logger="flask_distlimit"):
        statuses(app, "/", 3)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "never_routed" in warnings[0] and "'unused'" in warnings[0]
    assert "3/minute" in warnings[0] and "5/minute" in warnings[0]


def test_an_app_factory_s_later_apps_do_not_warn_of_the_earlier_apps_views(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """One Limiter, an app factory defining its views inside: each app after the first warned
    that the views of the apps made before it matched none of its endpoints."""
    limiter = Limiter(clock=clock)

    def create_app(typo: bool = False) -> Flask:
        app = Flask("factory")
        app.config.update(QUIET, DISTLIMIT_STORAGE_URL="memory://")

        @app.get("/ping")
        @limiter.limit("5/minute")
        def ping() -> str:
            return "pong"

        if typo:  # a limit on a view this app never routes: still named

            @limiter.limit("1/minute")
            def never_routed() -> str:
                return "x"

        limiter.init_app(app)
        return app

    apps = []
    with caplog.at_level(logging.WARNING, logger="flask_distlimit"):
        for typo in (False, False, True, False):
            apps.append(create_app(typo))
            assert apps[-1].test_client().get("/ping").status_code == 200
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "never_routed" in warnings[0] and "ping" not in warnings[0]


def test_the_first_request_warns_about_a_limit_whose_methods_its_route_never_takes(
    backend: Backend, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """``methods=["PSOT"]`` left the route's POST unlimited without a word; a view on two
    endpoints is judged on the methods of both."""
    app, limiter, _ = make_app(backend(), clock)

    @app.post("/login")
    @limiter.limit("3/minute", methods=["PSOT"])
    def login() -> str:
        return "ok"

    @limiter.limit("2/minute", methods=["POST"])
    def both() -> str:
        return "ok"

    app.add_url_rule("/read", "read", both, methods=["GET"])
    app.add_url_rule("/write", "write", both, methods=["POST"])
    with caplog.at_level(logging.WARNING, logger="flask_distlimit"):
        assert [app.test_client().post("/login").status_code for _ in range(4)] == [200] * 4
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "3/minute" in warnings[0] and "['PSOT']" in warnings[0]
    assert "2/minute" not in warnings[0]


def test_a_declaration_that_cannot_be_a_view_is_refused() -> None:
    limiter = Limiter()
    with pytest.raises(ConfigurationError, match="view function"):
        limiter.limit("1/minute")(42)
    with pytest.raises(ConfigurationError, match="not callable"):
        limiter.limit("1/minute", key_func="tenant")  # type: ignore[arg-type]


def test_one_storage_call_for_class_method_and_global_limits(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, counting = make_app(backend(), clock, DISTLIMIT_GLOBAL_LIMITS="100/minute")

    @limiter.limit("10/minute")
    class Items(MethodView):
        decorators: ClassVar[list[Callable[..., Any]]] = [limiter.limit("20/minute")]

        @limiter.limit("5/minute")
        def get(self) -> str:
            return "ok"

    app.add_url_rule("/items", view_func=Items.as_view("items"))
    assert statuses(app, "/items", 6) == [200] * 5 + [429]
    assert counting.evaluations == 6
    assert len(counting.checks[0]) == 4  # global, class, decorators=, method


def test_async_views_are_limited_after_the_hooks(backend: Backend, clock: FakeClock) -> None:
    app, limiter, counting = make_app(backend(), clock, DISTLIMIT_GLOBAL_LIMITS="100/minute")

    @app.get("/async")
    @limiter.limit("2/minute", key_func=lambda: g.tenant_id)
    async def async_view() -> str:
        return "async"

    @app.get("/plain-async")
    async def plain_async() -> str:
        return "plain"

    @app.before_request
    def load_tenant() -> None:
        g.tenant_id = request.headers.get("X-Tenant", "none")

    assert statuses(app, "/async", 3, headers={"X-Tenant": "acme"}) == [200, 200, 429]
    assert app.test_client().get("/plain-async").get_data(as_text=True) == "plain"
    assert counting.evaluations == 4  # global with the route limit, in one call per request


def test_a_limit_above_the_route_decorator_still_applies(
    backend: Backend, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """``@app.route`` registers the function before ``@limiter.limit`` wraps it: the limit
    attaches to that function all the same, in the route's one storage call."""
    app, limiter, counting = make_app(backend(), clock, DISTLIMIT_GLOBAL_LIMITS="100/minute")

    @limiter.limit("2/minute")
    @app.get("/reversed")
    def reversed_order() -> str:
        return "ok"

    with caplog.at_level(logging.WARNING, logger="flask_distlimit"):
        assert statuses(app, "/reversed", 3) == [200, 200, 429]
    assert counting.evaluations == 3
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_route_that_would_carry_too_many_limits_fails_at_the_first_request(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, counting = make_app(
        backend(), clock, DISTLIMIT_GLOBAL_LIMITS="100/second;1000/minute;10000/hour"
    )

    @limiter.limit("10/second;100/minute;1000/hour")
    class Items(MethodView):
        @limiter.limit("5/second;50/minute;500/hour")
        def get(self) -> str:
            return "ok"

    app.add_url_rule("/items", view_func=Items.as_view("items"))
    app.testing = True
    for _ in range(2):  # it stays refused: nothing is half set up
        with pytest.raises(ConfigurationError, match=r"'items' \(GET\).*9 limits"):
            app.test_client().get("/items")
    assert counting.evaluations == 0


def test_two_key_func_limits_of_one_rate_count_apart(backend: Backend, clock: FakeClock) -> None:
    """A per-tenant and a per-user limit of the same rate on one view: tenant ``x`` and user
    ``x`` are different clients and never share a count."""
    app, limiter, _ = make_app(backend(), clock)

    @app.get("/orders")
    @limiter.limit("2/minute", key_func=lambda: request.args["tenant"])
    @limiter.limit("2/minute", key_func=lambda: request.args["user"])
    def orders() -> str:
        return "ok"

    client = app.test_client()
    assert client.get("/orders?tenant=x&user=y").status_code == 200
    assert client.get("/orders?tenant=y&user=x").status_code == 200
    # tenant x: 1 of 2 spent; user z: none. Sharing keys, tenant x would meet user x's count.
    assert client.get("/orders?tenant=x&user=z").status_code == 200
    assert client.get("/orders?tenant=x&user=w").status_code == 429  # tenant x: 2 of 2


def test_a_limit_keeps_one_key_on_every_method_beside_a_methods_filter_of_its_rate(
    backend: Backend, clock: FakeClock
) -> None:
    """A limit of every method beside one of the same rate for POST only (a login form's
    failures): each limit's ``:k<n>`` was its place among the limits of the request's method,
    so the limit of every method counted POSTs and GETs on two keys (4 admitted of 2), and two
    ``key_func`` limits swapped keys between methods (an account met an e-mail's count)."""
    app, limiter, _ = make_app(backend(), clock)

    @app.route("/item", methods=["GET", "POST"])
    @limiter.limit("2/minute")
    @limiter.limit("2/minute", methods=["POST"], deduct_when=lambda r: r.status_code >= 400)
    def item() -> str:
        return "ok"

    @app.route("/signin", methods=["GET", "POST"])
    @limiter.limit("2/minute", key_func=lambda: request.values["account"])
    @limiter.limit("2/minute", key_func=lambda: request.values["email"], methods=["POST"])
    def signin() -> str:
        return "ok"

    client = app.test_client()
    assert [client.open("/item", method=m).status_code for m in ("POST", "POST", "GET")] == [
        200, 200, 429,
    ]  # fmt: skip
    signin_get = [client.get("/signin?account=v@x.org").status_code for _ in range(2)]
    post = client.post("/signin", data={"account": "a1", "email": "v@x.org"}).status_code
    assert (signin_get, post) == ([200, 200], 200)  # account v@x.org spent: e-mail v@x.org not
    eve = [client.get("/signin?account=eve").status_code for _ in range(2)]
    eve += [
        client.post("/signin", data={"account": "eve", "email": f"e{n}"}).status_code
        for n in range(2)
    ]
    assert eve == [200, 200, 429, 429]


def test_two_limits_of_one_rate_on_a_route_have_two_policy_names(
    backend: Backend, clock: FakeClock
) -> None:
    """Two counters of one rate on a route were one name in ``RateLimit-Policy`` (one item for
    two quotas), in ``RateLimit`` and in the CLI: the second is ``<name>:k2``, as its key."""
    app, limiter, _ = make_app(backend(), clock)

    @app.route("/m", methods=["GET", "POST"])
    @limiter.limit("3/minute")
    @limiter.limit("3/minute", methods=["POST"], cost=2)
    def m() -> str:
        return "ok"

    policy = app.test_client().post("/m").headers["RateLimit-Policy"]
    assert policy == '"m:3/minute";q=3;w=60, "m:3/minute:k2";q=3;w=60'


def test_limits_below_another_decorator_and_in_a_block_are_numbered_with_the_route(
    backend: Backend, clock: FakeClock
) -> None:
    """A limit wrapper below another decorator, and a ``with`` block, are decided in calls of
    their own, and were numbered apart from the route's limits: below ``@login_required`` the
    method bug came back (4 of a per-account 2), and a block's ``key_func`` limit shared the
    key of the route's limit of its rate (user ``x`` spent e-mail ``x``'s count)."""
    app, limiter, _ = make_app(backend(), clock)

    def audited(view: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(view)
        def inner(*args: Any, **kwargs: Any) -> Any:
            return view(*args, **kwargs)

        return inner

    @app.route("/signin", methods=["GET", "POST"])
    @audited
    @limiter.limit("2/minute", key_func=lambda: request.values["account"])
    @limiter.limit("2/minute", key_func=lambda: request.values["email"], methods=["POST"])
    def signin() -> str:
        return "ok"

    @app.post("/with")
    @limiter.limit("3/minute", key_func=lambda: request.form["user"])
    def with_block() -> str:
        with limiter.limit("3/minute", key_func=lambda: request.form["email"]):
            return "ok"

    client = app.test_client()
    eve = [client.get("/signin?account=eve").status_code for _ in range(2)]
    eve += [
        client.post("/signin", data={"account": "eve", "email": f"e{n}"}).status_code
        for n in range(2)
    ]
    assert eve == [200, 200, 429, 429]
    users = [
        client.post("/with", data={"user": "x", "email": f"x{n}"}).status_code for n in range(3)
    ]
    assert users == [200, 200, 200]
    assert client.post("/with", data={"user": "other", "email": "x"}).status_code == 200


def test_a_shared_limit_keeps_one_key_on_every_route_whatever_the_order_of_the_decorators(
    backend: Backend, clock: FakeClock
) -> None:
    """Two shared limits of one scope and rate, keyed on the user and on the e-mail, stacked in
    opposite orders on two routes: the per-user limit counted on two keys (4 of 2 admitted).
    The scope is the counter, as in Flask-Limiter: one per value, whichever function answered
    it (user bob's and e-mail bob's are one; scopes of their own count them apart)."""
    app, limiter, _ = make_app(backend(), clock)
    by_user = limiter.shared_limit("2/minute", scope="auth", key_func=lambda: request.form["user"])
    by_mail = limiter.shared_limit("2/minute", scope="auth", key_func=lambda: request.form["mail"])

    @app.post("/login")
    @by_user
    @by_mail
    def login() -> str:
        return "ok"

    @app.post("/reset")
    @by_mail
    @by_user
    def reset() -> str:
        return "ok"

    client = app.test_client()

    def post(path: str, user: str, mail: str) -> int:
        return client.post(path, data={"user": user, "mail": mail}).status_code

    alice = [post(path, "alice", f"m{n}") for n, path in enumerate(["/login", "/reset"] * 2)]
    assert alice == [200, 200, 429, 429]
    assert [post("/login", "bob", "q1"), post("/login", "bob", "q2")] == [200, 200]
    assert post("/reset", "z9", "bob") == 429  # the scope's count of the value bob


def test_limits_of_a_long_endpoint_never_share_a_key(backend: Backend, clock: FakeClock) -> None:
    """A key holds at most 200 characters of its limit's id, cut from the end, where the rate
    (and a second key_func limit's ``:k2``) is: on an endpoint of about 200 characters,
    ``2/minute`` and ``100/hour`` had one key, the request kept the first check of a key, and
    ``2/minute`` never applied; tenant ``y`` met user ``y``'s count. A long id is cut with a
    digest of the whole now, so that every limit keeps a key of its own, of bounded length."""
    app, limiter, counting = make_app(backend(), clock)
    long = "reports." + "monthly_revenue_by_region_" * 8  # a nested blueprint's endpoint

    def report() -> str:
        return "ok"

    def orders() -> str:
        return "ok"

    app.add_url_rule("/r", long, limiter.limit("2/minute")(limiter.limit("100/hour")(report)))
    per_tenant = limiter.limit("2/minute", key_func=lambda: request.args["tenant"])
    per_user = limiter.limit("2/minute", key_func=lambda: request.args["user"])
    app.add_url_rule("/o", long + "_orders", per_tenant(per_user(orders)))
    assert statuses(app, "/r", 3) == [200, 200, 429]  # before: 200 three times
    client = app.test_client()
    orders = ["tenant=x&user=y", "tenant=y&user=z", "tenant=y&user=w"]
    assert [client.get(f"/o?{q}").status_code for q in orders] == [200] * 3  # before: 429 last
    keys = {c.key for checks in counting.checks for c in checks}
    assert len(keys) == 2 + 5, keys  # tenants x and y, users y, z and w
    assert max(map(len, keys)) <= len(limiter.state(app).settings.key_prefix) + 250


def test_two_limits_of_one_rate_and_other_options_both_apply(
    backend: Backend, clock: FakeClock
) -> None:
    """A limit of every attempt beside a ``deduct_when`` one of failed attempts, both
    ``3/minute``: both apply, each on its own key (the second was taken for a repeat of the
    first and dropped, so successful logins went unlimited). An exact repeat is still one."""
    app, limiter, counting = make_app(backend(), clock)
    failing = {"yes": False}

    @app.post("/login")
    @limiter.limit("3/minute")  # every attempt
    @limiter.limit("3/minute", deduct_when=lambda response: response.status_code == 401)
    def login() -> tuple[str, int]:
        return ("no", 401) if failing["yes"] else ("ok", 200)

    @app.get("/report")
    @limiter.limit("5/minute")
    @limiter.limit("5/minute", exempt_when=lambda: request.args.get("internal") == "1")
    def report() -> str:
        return "ok"

    @app.get("/twice")
    @limiter.limit("2/minute")
    @limiter.limit("2/minute")  # a repeat: one limit, counted once
    def twice() -> str:
        return "ok"

    assert statuses(app, "/login", 4, method="POST") == [200, 200, 200, 429]
    assert statuses(app, "/report?internal=1", 6) == [200] * 5 + [429]
    assert statuses(app, "/twice", 3) == [200, 200, 429]
    keys = {c.key for calls in counting.checks for c in calls if "login" in c.key}
    assert len(keys) == 2
