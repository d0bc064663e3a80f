"""Porting a Flask-Limiter app by following docs/migrating-from-flask-limiter.md (issue 12).

The app: a login limit that counts only failed logins (``deduct_when``), per-tenant plans from a
callable, a blueprint limit, an exempt health check, default limits. Its views and decorators are
written once and declared through either library (the decorator arguments port unchanged); only
the constructor and the configuration change, as the guide says. The port runs on a real
redis-server and must admit exactly the expected sequence; with Flask-Limiter installed, the
original runs side by side on its memory storage and must admit the same sequence.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from flask import Blueprint, Flask, request
from flask.typing import ResponseReturnValue

from flask_distlimit import Limiter
from flask_distlimit.ops.migration import CONFIG_KEYS, CONSTRUCTOR
from flask_distlimit.testing import FakeClock

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "migrating-from-flask-limiter.md"

#: Flask-Limiter 4.1's ``Limiter(...)`` arguments, decorator arguments and config keys.
FL_CONSTRUCTOR = [
    "key_func", "app", "default_limits", "default_limits_per_method",
    "default_limits_exempt_when", "default_limits_deduct_when", "default_limits_cost",
    "application_limits", "application_limits_per_method", "application_limits_exempt_when",
    "application_limits_deduct_when", "application_limits_cost", "headers_enabled",
    "header_name_mapping", "strategy", "storage_uri", "storage_options", "swallow_errors",
    "fail_on_first_breach", "on_breach", "meta_limits", "on_meta_breach", "in_memory_fallback",
    "in_memory_fallback_enabled", "retry_after", "key_prefix", "request_identifier", "enabled",
]  # fmt: skip
FL_DECORATOR = [
    "limit_value", "key_func", "per_method", "methods", "error_message", "exempt_when",
    "override_defaults", "deduct_when", "on_breach", "cost", "scope", "meta_limits",
]  # fmt: skip
FL_CONFIG = [
    "RATELIMIT_ENABLED", "RATELIMIT_KEY_FUNC", "RATELIMIT_KEY_PREFIX",
    "RATELIMIT_FAIL_ON_FIRST_BREACH", "RATELIMIT_ON_BREACH_CALLBACK", "RATELIMIT_SWALLOW_ERRORS",
    "RATELIMIT_APPLICATION", "RATELIMIT_APPLICATION_PER_METHOD",
    "RATELIMIT_APPLICATION_EXEMPT_WHEN", "RATELIMIT_APPLICATION_DEDUCT_WHEN",
    "RATELIMIT_APPLICATION_COST", "RATELIMIT_DEFAULT", "RATELIMIT_DEFAULTS_PER_METHOD",
    "RATELIMIT_DEFAULTS_EXEMPT_WHEN", "RATELIMIT_DEFAULTS_DEDUCT_WHEN", "RATELIMIT_DEFAULTS_COST",
    "RATELIMIT_REQUEST_IDENTIFIER", "RATELIMIT_STRATEGY", "RATELIMIT_STORAGE_URI",
    "RATELIMIT_STORAGE_OPTIONS", "RATELIMIT_HEADERS_ENABLED", "RATELIMIT_HEADER_LIMIT",
    "RATELIMIT_HEADER_REMAINING", "RATELIMIT_HEADER_RESET", "RATELIMIT_HEADER_RETRY_AFTER",
    "RATELIMIT_HEADER_RETRY_AFTER_VALUE", "RATELIMIT_IN_MEMORY_FALLBACK",
    "RATELIMIT_IN_MEMORY_FALLBACK_ENABLED", "RATELIMIT_META", "RATELIMIT_ON_META_BREACH_CALLBACK",
]  # fmt: skip


def guide_rows(heading: str) -> list[str]:
    """The first-column names (in backticks) of the table under ``## <heading>``."""
    text = GUIDE.read_text()
    section = text.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    return [
        name
        for row in section.splitlines()
        if row.startswith("| `")
        for name in re.findall(r"`([A-Za-z_]+)[`(]", row.split("|")[1])
    ]


# -- the guide answers every row ---------------------------------------------------------------


def test_the_guide_maps_every_constructor_argument() -> None:
    rows = guide_rows("The constructor")
    assert [a for a in FL_CONSTRUCTOR if a not in rows] == []
    assert sorted(CONSTRUCTOR) == sorted(FL_CONSTRUCTOR)  # and Limiter() says how to port each


def test_the_guide_maps_every_decorator_argument() -> None:
    rows = guide_rows("The decorators")
    assert [a for a in FL_DECORATOR if a not in rows] == []


def test_the_guide_maps_every_config_key() -> None:
    rows = guide_rows("The `RATELIMIT_*` keys")
    assert [k for k in FL_CONFIG if k not in rows] == []


