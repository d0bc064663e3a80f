"""The Flask extension through the test client, on memory, fakeredis and a real redis-server."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from flask import Blueprint, Flask, Response, g, jsonify, make_response, request

from flask_distlimit import (
    ALGORITHMS,
    Breach,
    ConfigurationError,
    Limiter,
    LimiterState,
    StorageUnavailable,
)
from flask_distlimit.core.decision import Check, Evaluation
from flask_distlimit.declare.keys import identity_tag, limit_key
from flask_distlimit.storage.base import Storage
from flask_distlimit.storage.redis import RedisStorage
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import backend, clock, make_app

__all__ = ["backend", "clock"]  # fixtures used below

Backend = Callable[[], Storage]


def test_limit_allows_then_refuses_with_problem_json(backend: Backend, clock: FakeClock) -> None:
    app, limiter, _counting = make_app(backend(), clock)

    @app.get("/orders")
    @limiter.limit("3/minute", algorithm="fixed_window")
    def orders() -> str:
        return "ok"

    client = app.test_client()
    remaining = [client.get("/orders").headers["X-RateLimit-Remaining"] for _ in range(3)]
    assert remaining == ["2", "1", "0"]
    denied = client.get("/orders")
    assert denied.status_code == 429
    assert denied.mimetype == "application/problem+json"
    assert denied.headers["Cache-Control"] == "no-store"
    body = json.loads(denied.get_data(as_text=True))
    assert body["type"] == "https://iana.org/assignments/http-problem-types#quota-exceeded"
    assert body["status"] == 429
    assert body["instance"] == "/orders"
    assert body["violated-policies"] == ["orders:3/minute"]
    assert body["retry_after"] == int(denied.headers["Retry-After"]) == 60
    assert denied.headers["RateLimit"] == '"orders:3/minute";r=0;t=60'
    assert denied.headers["RateLimit-Policy"] == '"orders:3/minute";q=3;w=60'
    clock.advance(60)
    assert client.get("/orders").status_code == 200


def test_one_storage_call_for_global_tier_route_and_shared_limits(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, counting = make_app(
        backend(),
        clock,
        DISTLIMIT_GLOBAL_LIMITS="100/minute",
        DISTLIMIT_TIERS={"anonymous": "50/minute"},
    )

    @app.get("/search")
    @limiter.limit("10/minute;200/hour")
    @limiter.shared_limit("20/minute", scope="reads")
    def search() -> str:
        return "ok"

    client = app.test_client()
    for n in range(1, 6):
        assert client.get("/search").status_code == 200
        assert counting.evaluations == n
    kinds = {c.key.split("}:", 1)[1].split("_")[0] for c in counting.checks[-1]}
    assert len(counting.checks[-1]) == 5  # global, tier, 2 route rates, shared
    assert kinds == {"g", "t", "r", "s"}


def test_exempt_views_and_blueprints_get_no_limits_and_no_headers(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, counting = make_app(
        backend(), clock, DISTLIMIT_DEFAULT_LIMITS="1/minute", DISTLIMIT_GLOBAL_LIMITS="1/minute"
    )
    bp = Blueprint("health", __name__)

    @bp.get("/live")
    def live() -> str:
        return "ok"

    @app.get("/ping")
    @limiter.exempt
    def ping() -> str:
        return "pong"

    limiter.exempt(bp)
    app.register_blueprint(bp)
    client = app.test_client()
    for path in ("/ping", "/live") * 3:
        response = client.get(path)
        assert response.status_code == 200
        assert not any(
            h.lower().startswith(("x-ratelimit", "ratelimit")) for h, _ in response.headers
        )
    assert counting.evaluations == 0


def test_shared_limit_is_one_counter_for_its_routes(backend: Backend, clock: FakeClock) -> None:
    app, limiter, _ = make_app(backend(), clock)
    reads = limiter.shared_limit("3/minute", scope="reads", algorithm="fixed_window")

    @app.get("/a")
    @reads
    def a() -> str:
        return "a"

    @app.get("/b")
    @reads
    def b() -> str:
        return "b"

    client = app.test_client()
    statuses = [client.get(p).status_code for p in ("/a", "/b", "/a", "/b")]
    assert statuses == [200, 200, 200, 429]


def test_per_method_counts_each_method_apart(backend: Backend, clock: FakeClock) -> None:
    app, limiter, _ = make_app(backend(), clock)

    @app.route("/items", methods=["GET", "POST"])
    @limiter.limit("1/minute", per_method=True, algorithm="fixed_window")
    def items() -> str:
        return "ok"

    client = app.test_client()
    assert client.get("/items").status_code == 200
    assert client.post("/items").status_code == 200
    assert client.get("/items").status_code == 429
    assert client.post("/items").status_code == 429


def test_blueprint_route_and_default_limits(backend: Backend, clock: FakeClock) -> None:
    app, limiter, _counting = make_app(
        backend(), clock, DISTLIMIT_DEFAULT_LIMITS="5/minute", DISTLIMIT_ALGORITHM="fixed_window"
    )
    api = Blueprint("api", __name__, url_prefix="/api")

    @api.get("/x")
    def x() -> str:
        return "x"

    @api.get("/y")
    @limiter.limit("1/minute")
    def y() -> str:
        return "y"

    limiter.limit("2/minute")(api)
    app.register_blueprint(api)

    @app.get("/plain")
    def plain() -> str:
        return "plain"

    client = app.test_client()
    assert [client.get("/api/x").status_code for _ in range(3)] == [200, 200, 429]
    assert [client.get("/api/y").status_code for _ in range(2)] == [200, 429]  # own limit wins
    plain_statuses = [client.get("/plain").status_code for _ in range(6)]
    assert plain_statuses == [200] * 5 + [429]
    assert client.get("/plain").headers["X-RateLimit-Limit"] == "5"


def test_global_limits_key_on_client_ip_and_cover_404s(backend: Backend, clock: FakeClock) -> None:
    app, limiter, _ = make_app(
        backend(), clock, DISTLIMIT_GLOBAL_LIMITS="2/minute", DISTLIMIT_ALGORITHM="fixed_window"
    )

    @app.get("/t/<tenant>")
    @limiter.limit("100/minute", key_func=lambda: "tenant")
    def tenant(tenant: str) -> str:
        return tenant

    client = app.test_client()
    assert client.get("/nowhere").status_code == 404
    assert client.get("/t/a").status_code == 200
    assert client.get("/t/b").status_code == 429
    other = client.get("/t/b", environ_base={"REMOTE_ADDR": "198.51.100.7"})
    assert other.status_code == 200


def test_the_client_address_is_computed_once_per_request(
    backend: Backend, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    app, limiter, counting = make_app(
        backend(), clock, DISTLIMIT_GLOBAL_LIMITS="100/minute", DISTLIMIT_TRUSTED_PROXIES=1
    )

    @app.get("/")
    @limiter.limit("5/minute")
    def index() -> str:
        return "ok"

    resolver = limiter.state(app).resolver
    asked: list[object] = []
    address = resolver.client_ip
    monkeypatch.setattr(resolver, "client_ip", lambda environ: asked.append(1) or address(environ))
    client = app.test_client()
    forwarded = {"X-Forwarded-For": "203.0.113.9"}
    for _ in range(3):  # an anonymous client under a global and a route limit
        assert client.get("/", headers=forwarded).status_code == 200
    assert len(asked) == 3
    assert counting.evaluations == 3  # one storage call each, all of them decided there


def test_key_func_cost_and_exempt_when(backend: Backend, clock: FakeClock) -> None:
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_ALGORITHM="fixed_window")

    @app.get("/upload/<int:size>")
    @limiter.limit(
        "10/minute",
        key_func=lambda: request.args.get("tenant", "none"),
        cost=lambda: int((request.view_args or {})["size"]),
        exempt_when=lambda: request.args.get("tenant") == "admin",
    )
    def upload(size: int) -> str:
        return "ok"

    client = app.test_client()
    assert client.get("/upload/6?tenant=t1").status_code == 200
    assert client.get("/upload/5?tenant=t1").status_code == 429  # 6 + 5 > 10
    assert client.get("/upload/4?tenant=t1").status_code == 200
    assert client.get("/upload/6?tenant=t2").status_code == 200  # another tenant, another key
    assert client.get("/upload/50?tenant=admin").status_code == 200  # exempt


def test_stacked_limits_and_multi_rate_strings(backend: Backend, clock: FakeClock) -> None:
    app, limiter, counting = make_app(backend(), clock, DISTLIMIT_ALGORITHM="fixed_window")

    @app.get("/s")
    @limiter.limit("2/second;3/hour")
    @limiter.limit("5/minute", algorithm="token_bucket")
    def s() -> str:
        return "ok"

    client = app.test_client()
    first = client.get("/s")
    assert len(counting.checks[-1]) == 3
    assert first.headers["X-RateLimit-Remaining"] == "1"  # 2/second is closest to denial
    assert client.get("/s").status_code == 200
    denied = client.get("/s")
    assert denied.status_code == 429
    assert json.loads(denied.get_data())["violated-policies"] == ["s:2/second"]
    clock.advance(1)
    assert client.get("/s").status_code == 200
    clock.advance(1)
    last = client.get("/s")
    assert last.status_code == 429
    assert json.loads(last.get_data())["violated-policies"] == ["s:3/hour"]


def test_conditional_requests_cost_the_conditional_cost(backend: Backend, clock: FakeClock) -> None:
    app, limiter, counting = make_app(
        backend(), clock, DISTLIMIT_CONDITIONAL_COST=0, DISTLIMIT_ALGORITHM="fixed_window"
    )

    @app.get("/doc")
    @limiter.limit("2/minute")
    def doc() -> Response:
        response = make_response("doc")
        response.set_etag("abc")
        return response.make_conditional(request)

    client = app.test_client()
    for _ in range(5):
        assert client.get("/doc", headers={"If-None-Match": '"abc"'}).status_code == 304
    # 1 reserved before the view (only a 304 proves the revalidation), given back after it
    assert [(c.cost, c.release) for c in counting.checks[-1]] == [(1, True)]
    evaluations = counting.evaluations
    # A condition the view cannot honour ends in a full response: its reservation stays.
    assert client.get("/doc", headers={"If-Modified-Since": "garbage"}).status_code == 200
    assert counting.evaluations == evaluations + 1
    assert [client.get("/doc").status_code for _ in range(2)] == [200, 429]


def test_garbage_request_headers_never_cause_a_500(backend: Backend, clock: FakeClock) -> None:
    app, limiter, _ = make_app(
        backend(),
        clock,
        DISTLIMIT_GLOBAL_LIMITS="1000/minute",
        DISTLIMIT_TIERS={"anonymous": "1000/minute", "pro": "5000/minute"},
        DISTLIMIT_TRUSTED_PROXIES=1,
    )

    @app.get("/")
    @limiter.limit("1000/minute")
    def index() -> str:
        return "ok"

    client = app.test_client()
    garbage = [
        {"If-None-Match": "\x00\xff" * 50, "If-Modified-Since": "not a date"},
        {"X-Forwarded-For": "{}}}{{ ,,, ::::zz, 999.1.1.1"},
        {"X-Forwarded-For": "a" * 10_000},
        {"Authorization": "Bearer " + "x.y.z" * 100},
        {"Authorization": "Basic ???"},
        {"X-Api-Key": "k" * 5000},
    ]
    for headers in garbage:
        assert client.get("/", headers=headers).status_code == 200
    assert client.get("/", environ_base={"REMOTE_ADDR": "not-an-ip"}).status_code == 200


def test_two_apps_in_one_process_keep_their_own_settings(
    backend: Backend, clock: FakeClock
) -> None:
    limiter = Limiter(clock=clock)
    one, _, _ = make_app(
        backend(), clock, limiter=limiter, name="one", DISTLIMIT_DEFAULT_LIMITS="1/minute"
    )
    two, _, _ = make_app(
        backend(),
        clock,
        limiter=limiter,
        name="two",
        DISTLIMIT_DEFAULT_LIMITS="3/minute",
        DISTLIMIT_KEY_PREFIX="two",
        DISTLIMIT_HEADERS="ietf",
    )
    for app in (one, two):
        app.add_url_rule("/", "index", lambda: "ok")
    c1, c2 = one.test_client(), two.test_client()
    assert [c1.get("/").status_code for _ in range(2)] == [200, 429]
    responses = [c2.get("/") for _ in range(4)]
    assert [r.status_code for r in responses] == [200, 200, 200, 429]
    assert "X-RateLimit-Limit" not in responses[0].headers
    assert responses[0].headers["RateLimit-Policy"] == '"index:3/minute";q=3;w=60'
    assert one.extensions["distlimit"] is not two.extensions["distlimit"]


def test_same_declared_limit_hits_the_same_key_from_every_worker(
    backend: Backend, clock: FakeClock
) -> None:
    """Two Limiter instances (two workers or replicas) on one store count together."""
    apps = []
    for worker in range(2):
        limiter = Limiter(clock=clock)
        app, _, _ = make_app(backend(), clock, limiter=limiter, name=f"w{worker}")

        @app.get("/pay")
        @limiter.limit("3/minute", algorithm="fixed_window")
        def pay() -> str:
            return "ok"

        apps.append(app.test_client())
    statuses = [apps[i % 2].get("/pay").status_code for i in range(4)]
    assert statuses == [200, 200, 200, 429]


def test_second_init_app_is_refused(clock: FakeClock) -> None:
    app = Flask("x")
    limiter = Limiter(app, clock=clock)
    with pytest.raises(ConfigurationError, match="already registered"):
        limiter.init_app(app)
    with pytest.raises(ConfigurationError, match="already registered"):
        Limiter(app)


def test_request_data_never_reaches_the_next_request_in_a_shared_app_context(
    backend: Backend, clock: FakeClock
) -> None:
    """The numbers after_request reports live in the request's environ: a request our
    before_request never saw (an earlier hook answered it) gets no rate-limit headers, even when
    one app context (and its ``g``) serves several requests."""
    app, limiter, _ = make_app(backend(), clock)

    def stop_early() -> str | None:
        return "stopped" if request.headers.get("X-Stop") else None

    app.before_request_funcs.setdefault(None, []).insert(0, stop_early)  # runs before ours

    @app.get("/")
    @limiter.limit("5/minute")
    def index() -> str:
        return "ok"

    with app.app_context(), app.test_client() as client:
        first = client.get("/")
        assert first.headers["X-RateLimit-Remaining"] == "4"
        second = client.get("/", headers={"X-Stop": "1"})
        assert second.get_data(as_text=True) == "stopped"
        assert "X-RateLimit-Remaining" not in second.headers
        assert "RateLimit" not in second.headers
        assert not [k for k in g if "distlimit" in k]


def test_errorhandler_429_replaces_the_body_and_keeps_headers(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_ALGORITHM="fixed_window")

    @app.errorhandler(429)
    def too_many(exc: Exception) -> tuple[object, int]:
        return jsonify(error="slow down"), 429

    @app.get("/")
    @limiter.limit("1/minute")
    def index() -> str:
        return "ok"

    client = app.test_client()
    client.get("/")
    denied = client.get("/")
    assert denied.status_code == 429
    assert denied.json == {"error": "slow down"}
    assert denied.headers["Retry-After"] == "60"
    assert denied.headers["X-RateLimit-Remaining"] == "0"


def test_on_breach_hook_and_info_log_without_raw_api_key(
    backend: Backend, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    breaches: list[Breach] = []
    limiter = Limiter(clock=clock, on_breach=breaches.append)
    app, _, _ = make_app(
        backend(),
        clock,
        limiter=limiter,
        DISTLIMIT_TIERS={"anonymous": "", "pro": "1/minute"},
        DISTLIMIT_ALGORITHM="fixed_window",
    )
    raw_key = "sk_live_SUPERSECRET_1234567890"

    @limiter.api_key_verifier
    def verify(key: str) -> str | None:
        return "pro" if key == raw_key else None

    app.add_url_rule("/", "index", lambda: "ok")
    client = app.test_client()
    assert client.get("/", headers={"X-Api-Key": raw_key}).status_code == 200
    with caplog.at_level(logging.INFO, logger="flask_distlimit"):
        denied = client.get("/", headers={"X-Api-Key": raw_key})
        again = client.get("/", headers={"X-Api-Key": raw_key})
    assert denied.status_code == again.status_code == 429
    assert len(breaches) == 2
    breach = breaches[0]
    assert breach.tier == "pro"
    assert breach.violated_policies == ("tier-pro:1/minute",)
    assert breach.retry_after == 60
    assert not breach.from_cache
    state = Limiter.state(app)
    digest = identity_tag(state.resolver.api_key_identity(raw_key), state.tags)
    assert breach.identity_digest == digest
    # One INFO line per client and limit per window, not one per refused request.
    records = [r for r in caplog.records if r.name == "flask_distlimit"]
    assert [r.levelno for r in records] == [logging.INFO]
    message = records[0].getMessage()
    assert digest in message and "tier-pro:1/minute" in message
    assert raw_key not in caplog.text and raw_key not in denied.get_data(as_text=True)
    # A random key counts as anonymous (no tier limit here), never as a fresh "pro" quota.
    assert client.get("/", headers={"X-Api-Key": "random"}).status_code == 200


def test_on_breach_may_answer_instead(backend: Backend, clock: FakeClock) -> None:
    limiter = Limiter(clock=clock)
    app, _, _ = make_app(backend(), clock, limiter=limiter, DISTLIMIT_ALGORITHM="fixed_window")

    @limiter.on_breach
    def teapot(breach: Breach) -> object:
        return app.response_class("calm down", status=429)

    @app.get("/")
    @limiter.limit("1/minute")
    def index() -> str:
        return "ok"

    client = app.test_client()
    client.get("/")
    denied = client.get("/")
    assert denied.status_code == 429 and denied.get_data(as_text=True) == "calm down"
    assert denied.headers["Retry-After"] == "60"


def test_retry_after_is_rounded_up_and_never_early(backend: Backend, clock: FakeClock) -> None:
    app, limiter, _ = make_app(backend(), clock)

    for algorithm in ALGORITHMS:

        def view() -> str:
            return "ok"

        view.__qualname__ = f"view_{algorithm}"
        app.add_url_rule(
            f"/{algorithm}",
            algorithm,
            limiter.limit("3/7 seconds", algorithm=algorithm)(view),
        )
    client = app.test_client()
    for algorithm in ALGORITHMS:
        clock.advance(0.3)
        while (response := client.get(f"/{algorithm}")).status_code == 200:
            clock.advance(0.45)
        retry = int(response.headers["Retry-After"])
        assert json.loads(response.get_data())["retry_after"] == retry
        clock.advance(retry - 1)  # the real wait is in (retry - 1, retry]: still refused
        assert client.get(f"/{algorithm}").status_code == 429, algorithm
        clock.advance(1)
        assert client.get(f"/{algorithm}").status_code == 200, algorithm


class _Down(Storage):
    scheme = "down"

    def evaluate(self, checks: object, *, now_us: int | None = None) -> Evaluation:
        raise StorageUnavailable("connection refused")

    def ping(self) -> float:
        raise StorageUnavailable("connection refused")

    def scan(self, match: str) -> list[str]:  # type: ignore[override]
        return []

    def delete(self, keys: object) -> int:
        return 0

    def heartbeat(self, key: str, member: str, ttl: float) -> int:
        raise StorageUnavailable("connection refused")


def test_outage_open_degrades_closed_answers_503_and_route_override(clock: FakeClock) -> None:
    app, limiter, _ = make_app(_Down(), clock, DISTLIMIT_BREAKER_RESET_TIMEOUT=12)

    @app.get("/browse")
    @limiter.limit("5/minute")
    def browse() -> str:
        return "ok"

    @app.post("/login")
    @limiter.limit("5/minute", on_failure="closed")
    def login() -> str:
        return "ok"

    client = app.test_client()
    ok = client.get("/browse")
    assert ok.status_code == 200
    assert ok.headers["X-RateLimit-Degraded"] == "true"
    assert "X-RateLimit-Limit" not in ok.headers and "Retry-After" not in ok.headers
    refused = client.post("/login")
    assert refused.status_code == 503
    assert refused.mimetype == "application/problem+json"
    assert refused.headers["Retry-After"] == "12"
    assert refused.headers["Cache-Control"] == "no-store"
    body = json.loads(refused.get_data())
    assert body["type"].endswith("#temporary-reduced-capacity")
    assert body["status"] == 503 and body["retry_after"] == 12


def test_disabled_makes_no_storage_calls(backend: Backend, clock: FakeClock) -> None:
    app, _limiter, counting = make_app(
        backend(), clock, DISTLIMIT_ENABLED=False, DISTLIMIT_GLOBAL_LIMITS="1/minute"
    )
    app.add_url_rule("/", "index", lambda: "ok")
    client = app.test_client()
    assert [client.get("/").status_code for _ in range(3)] == [200, 200, 200]
    assert counting.evaluations == 0


def test_health_and_reset(backend: Backend, clock: FakeClock) -> None:
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_ALGORITHM="fixed_window")

    @app.get("/")
    @limiter.limit("1/minute")
    def index() -> str:
        return "ok"

    client = app.test_client()
    assert client.get("/").status_code == 200
    assert client.get("/").status_code == 429
    assert limiter.reset(app) >= 1
    assert client.get("/").status_code == 200
    with app.app_context():
        health = limiter.health()
    assert health["latency_ms"] is not None


def test_memory_url_storage_follows_the_limiters_clock() -> None:
    """``Limiter(app, clock=FakeClock())`` on ``memory://``, as the quickstart tests: keys written
    at the fake time are found by ``reset`` (the storage listed them by the machine's clock)."""
    clock = FakeClock()
    app = Flask(__name__)
    app.config["DISTLIMIT_STORAGE_URL"] = "memory://"
    limiter = Limiter(app, clock=clock)

    @app.get("/")
    @limiter.limit("1/minute")
    def index() -> str:
        return "ok"

    client = app.test_client()
    assert [client.get("/").status_code for _ in range(2)] == [200, 429]
    assert limiter.reset(app) == 1
    assert client.get("/").status_code == 200


def test_a_reset_that_cannot_list_the_keys_forgets_nothing_locally(clock: FakeClock) -> None:
    """A reset whose SCAN fails deletes no count, so this process keeps refusing from its deny
    cache the client the storage still counts as over its limit."""
    from flask_distlimit.storage.memory import MemoryStorage

    class NoScan(MemoryStorage):
        def scan(self, match: str) -> Iterator[str]:
            raise StorageUnavailable("SCAN refused")

    app, limiter, _ = make_app(NoScan(clock=clock), clock, DISTLIMIT_ALGORITHM="fixed_window")

    @app.get("/")
    @limiter.limit("1/minute")
    def index() -> str:
        return "ok"

    client = app.test_client()
    assert client.get("/").status_code == 200
    assert client.get("/").status_code == 429
    deny_cache = Limiter.state(app).deny_cache
    assert deny_cache is not None and len(deny_cache) == 1
    with pytest.raises(StorageUnavailable):
        limiter.reset(app)
    assert len(deny_cache) == 1


def test_tiers_follow_the_verified_identity(backend: Backend, clock: FakeClock) -> None:
    limiter = Limiter(clock=clock)
    app, _, _counting = make_app(
        backend(),
        clock,
        limiter=limiter,
        DISTLIMIT_TIERS={"anonymous": "1/minute", "pro": "3/minute"},
        DISTLIMIT_ALGORITHM="fixed_window",
    )

    @limiter.identity_loader
    def load() -> tuple[str, str | None] | None:
        user = request.headers.get("X-Test-User")  # a stand-in for a verified session
        return (user, "pro") if user else None

    app.add_url_rule("/", "index", lambda: "ok")
    client = app.test_client()
    assert [client.get("/").status_code for _ in range(2)] == [200, 429]
    user = {"X-Test-User": "42"}
    assert [client.get("/", headers=user).status_code for _ in range(4)] == [200, 200, 200, 429]


def test_checks_for_names_the_keys_requests_use(backend: Backend, clock: FakeClock) -> None:
    app, limiter, counting = make_app(
        backend(),
        clock,
        DISTLIMIT_GLOBAL_LIMITS="100/minute",
        DISTLIMIT_TIERS={"anonymous": "50/minute", "pro": "500/minute"},
    )
    api = Blueprint("api", __name__)

    @api.route("/r", methods=["GET", "POST"])
    @limiter.limit("10/minute", per_method=True)
    def r() -> str:
        return "ok"

    app.register_blueprint(api)
    client = app.test_client()
    client.get("/r")
    used = {c.key for c in counting.checks[-1]}
    state: LimiterState = app.extensions["distlimit"]
    with app.app_context():
        named = state.checks_for("ip:127.0.0.1")
    assert all(isinstance(c, Check) and c.cost == 0 for _, c in named)
    assert [(row.name, row.check) for row in named] == [tuple(row) for row in named]
    names = {n for n, _ in named}
    assert names == {
        "global:100/minute",
        "tier-anonymous:50/minute",
        "tier-pro:500/minute",
        "api.r:GET:10/minute",
        "api.r:POST:10/minute",
    }
    assert used <= {c.key for _, c in named}
    peek = state.guard.evaluate([c for _, c in named], now_us=clock())
    assert peek.evaluation is not None
    remaining = {n: d.remaining for (n, _), d in zip(named, peek.evaluation.decisions, strict=True)}
    assert remaining["api.r:GET:10/minute"] == 9 and remaining["api.r:POST:10/minute"] == 10


def test_key_parts_match_keys_limit_key(backend: Backend, clock: FakeClock) -> None:
    app, limiter, counting = make_app(backend(), clock, DISTLIMIT_KEY_PREFIX="my:rl")

    @app.get("/k")
    @limiter.limit("7/30 seconds", algorithm="gcra")
    def k() -> str:
        return "ok"

    app.test_client().get("/k")
    (check,) = counting.checks[-1]
    tags = Limiter.state(app).tags
    assert check.key == limit_key("my:rl", "ip:127.0.0.1", "r:k:7/30", "gcra", tags)
    with app.app_context():  # the current app's tags by default
        assert check.key == limit_key("my:rl", "ip:127.0.0.1", "r:k:7/30", "gcra")


def test_local_fallback_reports_reduced_numbers_and_degraded(clock: FakeClock) -> None:
    app, limiter, _ = make_app(
        _Down(),
        clock,
        DISTLIMIT_FAILURE_POLICY="local",
        DISTLIMIT_INSTANCES=4,
        DISTLIMIT_ALGORITHM="fixed_window",
    )

    @app.get("/")
    @limiter.limit("10/minute")
    def index() -> str:
        return "ok"

    client = app.test_client()
    responses = [client.get("/") for _ in range(3)]
    assert [r.status_code for r in responses] == [200, 200, 429]  # floor(10 / 4) = 2
    first = responses[0]
    assert first.headers["X-RateLimit-Degraded"] == "true"
    assert first.headers["X-RateLimit-Limit"] == "2"
    assert first.headers["RateLimit-Policy"] == '"index:10/minute";q=2;w=60'
    assert responses[2].headers["X-RateLimit-Degraded"] == "true"
    assert Limiter.state(app).deny_cache is not None
    assert len(Limiter.state(app).deny_cache) == 0  # fallback answers are never cached


def test_forged_forwarded_for_buys_no_fresh_quota(backend: Backend, clock: FakeClock) -> None:
    app, limiter, _ = make_app(
        backend(),
        clock,
        DISTLIMIT_GLOBAL_LIMITS="2/minute",
        DISTLIMIT_TIERS={"anonymous": "2/minute"},
        DISTLIMIT_ALGORITHM="fixed_window",
    )

    @app.get("/")
    @limiter.limit("2/minute")
    def index() -> str:
        return "ok"

    client = app.test_client()
    statuses = [
        client.get("/", headers={"X-Forwarded-For": f"203.0.113.{i}"}).status_code for i in range(6)
    ]
    assert statuses == [200, 200, 429, 429, 429, 429]


def test_forked_children_reset_the_storage_connections(clock: FakeClock) -> None:
    from flask_distlimit.state import _states
    from flask_distlimit.storage.memory import MemoryStorage

    resets: list[str] = []

    class Spy(MemoryStorage):
        def reset_after_fork(self) -> None:
            resets.append("storage")

    app, _, _ = make_app(Spy(clock=clock), clock)
    _states.in_child()  # what os.register_at_fork runs in a child
    assert resets == ["storage"]
    assert Limiter.state(app).deny_cache is not None


@pytest.mark.slow
def test_unrouted_requests_with_random_methods_do_not_grow_the_plans(
    backend: Backend, clock: FakeClock
) -> None:
    app, _, counting = make_app(backend(), clock, DISTLIMIT_GLOBAL_LIMITS="1000/minute")
    app.add_url_rule("/", "index", lambda: "ok")
    client = app.test_client()
    for i in range(50):
        assert client.open("/", method=f"X{i}").status_code == 405
        assert client.open(f"/missing{i}", method=f"Y{i}").status_code == 404
    assert counting.evaluations == 100  # the global limit covered them all
    # Bound once per rule method at the first request (GET, HEAD, OPTIONS), plus the 404s' one:
    # the 100 made-up methods added none.
    assert set(Limiter.state(app).enforcer._plans) <= {
        ("index", "GET"),
        ("index", "HEAD"),
        ("index", "OPTIONS"),
        (None, ""),
    }


def test_nested_blueprints_and_class_based_views(backend: Backend, clock: FakeClock) -> None:
    from flask.views import MethodView

    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_ALGORITHM="fixed_window")
    parent = Blueprint("parent", __name__, url_prefix="/p")
    child = Blueprint("child", __name__, url_prefix="/c")
    quiet = Blueprint("quiet", __name__, url_prefix="/q")

    @child.get("/leaf")
    def leaf() -> str:
        return "leaf"

    @quiet.get("/leaf")
    def quiet_leaf() -> str:
        return "quiet"

    @limiter.limit("1/minute")
    class Items(MethodView):
        def get(self) -> str:
            return "items"

    limiter.limit("2/minute")(parent)
    limiter.exempt(quiet)
    parent.register_blueprint(child)
    parent.register_blueprint(quiet)
    app.register_blueprint(parent)
    app.add_url_rule("/items", view_func=Items.as_view("items"))
    client = app.test_client()
    assert [client.get("/p/c/leaf").status_code for _ in range(3)] == [200, 200, 429]
    assert [client.get("/p/q/leaf").status_code for _ in range(3)] == [200, 200, 200]
    assert [client.get("/items").status_code for _ in range(2)] == [200, 429]


