"""Load shedding by priority (issue 13, items 3 and 4): worker utilization (per process, no
storage call) and fleet usage (one Redis key, in the request's storage call). Requests are held
open on events and streamed bodies, never on sleeps.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import pytest
from flask import Blueprint, Flask, Response, abort, g, request
from prometheus_client import CollectorRegistry

from flask_distlimit import ConfigurationError, Limiter
from flask_distlimit.storage.base import Storage
from flask_distlimit.storage.memory import MemoryStorage
from flask_distlimit.telemetry.metrics import metrics_for
from flask_distlimit.testing import CountingStorage, FakeClock
from tests.distlimit_fixtures import backend, clock, make_app

__all__ = ["backend", "clock"]  # fixtures used below

Backend = Callable[[], Storage]
OVERLOADED = "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"


# -- worker utilization ------------------------------------------------------------------------


class Held:
    """Requests held inside their view until ``release``; ``entered`` counts them in."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.entered = threading.Semaphore(0)
        self.threads: list[threading.Thread] = []

    def view(self) -> str:
        self.entered.release()
        assert self.go.wait(30)
        return "held"

    def hold(self, client: object, path: str, n: int) -> None:
        for _ in range(n):
            t = threading.Thread(target=client.get, args=(path,))  # type: ignore[attr-defined]
            t.start()
            self.threads.append(t)
            assert self.entered.acquire(timeout=30)

    def release(self) -> None:
        self.go.set()
        for t in self.threads:
            t.join(30)


@pytest.fixture
def worker_app(clock: FakeClock) -> Iterator[tuple[Flask, Limiter, Held, CountingStorage]]:
    app, limiter, counting = make_app(MemoryStorage(clock=clock), clock, DISTLIMIT_WORKER_THREADS=4)
    held = Held()
    app.add_url_rule("/hold", "hold", limiter.priority("critical")(held.view))

    @app.get("/report")
    @limiter.priority("sheddable")
    @limiter.limit("100/minute")
    def report() -> str:
        return "report"

    @app.get("/page")
    @limiter.limit("100/minute")
    def page() -> str:  # no priority: default
        return "page"

    @app.get("/pay")
    @limiter.priority("critical")
    def pay() -> str:
        return "paid"

    yield app, limiter, held, counting
    held.release()


def test_a_busy_process_sheds_sheddable_then_default_and_never_critical(
    worker_app: tuple[Flask, Limiter, Held, CountingStorage],
) -> None:
    app, _, held, counting = worker_app
    registry = CollectorRegistry()
    Limiter.state(app).guard.use_metrics(metrics_for(registry))
    client = app.test_client()
    paths = ("/report", "/page", "/pay")
    assert [client.get(p).status_code for p in paths] == [200, 200, 200]  # idle
    held.hold(client, "/hold", 1)  # 1 of 4 threads busy: this request would be the 2nd
    assert [client.get(p).status_code for p in paths] == [200, 200, 200]
    held.hold(client, "/hold", 1)  # 2 busy: a sheddable request would make 3 > 0.5 * 4
    assert [client.get(p).status_code for p in paths] == [503, 200, 200]
    held.hold(client, "/hold", 1)  # 3 busy: a default request would make 4 > 0.75 * 4
    calls = counting.evaluations
    shed = client.get("/page")
    assert [shed.status_code, client.get("/report").status_code] == [503, 503]
    assert counting.evaluations == calls  # shed before any storage call
    assert client.get("/pay").status_code == 200  # the last thread is kept for critical
    problem = shed.get_json()
    assert problem["type"] == OVERLOADED and problem["status"] == 503
    assert problem["priority"] == "default" and "sheds default" in problem["detail"]
    assert shed.headers["Retry-After"] == "1"
    assert shed.headers["Content-Type"] == "application/problem+json"
    assert (
        registry.get_sample_value(
            "distlimit_shed_total", {"priority": "sheddable", "reason": "worker"}
        )
        == 2
    )
    assert (
        registry.get_sample_value(
            "distlimit_shed_total", {"priority": "default", "reason": "worker"}
        )
        == 1
    )
    held.release()
    assert [client.get(p).status_code for p in paths] == [200, 200, 200]  # counted out
    assert Limiter.state(app).shedding.load.in_flight == 0  # type: ignore[union-attr]