@pytest.mark.parametrize(
    ("heading", "said"), [("The constructor", CONSTRUCTOR), ("The `RATELIMIT_*` keys", CONFIG_KEYS)]
)
def test_what_limiter_says_at_start_up_is_what_the_guide_says(
    heading: str, said: dict[str, str]
) -> None:
    """The port ``Limiter()`` and ``init_app`` print for each Flask-Limiter argument and key names
    the same settings as the guide's row, and says "none" exactly where the guide does."""
    text = GUIDE.read_text().split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for row in text.splitlines():
        if row.startswith("| `"):
            cells = row.split("|")
            for name in re.findall(r"`([A-Za-z_]+)[`(]", cells[1]):
                rows.setdefault(name, cells[2].strip())
    for name, message in said.items():
        guide = rows[name]
        settings = re.compile(r"DISTLIMIT_[A-Z_]+")
        assert set(settings.findall(message)) == set(settings.findall(guide)), name
        assert message.startswith("none") == guide.startswith("none"), name


def test_the_lists_above_are_flask_limiters_own() -> None:
    import flask_limiter  # the test extra installs it: the guide is checked against it

    constructor = list(inspect.signature(flask_limiter.Limiter.__init__).parameters)[1:]
    decorator = list(inspect.signature(flask_limiter.Limiter.limit).parameters)[1:]
    shared = list(inspect.signature(flask_limiter.Limiter.shared_limit).parameters)[1:]
    config_vars = flask_limiter.constants.ConfigVars
    config = [v for k, v in vars(config_vars).items() if k.isupper() and isinstance(v, str)]
    assert sorted(constructor) == sorted(FL_CONSTRUCTOR)
    assert sorted(set(decorator) | set(shared)) == sorted(FL_DECORATOR)
    assert sorted(config) == sorted(FL_CONFIG)


def get_remote_address() -> str:  # Flask-Limiter's, as apps import it
    return request.remote_addr or "127.0.0.1"


def test_flask_limiter_constructor_calls_say_how_to_port() -> None:
    app = Flask("port")
    with pytest.raises(TypeError, match="Limiter\\(app\\)") as positional:
        Limiter(get_remote_address, app=app)  # type: ignore[arg-type]
    assert "DISTLIMIT_TRUSTED_PROXIES" in str(positional.value)
    with pytest.raises(TypeError, match="DISTLIMIT_DEFAULT_LIMITS"):
        Limiter(app, default_limits=["20/hour"])
    ours = set(inspect.signature(Limiter.__init__).parameters)
    for name in [n for n in FL_CONSTRUCTOR if n not in ours and n != "key_func"]:
        with pytest.raises(TypeError, match=name):
            Limiter(**{name: None})
    assert "distlimit" not in app.extensions
    Limiter(app=app)  # the keyword spelling works, as Flask-Limiter users write it
    assert "distlimit" in app.extensions


# -- the app, declared through either library -------------------------------------------------

PLANS = {"acme": "5/hour", "initech": "3/hour"}


def declare(app: Flask, limiter: Any) -> None:
    """The app's views with their limits, written as a Flask-Limiter app writes them."""

    @app.post("/login")
    @limiter.limit("5/hour", deduct_when=lambda response: response.status_code == 401)
    def login() -> ResponseReturnValue:
        if request.form.get("password") == "sesame":
            return "welcome"
        return "bad credentials", 401

    @app.get("/orders")
    @limiter.limit(
        lambda: PLANS[request.headers["X-Tenant"]], key_func=lambda: request.headers["X-Tenant"]
    )
    def orders() -> str:
        return "orders"

    @app.get("/health")
    @limiter.exempt
    def health() -> str:
        return "ok"

    @app.get("/plain")
    def plain() -> str:
        return "plain"

    api = Blueprint("api", __name__)
    limiter.limit("3/hour")(api)

    @api.get("/items")
    def items() -> str:
        return "items"

    @api.get("/stats")
    def stats() -> str:
        return "stats"

    app.register_blueprint(api, url_prefix="/api")


#: (method, path, form, headers, times) and the statuses expected for it.
SCRIPT: list[tuple[tuple[str, str, dict[str, str], dict[str, str], int], list[int]]] = [
    (("POST", "/login", {"password": "sesame"}, {}, 3), [200] * 3),  # successes cost nothing
    (("POST", "/login", {"password": "guess"}, {}, 5), [401] * 5),
    (("POST", "/login", {"password": "sesame"}, {}, 2), [429] * 2),  # spent: refused first
    (("GET", "/orders", {}, {"X-Tenant": "acme"}, 6), [200] * 5 + [429]),
    (("GET", "/orders", {}, {"X-Tenant": "initech"}, 4), [200] * 3 + [429]),
    (("GET", "/api/items", {}, {}, 4), [200] * 3 + [429]),
    (("GET", "/api/stats", {}, {}, 4), [200] * 3 + [429]),  # per route, as in Flask-Limiter
    (("GET", "/health", {}, {}, 25), [200] * 25),  # exempt from the 20/hour default
    (("GET", "/plain", {}, {}, 21), [200] * 20 + [429]),
]