def test_the_injected_clock_drives_the_breaker(clock: FakeClock) -> None:
    down = _Down()
    app, limiter, counting = make_app(
        down,
        clock,
        DISTLIMIT_BREAKER_FAIL_MAX=2,
        DISTLIMIT_BREAKER_RESET_TIMEOUT=30,
    )
    app.add_url_rule("/", "index", limiter.limit("5/minute")(lambda: "ok"))
    client = app.test_client()
    for _ in range(5):
        assert client.get("/").headers["X-RateLimit-Degraded"] == "true"
    assert counting.evaluations == 2  # the breaker opened after 2 outages
    clock.advance(31)
    client.get("/")
    assert counting.evaluations == 3  # half-open trial, on the fake clock
    with app.app_context():
        assert limiter.health()["breaker"] == "open"


def test_views_from_one_factory_keep_their_own_limits(backend: Backend, clock: FakeClock) -> None:
    import functools

    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_ALGORITHM="fixed_window")

    def make_view(text: str) -> Callable[[], str]:
        def view() -> str:  # every view made here has the same __qualname__
            return text

        return view

    def logged(func: Callable[[], str]) -> Callable[[], str]:
        @functools.wraps(func)
        def wrapper() -> str:
            return func()

        return wrapper

    app.add_url_rule("/one", "one", limiter.limit("1/minute")(make_view("one")))
    app.add_url_rule("/three", "three", logged(limiter.limit("3/minute")(make_view("three"))))
    app.add_url_rule("/free", "free", limiter.exempt(make_view("free")))
    client = app.test_client()
    assert [client.get("/one").status_code for _ in range(2)] == [200, 429]
    assert [client.get("/three").status_code for _ in range(4)] == [200, 200, 200, 429]
    free = client.get("/free")
    assert free.status_code == 200 and "X-RateLimit-Limit" not in free.headers