def test_a_shed_request_is_charged_to_no_limit(
    worker_app: tuple[Flask, Limiter, Held, CountingStorage],
) -> None:
    app, _, held, _ = worker_app
    client = app.test_client()
    held.hold(client, "/hold", 3)
    assert client.get("/report").status_code == 503
    held.release()
    response = client.get("/report")
    assert response.headers["X-RateLimit-Remaining"] == "99"  # the shed one was not counted


def test_a_request_shed_before_the_apps_hooks_is_charged_to_no_global_limit(
    clock: FakeClock,
) -> None:
    """Shed in ``before_request`` (its priority is known before the hooks), the view never
    runs: the global limits, counted for requests no view answers, must not count it either
    (docs/defences.md: a shed request "is charged to no limit")."""
    app, limiter, _ = make_app(
        MemoryStorage(clock=clock), clock,
        DISTLIMIT_WORKER_THREADS=4, DISTLIMIT_GLOBAL_LIMITS="100/minute",
    )  # fmt: skip
    held = Held()
    app.add_url_rule("/hold", "hold", limiter.priority("critical")(held.view))
    app.add_url_rule("/page", "page", lambda: "page")  # default priority, global limits only
    client = app.test_client()
    try:
        held.hold(client, "/hold", 3)  # 3 of 4 busy, each counted by the global limit
        shed = client.get("/page")
        assert shed.status_code == 503
        assert "X-RateLimit-Remaining" not in shed.headers  # no limit decided it
    finally:
        held.release()
    response = client.get("/page")
    assert response.status_code == 200
    assert response.headers["X-RateLimit-Remaining"] == "96"  # 3 held + this one, not the shed


def test_exempt_requests_are_never_shed(
    worker_app: tuple[Flask, Limiter, Held, CountingStorage],
) -> None:
    """Issue 24, finding 3: a health probe got 503 when 3 of 4 threads were busy."""
    app, limiter, held, _ = worker_app

    @app.get("/healthz")
    @limiter.exempt
    def healthz() -> str:
        return "ok"

    probes = Blueprint("probes", __name__)

    @probes.get("/ready")
    def ready() -> str:
        return "ready"

    limiter.exempt(probes)
    app.register_blueprint(probes)

    @limiter.request_filter
    def internal() -> bool:
        return request.headers.get("X-Internal") == "yes"

    client = app.test_client()
    held.hold(client, "/hold", 3)  # 3 of 4 busy: every default request is shed
    assert client.get("/page").status_code == 503
    assert client.get("/healthz").status_code == 200
    assert client.get("/ready").status_code == 200
    assert client.get("/page", headers={"X-Internal": "yes"}).status_code == 200
    state = Limiter.state(app)
    assert state.shedding.load is not None and state.shedding.load.in_flight == 3
    held.release()
    assert state.shedding.load.in_flight == 0


def test_the_priority_resolver_sees_what_the_apps_hooks_set(
    worker_app: tuple[Flask, Limiter, Held, CountingStorage],
) -> None:
    """Issue 24, finding 8: under worker shedding the resolver ran before the app's auth hook,
    so an authenticated admin was shed as ``default``."""
    app, limiter, held, _ = worker_app

    @app.before_request
    def authenticate() -> None:  # registered after init_app: runs after the extension's hook
        g.user = request.headers.get("X-User")

    @limiter.priority_resolver
    def by_user() -> str | None:
        return "critical" if getattr(g, "user", None) == "admin" else None

    @app.get("/orders")
    def orders() -> str:
        return "orders"

    client = app.test_client()
    held.hold(client, "/hold", 3)  # 3 of 4 busy: default is shed, critical is not
    assert client.get("/orders").status_code == 503
    assert client.get("/orders", headers={"X-User": "admin"}).status_code == 200
    held.release()