def replay(app: Flask) -> list[int]:
    client = app.test_client()
    statuses: list[int] = []
    for (method, path, form, headers, times), _ in SCRIPT:
        for _ in range(times):
            statuses.append(
                client.open(path, method=method, data=form, headers=headers).status_code
            )
    return statuses


EXPECTED = [status for _, statuses in SCRIPT for status in statuses]


def ported_app(redis_url: str) -> Flask:
    """The port, following the guide: config keys renamed, ``Limiter(app)``."""
    app = Flask("ported")
    app.config.update(
        SECRET_KEY="migration-test-" + "x" * 20,
        DISTLIMIT_STORAGE_URL=redis_url,  # was RATELIMIT_STORAGE_URI
        DISTLIMIT_ALGORITHM="fixed_window",  # was RATELIMIT_STRATEGY="fixed-window"
        DISTLIMIT_DEFAULT_LIMITS="20/hour",  # was RATELIMIT_DEFAULT
    )
    # Limiter(get_remote_address, app=app) becomes Limiter(app); the clock is injected so that
    # no hour boundary can fall inside the test (production uses the Redis server's clock).
    limiter = Limiter(clock=FakeClock(start=1_700_002_800.0))
    declare(app, limiter)
    limiter.init_app(app)
    return app


@pytest.fixture
def redis_url(redis_client: redis.Redis) -> Iterator[str]:
    port = redis_client.connection_pool.connection_kwargs["port"]
    yield f"redis://127.0.0.1:{port}/0"


@pytest.mark.redis
def test_the_ported_app_admits_the_expected_sequence_on_redis(redis_url: str) -> None:
    app = ported_app(redis_url)
    try:
        assert replay(app) == EXPECTED
    finally:
        Limiter.state(app).storage.close()


@pytest.mark.slow
@pytest.mark.redis
def test_the_port_admits_what_flask_limiter_admits(redis_url: str) -> None:
    import flask_limiter  # the test extra installs it: the guide is checked against it

    original = Flask("original")
    original.config.update(
        RATELIMIT_STORAGE_URI="memory://",
        RATELIMIT_STRATEGY="fixed-window",
        RATELIMIT_DEFAULT="20/hour",
    )
    declare(original, flask_limiter.Limiter(get_remote_address, app=original))
    ported = ported_app(redis_url)
    try:
        assert replay(original) == replay(ported) == EXPECTED
    finally:
        Limiter.state(ported).storage.close()


# -- the second port: leftover keys, a month, a dynamic shared limit, a callable default -------
#
# Flask-Limiter's spellings of issue 26's cases. The port follows the guide: the recipe's
# request-reading scope is refused when declared and ported as the refusal says; the default
# callable is passed as is, asked on every request (DISTLIMIT_DYNAMIC_LIMIT_TTL=0) as
# Flask-Limiter asks it; the RATELIMIT_* keys are left in place and warned about.


def plan_of() -> str:
    return "2/hour" if request.headers.get("X-Plan") == "free" else "4/hour"


def declare_second(app: Flask, limiter: Any, host_limit: Any) -> None:
    @app.get("/reports")
    @limiter.limit("3/month")
    def reports() -> str:
        return "reports"

    @app.get("/a")
    @host_limit
    def a() -> str:
        return "a"

    @app.get("/b")
    @host_limit
    def b() -> str:
        return "b"

    @app.get("/plain")
    def plain() -> str:
        return "plain"


#: (path, host, headers, times) and the statuses expected for it.
SECOND: list[tuple[tuple[str, str, dict[str, str], int], list[int]]] = [
    (("/reports", "one.example", {}, 4), [200] * 3 + [429]),  # 3 in the month
    (("/a", "one.example", {}, 1), [200]),
    (("/b", "one.example", {}, 2), [200, 429]),  # one counter per host, shared by /a and /b
    (("/a", "two.example", {}, 3), [200, 200, 429]),  # another host: its own
    (("/plain", "one.example", {"X-Plan": "free"}, 3), [200, 200, 429]),  # the default: 2/hour
    (("/plain", "one.example", {"X-Plan": "pro"}, 5), [200] * 4 + [429]),  # asked again: 4/hour
]
SECOND_EXPECTED = [status for _, statuses in SECOND for status in statuses]


def replay_second(app: Flask) -> list[int]:
    client = app.test_client()
    return [
        client.get(path, base_url=f"http://{host}", headers=headers).status_code
        for (path, host, headers, times), _ in SECOND
        for _ in range(times)
    ]