def test_shared_limit_on_a_blueprint_is_one_counter_for_all_its_routes(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_ALGORITHM="fixed_window")
    admin = Blueprint("admin", __name__, url_prefix="/admin")
    admin.add_url_rule("/a", "a", lambda: "a")
    admin.add_url_rule("/b", "b", lambda: "b")
    limiter.shared_limit("3/minute", scope="admin-area")(admin)
    app.register_blueprint(admin)
    client = app.test_client()
    statuses = [client.get(p).status_code for p in ("/admin/a", "/admin/b") * 2]
    assert statuses == [200, 200, 200, 429]
    assert client.get("/admin/a").headers["RateLimit-Policy"] == '"admin-area:3/minute";q=3;w=60'


@pytest.mark.redis
def test_one_round_trip_per_request_on_a_real_redis(redis_client: Any, clock: FakeClock) -> None:
    import redis as redis_py

    sent: list[int] = []

    class CountingConnection(redis_py.Connection):
        def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            sent.append(1)
            super().send_packed_command(command, check_health)

    kwargs = redis_client.connection_pool.connection_kwargs
    storage = RedisStorage(
        host=kwargs["host"], port=kwargs["port"], connection_class=CountingConnection
    )
    try:
        app, limiter, _ = make_app(
            storage,
            clock,
            DISTLIMIT_GLOBAL_LIMITS="100/minute",
            DISTLIMIT_TIERS={"anonymous": "50/minute"},
        )

        @app.get("/")
        @limiter.limit("10/minute;200/hour")
        @limiter.shared_limit("20/minute", scope="reads")
        def index() -> str:
            return "ok"

        client = app.test_client()
        assert client.get("/").status_code == 200  # connects, loads the script
        sent.clear()
        for _ in range(8):
            assert client.get("/").status_code == 200
        assert len(sent) == 8  # 5 limits per request, 1 round trip each
    finally:
        storage.close()


