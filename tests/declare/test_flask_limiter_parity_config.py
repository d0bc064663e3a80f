"""What a team moving from Flask-Limiter meets when it declares and configures limits (issue 33,
items 7, 8, 9 and 14): the behaviour adopted from Flask-Limiter, and each difference the
migration guide names, pinned; every refusal happens at declaration or ``init_app``."""

from __future__ import annotations

import pytest
from flask import Blueprint, Flask

from flask_distlimit import Limiter
from flask_distlimit.core.limits import Rate, parse_rates
from flask_distlimit.errors import ConfigurationError

# -- item 9: limit strings -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "rate"),
    [
        ("2/sec", Rate(2, 1)),
        ("2/s", Rate(2, 1)),
        ("3 per 2 mins", Rate(3, 120)),
        ("4/hr", Rate(4, 3600)),
        ("5/h", Rate(5, 3600)),
        ("6/d", Rate(6, 86400)),
    ],
)
def test_short_units_flask_limiter_refuses_are_read_as_written(text: str, rate: Rate) -> None:
    assert parse_rates(text) == (rate,)


def test_m_could_be_minute_or_month_so_it_is_refused_at_declaration() -> None:
    with pytest.raises(ConfigurationError, match="could mean minute or month"):
        Limiter().limit("2/m")


def test_an_unreadable_default_limit_stops_init_app_instead_of_falling_back() -> None:
    app = Flask(__name__)
    app.config.update(DISTLIMIT_STORAGE_URL="memory://", DISTLIMIT_DEFAULT_LIMITS="2/fortnight")
    with pytest.raises(ConfigurationError, match="Unknown time unit 'fortnight'"):
        Limiter(app)


# -- item 8: which layers of limits a route meets --------------------------------------------


def policies(app: Flask, path: str) -> list[str]:
    """The names of the limits a request to ``path`` was decided against."""
    field = app.test_client().get(path).headers["RateLimit-Policy"]
    return sorted(item.split(";")[0].strip().strip('"') for item in field.split(","))


def nested_app(*, child_override: bool, parent_override: bool) -> Flask:
    app = Flask(__name__)
    app.config.update(
        DISTLIMIT_STORAGE_URL="memory://",
        DISTLIMIT_DEFAULT_LIMITS="100/hour",
        DISTLIMIT_HEADERS="ietf",
        DISTLIMIT_TIERS={"anonymous": ""},
    )
    limiter = Limiter(app)
    parent, child = Blueprint("parent", __name__), Blueprint("child", __name__)
    limiter.limit("30/hour", override_defaults=parent_override)(parent)
    limiter.limit("20/hour", override_defaults=child_override)(child)

    @child.get("/items")
    def items() -> str:
        return "ok"

    parent.register_blueprint(child, url_prefix="/child")
    app.register_blueprint(parent, url_prefix="/parent")
    return app


@pytest.mark.parametrize(
    ("child_override", "parent_override", "applied"),
    [
        (True, True, ["parent.child.items:20/hour"]),
        # as Flask-Limiter: the parent's limits join; the defaults only if the parent lets them
        (False, True, ["parent.child.items:20/hour", "parent.child.items:30/hour"]),
        (
            False,
            False,
            [
                "parent.child.items:100/hour",
                "parent.child.items:20/hour",
                "parent.child.items:30/hour",
            ],
        ),
    ],
)
def test_a_nested_blueprint_lets_the_next_layer_in_only_when_its_limits_say_so(
    child_override: bool, parent_override: bool, applied: list[str]
) -> None:
    app = nested_app(child_override=child_override, parent_override=parent_override)
    assert policies(app, "/parent/child/items") == applied


def test_a_limit_on_a_helper_the_view_calls_adds_to_the_routes_defaults() -> None:
    app = Flask(__name__)
    app.config.update(
        DISTLIMIT_STORAGE_URL="memory://",
        DISTLIMIT_DEFAULT_LIMITS="2/hour",
        DISTLIMIT_TIERS={"anonymous": ""},
    )
    limiter = Limiter(app)

    @limiter.limit("5/hour")
    def expensive_lookup() -> str:
        return "found"

    @app.get("/lookup")
    def lookup() -> str:
        return expensive_lookup()

    client = app.test_client()
    # Flask-Limiter drops the route's defaults once it has seen the helper's limit (from the
    # second request on) and admits 5; here the defaults stay: the third is refused.
    assert [client.get("/lookup").status_code for _ in range(3)] == [200, 200, 429]


# -- item 7: what stops init_app -------------------------------------------------------------


def test_a_second_limiter_on_one_app_stops_init_app_with_the_port() -> None:
    app = Flask(__name__)
    app.config.update(DISTLIMIT_STORAGE_URL="memory://")
    Limiter(app)
    with pytest.raises(ConfigurationError, match="already registered"):
        Limiter(app)


def test_a_bad_storage_url_stops_init_app_even_with_limiting_disabled() -> None:
    app = Flask(__name__)
    app.config.update(DISTLIMIT_STORAGE_URL="memcached://localhost", DISTLIMIT_ENABLED=False)
    with pytest.raises(ConfigurationError, match="memcached"):
        Limiter(app)
