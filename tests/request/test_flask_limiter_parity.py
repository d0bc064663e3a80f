"""What a team moving from Flask-Limiter meets on the wire and in its error handlers (issue 33,
items 10-12): the behaviour adopted from Flask-Limiter, and the differences the migration guide
names, each pinned here on memory://, fakeredis and a real redis-server."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
from flask import Blueprint, Flask, request
from werkzeug.exceptions import TooManyRequests

from flask_distlimit import ExemptionScope, Limiter
from flask_distlimit.errors import ConfigurationError
from flask_distlimit.storage.base import Storage
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import backend, clock, make_app

__all__ = ["backend", "clock"]

Backend = Callable[[], Storage]


def app_with(backend: Backend, clock: FakeClock, **config: Any) -> tuple[Flask, Limiter]:
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_ALGORITHM="sliding_window_log", **config)
    return app, limiter


def described(app: Flask) -> list[str]:
    """What ``e.description`` said in the app's ``errorhandler(429)``, per refusal."""
    said: list[str] = []

    @app.errorhandler(429)
    def too_many(e: TooManyRequests) -> tuple[str, int]:
        said.append(str(e.description))
        return "slow down", 429

    return said


# -- item 12: e.description is Flask-Limiter's -------------------------------------------------


def test_the_description_is_the_refused_rate_as_flask_limiter_words_it(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter = app_with(backend, clock, DISTLIMIT_DEFAULT_LIMITS="1/day")
    said = described(app)

    @app.get("/default")
    def default() -> str:
        return "ok"

    @app.get("/half-minute")
    @limiter.limit("1/30 seconds;100/hour")
    def half_minute() -> str:
        return "ok"

    client = app.test_client()
    for path in ["/default", "/half-minute"]:
        assert client.get(path).status_code == 200
        assert client.get(path).status_code == 429
    assert said == ["1 per 1 day", "1 per 30 second"]


def test_e_limit_limit_is_the_rate_that_refused(backend: Backend, clock: FakeClock) -> None:
    """Flask-Limiter's handlers read ``e.limit.limit`` (``jsonify(limit=str(e.limit.limit))``):
    an ``AttributeError`` there made every 429 a 500."""
    app, limiter = app_with(backend, clock)

    @app.errorhandler(429)
    def too_many(e: Any) -> tuple[dict[str, object], int]:
        return {"limit": str(e.limit.limit), "amount": e.limit.limit.amount}, 429

    @app.get("/search")
    @limiter.limit("1/hour")
    def search() -> str:
        return "ok"

    client = app.test_client()
    client.get("/search")
    refused = client.get("/search")
    assert (refused.status_code, refused.json) == (429, {"limit": "1/hour", "amount": 1})


def test_the_description_is_the_error_message_when_the_limit_has_one(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter = app_with(backend, clock)
    said = described(app)

    @app.get("/search")
    @limiter.limit("1/hour", error_message=lambda: f"Slow down, {request.args['who']}")
    def search() -> str:
        return "ok"

    client = app.test_client()
    client.get("/search?who=ada")
    assert client.get("/search?who=ada").status_code == 429
    assert said == ["Slow down, ada"]


def test_the_problem_body_keeps_its_detail_beside_the_description(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter = app_with(backend, clock)

    @app.get("/search")
    @limiter.limit("1/hour")
    def search() -> str:
        return "ok"

    client = app.test_client()
    client.get("/search")
    body = client.get("/search").get_json()
    # Flask-Limiter's body says "1 per 1 hour"; ours names the policy, then the same words
    assert body["detail"].startswith("Rate limit search:1/hour (1 per 1 hour): retry in ")
    assert body["violated-policies"] == ["search:1/hour"]


# -- item 10: Retry-After is a refusal's header ------------------------------------------------


def test_an_admitted_response_carries_no_retry_after(backend: Backend, clock: FakeClock) -> None:
    app, limiter = app_with(backend, clock, DISTLIMIT_HEADERS="both")

    @app.get("/search")
    @limiter.limit("5/hour")
    def search() -> str:
        return "ok"

    response = app.test_client().get("/search")
    assert response.status_code == 200
    assert response.headers["X-RateLimit-Remaining"] == "4"
    assert "Retry-After" not in response.headers


def test_a_views_own_retry_after_is_left_as_the_view_wrote_it(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter = app_with(backend, clock)
    when = "Wed, 21 Oct 2037 07:28:00 GMT"

    @app.get("/maintenance")
    @limiter.limit("5/hour")
    def maintenance() -> tuple[str, int, dict[str, str]]:
        return "back soon", 503, {"Retry-After": when}

    response = app.test_client().get("/maintenance")
    assert response.status_code == 503
    assert response.headers.getlist("Retry-After") == [when]


def test_a_refusal_carries_retry_after_even_with_the_headers_off(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter = app_with(backend, clock, DISTLIMIT_HEADERS="none")

    @app.get("/search")
    @limiter.limit("1/hour")
    def search() -> str:
        return "ok"

    client = app.test_client()
    admitted = client.get("/search")
    assert "X-RateLimit-Limit" not in admitted.headers
    refused = client.get("/search")
    assert refused.status_code == 429
    assert 3590 <= int(refused.headers["Retry-After"]) <= 3600
    assert "X-RateLimit-Limit" not in refused.headers


# -- item 11: the headers say what the admission decided ---------------------------------------


def test_remaining_is_the_admissions_figure_not_recounted_after_the_view(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter = app_with(backend, clock)

    @app.get("/report")
    @limiter.limit("5/hour")
    def report() -> str:
        if "inner" not in request.args:  # another request of the client, while this one runs
            inner = app.test_client().get("/report?inner=1")
            assert inner.headers["X-RateLimit-Remaining"] == "3"
        return "ok"

    response = app.test_client().get("/report")
    assert response.status_code == 200
    assert response.headers["X-RateLimit-Remaining"] == "4"  # Flask-Limiter would say 3


# -- item 14: default limits with options ------------------------------------------------------


def test_a_default_limit_declared_on_the_app_takes_exempt_when_and_cost(
    backend: Backend, clock: FakeClock
) -> None:
    """``default_limits_exempt_when`` / ``default_limits_cost``, ported as a limit declared on
    the app: its exemption lifts the default limit only, never the route's own limit (which
    ``request_filter`` would also lift)."""
    app, limiter = app_with(backend, clock)
    internal = lambda: request.headers.get("X-Internal") == "1"  # noqa: E731
    limiter.limit("4/hour", exempt_when=internal, cost=lambda: 2)(app)

    @app.get("/default")
    def default() -> str:
        return "ok"

    @app.get("/own")
    @limiter.limit("3/hour")
    def own() -> str:
        return "ok"

    client = app.test_client()
    # the default costs 2: two requests spend it
    assert [client.get("/default").status_code for _ in range(3)] == [200, 200, 429]
    # exempt from the default limit, not from limits at all
    assert [client.get("/default", headers={"X-Internal": "1"}).status_code] == [200]
    # a route with limits of its own does not meet the default; exempt_when does not lift them
    codes = [client.get("/own", headers={"X-Internal": "1"}).status_code for _ in range(4)]
    assert codes == [200, 200, 200, 429]


def test_a_default_limit_declared_on_the_app_can_count_only_some_responses(
    backend: Backend, clock: FakeClock
) -> None:
    """``default_limits_deduct_when``, ported as a limit declared on the app."""
    app, limiter = app_with(backend, clock)
    limiter.limit("2/hour", deduct_when=lambda r: r.status_code >= 400)(app)

    @app.get("/item/<int:n>")
    def item(n: int) -> tuple[str, int]:
        return "ok", 200 if n else 404

    client = app.test_client()
    assert [client.get("/item/1").status_code for _ in range(3)] == [200, 200, 200]
    assert [client.get("/item/0").status_code for _ in range(3)] == [404, 404, 429]


def test_default_limits_per_method_port_as_a_default_limit_declared_per_method(
    backend: Backend, clock: FakeClock
) -> None:
    """``default_limits_per_method``, ported as a limit declared on the app with
    ``per_method=True``: each method has its own counter, beside a route's own limit that
    says ``override_defaults=False`` (for GET only)."""
    app, limiter = app_with(backend, clock)
    limiter.limit("2/minute", per_method=True)(app)

    @app.route("/", methods=["GET", "PUT"])
    @limiter.limit("1/second", override_defaults=False, methods=["GET"])
    def root() -> str:
        return "root"

    client = app.test_client()
    assert [client.get("/").status_code for _ in range(2)] == [200, 429]
    assert [client.put("/").status_code for _ in range(3)] == [200, 200, 429]
    clock.advance(1)
    assert [client.get("/").status_code for _ in range(2)] == [200, 429]  # GET's 2/minute
    clock.advance(1)
    assert client.get("/").status_code == 429


def test_a_limit_declared_on_the_app_after_it_served_is_refused(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter = app_with(backend, clock)

    @app.get("/")
    def index() -> str:
        return "ok"

    app.test_client().get("/")
    with pytest.raises(ConfigurationError, match=r"app .app. .* served its first request"):
        limiter.limit("1/hour")(app)


# -- exempt(flags=ExemptionScope...): an exemption in part ---------------------------------------


def test_a_route_exempt_from_the_global_limits_only_keeps_the_defaults(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter = app_with(
        backend, clock, DISTLIMIT_DEFAULT_LIMITS="1/minute", DISTLIMIT_GLOBAL_LIMITS="2/minute"
    )

    @app.get("/health")
    @limiter.exempt(flags=ExemptionScope.APPLICATION)
    def health() -> str:
        return "ok"

    @app.get("/other")
    def other() -> str:
        return "ok"

    client = app.test_client()
    assert client.get("/health").status_code == 200
    assert client.get("/health").status_code == 429  # the default limit
    assert client.get("/other").status_code == 200  # the global limit never counted /health
    assert client.get("/other").status_code == 429  # the default limit of /other


def test_a_route_exempt_from_the_defaults_only_keeps_the_global_and_its_own_limits(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter = app_with(
        backend, clock, DISTLIMIT_DEFAULT_LIMITS="1/minute", DISTLIMIT_GLOBAL_LIMITS="3/minute"
    )

    @app.get("/free")
    @limiter.exempt(flags=ExemptionScope.DEFAULT)
    def free() -> str:
        return "ok"

    @app.get("/own")
    @limiter.limit("2/minute", override_defaults=False)
    @limiter.exempt(flags=ExemptionScope.DEFAULT)
    def own() -> str:
        return "ok"

    client = app.test_client()
    assert client.get("/own").status_code == 200
    assert client.get("/own").status_code == 200  # no default limit beside its own
    assert client.get("/own").status_code == 429  # its own 2/minute
    assert client.get("/free").status_code == 200  # the global limit: 3 counted so far
    assert client.get("/free").status_code == 429  # the global limit, not a default


def test_a_blueprint_exemption_in_part_reaches_nested_blueprints_only_when_asked(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter = app_with(backend, clock, DISTLIMIT_DEFAULT_LIMITS="1/minute")
    parent, child = Blueprint("parent", __name__), Blueprint("child", __name__)
    other, nested = Blueprint("other", __name__), Blueprint("nested", __name__)
    limiter.exempt(parent, flags=ExemptionScope.DEFAULT | ExemptionScope.DESCENDENTS)
    limiter.exempt(other, flags=ExemptionScope.DEFAULT)
    for bp, rule in ((parent, "/p"), (child, "/c"), (other, "/o"), (nested, "/n")):
        bp.add_url_rule(rule, view_func=lambda: "ok")
    parent.register_blueprint(child, url_prefix="/parent")
    other.register_blueprint(nested, url_prefix="/other")
    app.register_blueprint(parent)
    app.register_blueprint(other)
    client = app.test_client()
    for path in ("/p", "/parent/c", "/o"):
        assert [client.get(path).status_code for _ in range(3)] == [200, 200, 200]
    assert [client.get("/other/n").status_code for _ in range(2)] == [200, 429]


def test_a_blueprint_exempt_from_its_ancestors_keeps_its_own_limits_and_the_defaults(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter = app_with(backend, clock, DISTLIMIT_DEFAULT_LIMITS="1/minute")
    outer, own, bare = (Blueprint(n, __name__) for n in ("outer", "own", "bare"))
    limiter.limit("5/minute")(outer)
    limiter.limit("2/minute")(own)
    limiter.exempt(own, flags=ExemptionScope.ANCESTORS)
    limiter.exempt(bare, flags=ExemptionScope.ANCESTORS)
    own.add_url_rule("/own", view_func=lambda: "ok")
    bare.add_url_rule("/bare", view_func=lambda: "ok")
    outer.register_blueprint(own)
    outer.register_blueprint(bare)
    app.register_blueprint(outer)
    client = app.test_client()
    assert [client.get("/own").status_code for _ in range(3)] == [200, 200, 429]
    assert [client.get("/bare").status_code for _ in range(2)] == [200, 429]  # the default


def test_a_route_exempt_from_meta_limits_is_served_to_a_client_they_refuse(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter = app_with(backend, clock, DISTLIMIT_META_LIMITS="1/hour")

    @app.get("/tight")
    @limiter.limit("1/minute")
    def tight() -> str:
        return "ok"

    @app.get("/status")
    @limiter.limit("100/minute")
    @limiter.exempt(flags=ExemptionScope.META)
    def status() -> str:
        return "ok"

    @app.get("/roomy")
    @limiter.limit("100/minute")
    def roomy() -> str:
        return "ok"

    client = app.test_client()
    client.get("/tight")
    assert client.get("/tight").status_code == 429  # the one breach the meta limit allows
    assert client.get("/roomy").status_code == 429  # refused by the meta limit
    served = client.get("/status")
    assert served.status_code == 200
    assert served.headers["X-RateLimit-Remaining"] == "99"  # its own limit still counts


def test_a_limit_decided_apart_keeps_its_routes_exemption_from_meta_limits(
    backend: Backend, clock: FakeClock
) -> None:
    """A ``with`` block in the view, a limit with a ``key_func`` under the app's own decorator
    and a hook's limit are decided apart from the gate's call: the route's ``META`` flag holds
    there too."""
    app, limiter = app_with(backend, clock, DISTLIMIT_META_LIMITS="1/hour")

    @app.get("/tight")
    @limiter.limit("1/minute")
    def tight() -> str:
        return "ok"

    @app.get("/inside")
    @limiter.exempt(flags=ExemptionScope.META)
    def inside() -> str:
        with limiter.limit("100/minute"):
            return "ok"

    def own(view: Callable[[], str]) -> Callable[[], str]:  # the app's own decorator
        @functools.wraps(view)
        def wrapper() -> str:
            return view()

        return wrapper

    @app.get("/under")
    @limiter.exempt(flags=ExemptionScope.META)
    @own
    @limiter.limit("100/minute", key_func=lambda: request.path)  # decided when it runs
    def under() -> str:
        return "ok"

    @app.get("/hooked")
    @limiter.exempt(flags=ExemptionScope.META)
    def hooked() -> str:
        return "ok"

    @limiter.limit("100/minute")
    def counted() -> None:
        pass

    @app.before_request
    def hook() -> None:
        if request.path == "/hooked":
            counted()

    client = app.test_client()
    client.get("/tight")
    assert client.get("/tight").status_code == 429  # the one breach the meta limit allows
    for path in ("/inside", "/under", "/hooked"):
        served = client.get(path)
        assert served.status_code == 200, path  # old code: 429, the meta limit refused
        assert served.headers["X-RateLimit-Remaining"] == "99", path


def test_a_hooks_answer_on_a_route_exempt_from_meta_limits_is_not_refused_by_them(
    backend: Backend, clock: FakeClock
) -> None:
    """The view never runs (a hook answers): the global limits count the request, the meta
    limits do not apply to a route ``META`` lifts them from."""
    app, limiter = app_with(
        backend, clock, DISTLIMIT_META_LIMITS="1/hour", DISTLIMIT_GLOBAL_LIMITS="100/minute"
    )
    app.add_url_rule("/tight", "tight", limiter.limit("1/minute")(lambda: "ok"))
    app.add_url_rule("/guarded", "guarded", limiter.exempt(flags=ExemptionScope.META)(lambda: "ok"))
    app.add_url_rule("/other", "other", lambda: "ok")

    @app.before_request
    def deny() -> tuple[str, int] | None:
        return ("sign in", 401) if request.path != "/tight" else None

    client = app.test_client()
    client.get("/tight")
    assert client.get("/tight").status_code == 429
    assert client.get("/other").status_code == 429  # the meta limit refuses the client
    answered = client.get("/guarded")
    assert answered.status_code == 401  # old code: 429
    # the global limit counted it, and the first /tight (a refusal writes nothing)
    assert answered.headers["X-RateLimit-Remaining"] == "98"


def test_a_shut_out_client_still_reaches_a_route_no_limit_counts(
    backend: Backend, clock: FakeClock
) -> None:
    """Flask-Limiter's kitchensink exempts its health blueprint from the defaults and the
    application limits but not from META: there a shut-out client is refused at /health/, here
    it is served (the meta limit watches the limits a request meets; the guide's meta_limits
    row)."""
    app, limiter = app_with(
        backend, clock, DISTLIMIT_META_LIMITS="1/hour", DISTLIMIT_DEFAULT_LIMITS="100/minute"
    )

    @app.get("/tight")
    @limiter.limit("1/minute")
    def tight() -> str:
        return "ok"

    @app.get("/health")
    @limiter.exempt(flags=ExemptionScope.DEFAULT | ExemptionScope.APPLICATION)
    def health() -> str:
        return "ok"

    @app.get("/plain")
    def plain() -> str:
        return "ok"

    client = app.test_client()
    client.get("/tight")
    assert client.get("/tight").status_code == 429  # the one breach the meta limit allows
    assert client.get("/plain").status_code == 429  # its default limit: the meta limit refuses
    served = client.get("/health")
    assert served.status_code == 200
    assert "X-RateLimit-Limit" not in served.headers  # no limit counted it


def test_the_global_limit_counts_requests_no_route_answers(
    backend: Backend, clock: FakeClock
) -> None:
    """Flask-Limiter counts its application limits on routed requests only; here a 404 spends
    the global limit too (the guide's application_limits row)."""
    app, _ = app_with(backend, clock, DISTLIMIT_GLOBAL_LIMITS="2/minute")

    client = app.test_client()
    first = client.get("/nowhere")
    assert first.status_code == 404
    assert first.headers["X-RateLimit-Remaining"] == "1"
    assert client.get("/nowhere/else").status_code == 404
    refused = client.get("/nowhere")
    assert refused.status_code == 429
    assert refused.headers["Retry-After"]


@pytest.mark.parametrize("flags", [ExemptionScope.NONE, 3, "DEFAULT"])
def test_exempt_with_flags_that_are_not_exemption_scopes_is_refused(flags: Any) -> None:
    with pytest.raises(ConfigurationError, match="ExemptionScope"):
        Limiter().exempt(flags=flags)