@pytest.mark.redis
def test_storage_url_from_config(redis_server: Any) -> None:
    app = Flask("url")
    app.config.update(
        DISTLIMIT_STORAGE_URL=redis_server.url,
        DISTLIMIT_REDIS_TIMEOUT=0.5,
        DISTLIMIT_TIERS={"anonymous": ""},
        DISTLIMIT_KEY_PREFIX="urltest",
    )
    limiter = Limiter(app)
    two = limiter.limit("2/minute", algorithm="fixed_window")
    app.add_url_rule("/", "index", two(lambda: "ok"))
    state = Limiter.state(app)
    try:
        assert state.storage.scheme == "redis"
        client = app.test_client()
        assert [client.get("/").status_code for _ in range(3)] == [200, 200, 429]
        assert limiter.reset(app) == 1
    finally:
        state.storage.close()
    default = Flask("default")
    Limiter(default)
    assert Limiter.state(default).storage.scheme == "memory"


def test_concurrent_threads_admit_exactly_the_limit(backend: Backend, clock: FakeClock) -> None:
    import threading

    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_GLOBAL_LIMITS="1000/minute")
    app.add_url_rule("/", "index", limiter.limit("50/minute", algorithm="gcra")(lambda: "ok"))
    statuses: list[int] = []
    lock = threading.Lock()

    def hammer() -> None:
        client = app.test_client()
        for _ in range(20):
            status = client.get("/").status_code
            with lock:
                statuses.append(status)

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(statuses) == 160
    assert statuses.count(200) == 50 and statuses.count(429) == 110