def test_fleet_shedding_sees_the_hooks_priority_under_worker_shedding_too(
    clock: FakeClock,
) -> None:
    app, limiter, _ = make_app(
        MemoryStorage(clock=clock), clock, DISTLIMIT_WORKER_THREADS=100, DISTLIMIT_FLEET_CAPACITY=10
    )

    @app.before_request
    def authenticate() -> None:
        g.user = request.headers.get("X-User")

    @limiter.priority_resolver
    def by_user() -> str | None:
        return "critical" if getattr(g, "user", None) == "admin" else None

    @app.get("/stream")
    def stream() -> Response:
        return Response(iter(["chunk"]))

    client = app.test_client()
    held = [client.get("/stream") for _ in range(8)]  # default's share: 8 of 10
    assert [r.status_code for r in held] == [200] * 8
    with client.get("/stream") as shed:
        assert shed.status_code == 503 and shed.get_json()["priority"] == "default"
    with client.get("/stream", headers={"X-User": "admin"}) as admin:
        assert admin.status_code == 200  # critical: the reserve
    for response in held:
        response.close()


def test_a_streamed_response_holds_its_thread_until_it_is_closed(clock: FakeClock) -> None:
    app, limiter, _ = make_app(MemoryStorage(clock=clock), clock, DISTLIMIT_WORKER_THREADS=2)

    @app.get("/export")
    def export() -> Response:
        return Response(iter(["a", "b"]))

    @app.get("/page")
    @limiter.priority("sheddable")
    def page() -> str:
        return "page"

    client = app.test_client()
    streaming = client.get("/export", buffered=False)
    assert client.get("/page").status_code == 503  # 2 of 2 threads: over 0.5
    streaming.close()
    assert client.get("/page").status_code == 200


def test_the_priority_resolver_decides_for_views_without_a_priority(clock: FakeClock) -> None:
    app, limiter, _ = make_app(MemoryStorage(clock=clock), clock, DISTLIMIT_WORKER_THREADS=2)

    @limiter.priority_resolver
    def by_method() -> str | None:
        return "critical" if request.method == "POST" else request.args.get("p")

    @app.route("/payments", methods=["GET", "POST"])
    def payments() -> Response:
        return Response(iter(["ok"]))

    client = app.test_client()
    first = client.post("/payments", buffered=False)  # holds 1 of the 2 threads
    with client.post("/payments") as critical:
        assert critical.status_code == 200  # critical: never shed
    assert client.get("/payments?p=sheddable").status_code == 503
    assert client.get("/payments").status_code == 503  # None: default; 2 > 0.75 * 2
    first.close()
    assert client.get("/payments").status_code == 200


@pytest.mark.parametrize("answer", ["raise", "urgent", 7])
def test_a_priority_resolver_that_fails_gives_default_and_an_error_line_never_a_500(
    clock: FakeClock, caplog: pytest.LogCaptureFixture, answer: object
) -> None:
    app, limiter, _ = make_app(MemoryStorage(clock=clock), clock, DISTLIMIT_WORKER_THREADS=2)

    @limiter.priority_resolver
    def broken() -> object:
        if request.args.get("auth") == "no":
            abort(401)  # the app's own answer: given as it is
        if answer == "raise":
            raise KeyError("tenant")
        return answer

    @app.get("/orders")
    def orders() -> Response:
        return Response(iter(["ok"]))

    client = app.test_client()
    with caplog.at_level(logging.ERROR, logger="flask_distlimit"):
        first = client.get("/orders", buffered=False)  # holds 1 of the 2 threads, as default
        assert first.status_code == 200
        assert client.get("/orders").status_code == 503  # default: 2 > 0.75 * 2
        first.close()
        assert client.get("/orders").status_code == 200
    lines = [r for r in caplog.records if "priority resolver" in r.getMessage()]
    assert len(lines) == 1  # at most once a minute
    assert "default" in lines[0].getMessage()
    assert client.get("/orders?auth=no").status_code == 401