LEFTOVER = {"RATELIMIT_STORAGE_URI": "memory://", "RATELIMIT_STRATEGY": "fixed-window"}


def second_port(redis_url: str) -> Flask:
    app = Flask("second-port")
    app.config.update(
        LEFTOVER,  # copied from the original and left behind: warned about, not read
        SECRET_KEY="migration-test-" + "x" * 20,
        DISTLIMIT_STORAGE_URL=redis_url,
        DISTLIMIT_ALGORITHM="fixed_window",
        DISTLIMIT_DEFAULT_LIMITS=plan_of,  # was default_limits=[plan_of]
        DISTLIMIT_DYNAMIC_LIMIT_TTL=0,  # asked every request, as Flask-Limiter asks it
    )
    # a whole hour from a month's boundary: no window ends inside the test
    limiter = Limiter(clock=FakeClock(start=(1_700_000_000 // 2_592_000) * 2_592_000 + 3600.0))
    host_limit = limiter.shared_limit("2/hour", scope="per-host", key_func=lambda: request.host)
    declare_second(app, limiter, host_limit)
    limiter.init_app(app)
    return app


def test_the_dynamic_shared_limit_recipe_as_written_is_refused_with_this_port() -> None:
    from flask_distlimit import ConfigurationError

    with pytest.raises(ConfigurationError) as info:
        Limiter().shared_limit("2/hour", scope=lambda endpoint: request.host)
    assert 'scope="per-host", key_func=lambda: request.host' in GUIDE.read_text()
    assert "scope='per-host', key_func=lambda: request.host" in str(info.value)


@pytest.mark.redis
def test_the_second_port_behaves_as_the_guide_says_on_redis(
    redis_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    with caplog.at_level(logging.WARNING, logger="flask_distlimit"):
        app = second_port(redis_url)
    try:
        (warning,) = [r.getMessage() for r in caplog.records if "RATELIMIT_" in r.getMessage()]
        assert "RATELIMIT_STORAGE_URI -> DISTLIMIT_STORAGE_URL" in warning
        assert "RATELIMIT_STRATEGY -> DISTLIMIT_ALGORITHM" in warning
        assert replay_second(app) == SECOND_EXPECTED
        # the monthly quota's key on Redis: its window is 30 days, as Flask-Limiter's
        (month,) = redis_client.keys("*:r_reports_3/2592000:*")
        assert 0 < redis_client.pttl(month) <= 2_592_000_000
    finally:
        Limiter.state(app).storage.close()


@pytest.mark.redis
def test_the_second_port_admits_what_flask_limiter_admits(redis_url: str) -> None:
    import flask_limiter

    original = Flask("second-original")
    original.config.update(LEFTOVER)
    fl = flask_limiter.Limiter(get_remote_address, app=original, default_limits=[plan_of])
    host_limit = fl.shared_limit("2/hour", scope=lambda endpoint: request.host)
    declare_second(original, fl, host_limit)
    ported = second_port(redis_url)
    try:
        assert replay_second(original) == replay_second(ported) == SECOND_EXPECTED
    finally:
        Limiter.state(ported).storage.close()


def test_the_guide_lists_every_difference_with_its_reason() -> None:
    """Each behaviour a port meets differently has its entry in "What behaves differently"."""
    section = GUIDE.read_text().split("## What behaves differently", 1)[1].split("\n## ", 1)[0]
    for needle in [
        "The default algorithm is the sliding window counter",
        "Fixed windows are clock-aligned",
        "midnight UTC",
        "`month` is 30 days and `year` is 360 days",
        "At most 8 limits per request",
        "A callable limit's answer is kept",
        "DISTLIMIT_DYNAMIC_LIMIT_TTL=0",
        "A `scope` callable is bound once per route",
        'scope="per-host", key_func=lambda: request.host',
        "`on_breach` gets a `Breach`",
        "Leftover `RATELIMIT_*` keys are not read",
    ]:
        assert needle in section, needle
    assert "no month or year" not in GUIDE.read_text()


def test_the_limits_guide_says_when_a_changed_callable_limit_takes_effect() -> None:
    """docs/limits.md said "on the next request"; the answer is kept for the TTL first (the
    behaviour: tests/declare/test_dynamic_limits.py, a changed value takes effect when it
    expires)."""
    text = (GUIDE.parent / "limits.md").read_text()
    assert "**A changed value takes effect on the next request" not in text
    paragraph = text.split("**When a changed value takes effect.**", 1)[1].split("\n\n", 1)[0]
    assert "`DISTLIMIT_DYNAMIC_LIMIT_TTL` seconds (60 by default)" in paragraph
    assert "not on the next request" in paragraph and "DISTLIMIT_DYNAMIC_LIMIT_TTL=0" in paragraph