def test_forged_tokens_and_random_api_keys_buy_no_fresh_quota(
    backend: Backend, clock: FakeClock
) -> None:
    import jwt

    limiter = Limiter(clock=clock)
    app, _, _ = make_app(
        backend(),
        clock,
        limiter=limiter,
        DISTLIMIT_TIERS={"anonymous": "2/minute", "internal": "1000/minute"},
        DISTLIMIT_ALGORITHM="fixed_window",
        DISTLIMIT_JWT_KEYS="k" * 32,
        DISTLIMIT_JWT_ALGORITHMS=["HS256"],
        DISTLIMIT_JWT_AUDIENCE="api",
    )
    limiter.api_key_verifier(lambda key: "internal" if key == "the-real-key" else None)
    app.add_url_rule("/", "index", lambda: "ok")
    client = app.test_client()
    exp = int(time.time()) + 3600  # PyJWT checks exp against the real clock
    forged = [
        jwt.encode({"sub": f"u{i}", "tier": "internal", "aud": "api", "exp": exp}, "wrong" * 8)
        for i in range(3)
    ]
    unsigned = jwt.encode({"sub": "x", "tier": "internal", "aud": "api"}, None, algorithm="none")
    attempts = [{"Authorization": f"Bearer {t}"} for t in [*forged, unsigned]]
    attempts += [{"X-Api-Key": f"guess-{i}"} for i in range(3)]
    statuses = [client.get("/", headers=h).status_code for h in attempts]
    assert statuses == [200, 200] + [429] * 5  # all counted as the same anonymous client
    good = jwt.encode({"sub": "alice", "tier": "internal", "aud": "api", "exp": exp}, "k" * 32)
    assert client.get("/", headers={"Authorization": f"Bearer {good}"}).status_code == 200
    assert client.get("/", headers={"X-Api-Key": "the-real-key"}).status_code == 200


def test_an_empty_memory_storage_given_to_init_app_is_the_one_used() -> None:
    """A MemoryStorage has a length, so one with no key yet is falsy: it must still be the
    storage the app uses (with its clock), not be replaced by a new ``memory://``."""
    from flask_distlimit.storage.memory import MemoryStorage

    clock = FakeClock()
    for given_to_limiter in (False, True):
        storage = MemoryStorage(clock=clock)
        assert not storage  # empty: falsy
        app = Flask("empty_memory")
        app.config.update({"DISTLIMIT_TIERS": {"anonymous": ""}})
        limiter = (
            Limiter(clock=clock, storage=storage) if given_to_limiter else Limiter(clock=clock)
        )

        @app.get("/")
        @limiter.limit("2/minute")
        def index() -> str:
            return "ok"

        if given_to_limiter:
            limiter.init_app(app)
        else:
            limiter.init_app(app, storage=storage)
        assert limiter.state(app).storage is storage
        app.test_client().get("/")
        assert len(storage) == 1