def test_a_bad_priority_is_refused_when_declared() -> None:
    with pytest.raises(ConfigurationError, match="not a priority"):
        Limiter().priority("urgent")


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("DISTLIMIT_WORKER_THREADS", -1),
        ("DISTLIMIT_WORKER_THREADS", "4"),
        ("DISTLIMIT_WORKER_SHED_AT", {"sheddable": 0}),
        ("DISTLIMIT_WORKER_SHED_AT", {"sheddable": 1.5}),
        ("DISTLIMIT_WORKER_SHED_AT", {"urgent": 0.5}),
        ("DISTLIMIT_WORKER_SHED_AT", {"sheddable": 0.9, "default": 0.5}),
        ("DISTLIMIT_WORKER_SHED_AT", [0.5]),
        ("DISTLIMIT_FLEET_CAPACITY", 10_001),
        ("DISTLIMIT_FLEET_SHARES", {"critical": 1.0, "default": 0.8}),
        ("DISTLIMIT_FLEET_SHARES", {"critical": 0.5, "default": 0.8, "sheddable": 0.6}),
    ],
    ids=repr,
)
def test_bad_shedding_settings_are_refused_at_start_up(
    clock: FakeClock, key: str, value: object
) -> None:
    with pytest.raises(ConfigurationError, match=key):
        make_app(MemoryStorage(clock=clock), clock, **{key: value})


# -- fleet usage -------------------------------------------------------------------------------


def _fleet_app(storage: Storage, clock: FakeClock, name: str = "app") -> tuple[Flask, Limiter]:
    app, limiter, _ = make_app(storage, clock, name=name, DISTLIMIT_FLEET_CAPACITY=10)

    @limiter.priority_resolver
    def from_query() -> str | None:
        return request.args.get("p")

    @app.get("/stream")
    def stream() -> Response:
        return Response(iter(["chunk"]))

    @app.get("/health")
    @limiter.exempt
    def health() -> str:
        return "ok"

    return app, limiter


def test_the_fleet_sheds_by_priority_across_instances(backend: Backend, clock: FakeClock) -> None:
    """Two instances on one store: sheddable fills 6 of 10 slots, default 8, critical 10."""
    apps = [_fleet_app(backend(), clock, name=f"app{i}")[0] for i in (0, 1)]
    clients = [a.test_client() for a in apps]
    held = []

    def take(p: str) -> int:
        client = clients[len(held) % 2]
        response = client.get(f"/stream?p={p}", buffered=False)
        if response.status_code == 200:
            held.append(response)
        return response.status_code

    assert [take("sheddable") for _ in range(7)] == [200] * 6 + [503]
    assert [take("default") for _ in range(3)] == [200, 200, 503]
    assert take("sheddable") == 503
    assert [take("critical") for _ in range(3)] == [200, 200, 503]
    shed = clients[0].get("/stream?p=default")
    assert shed.status_code == 503 and shed.get_json()["priority"] == "default"
    assert "service is" in shed.get_json()["detail"] and shed.headers["Retry-After"] == "1"
    assert clients[1].get("/health").status_code == 200  # exempt: never counted nor shed
    health = Limiter.state(apps[0]).health()
    assert health["fleet"] == {
        "capacity": 10,
        "in_flight": 10,
        "utilization": 1.0,
        "slots": {"critical": 10, "default": 8, "sheddable": 6},
    }
    for response in held[:5]:
        response.close()  # their slots come back
    assert Limiter.state(apps[1]).health()["fleet"]["in_flight"] == 5  # type: ignore[index]
    assert take("sheddable") == 200
    for response in held:
        response.close()


def test_the_fleet_counts_requests_that_are_not_streamed_until_they_end(
    backend: Backend, clock: FakeClock
) -> None:
    app, _ = _fleet_app(backend(), clock)

    @app.get("/plain")
    def plain() -> str:
        return "plain"

    client = app.test_client()
    for _ in range(20):
        with client.get("/plain?p=sheddable") as response:  # closed, as a server closes it
            assert response.status_code == 200
    assert Limiter.state(app).health()["fleet"]["in_flight"] == 0  # type: ignore[index]
    # Issue 34: a complete body holds its fleet slot until the server has sent it.
    unsent = client.get("/plain?p=sheddable")
    assert Limiter.state(app).health()["fleet"]["in_flight"] == 1  # type: ignore[index]
    assert unsent.get_data() == b"plain"  # the server asks past the last chunk
    assert Limiter.state(app).health()["fleet"]["in_flight"] == 0  # type: ignore[index]
