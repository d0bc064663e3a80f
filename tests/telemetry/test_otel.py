"""OpenTelemetry metrics (flask_distlimit.telemetry.otel, issue 27): read back with the SDK's
InMemoryMetricReader, on memory, fakeredis and a real redis-server; on by itself when the API is
installed and a global provider is set (a subprocess: the global provider is set once per
process); nothing at all without the API; beside the Prometheus metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from flask import Flask, Response, send_file
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry

from flask_distlimit import Limiter
from flask_distlimit.core.decision import Evaluation
from flask_distlimit.errors import StorageReplyLost, StorageUnavailable
from flask_distlimit.storage.base import Storage
from flask_distlimit.telemetry import otel
from flask_distlimit.telemetry.metrics import (
    SINK_METHODS,
    Metrics,
    OnePer,
    metrics_for,
    storage_outcome,
)
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import backend, clock, make_app

__all__ = ["backend", "clock"]

Backend = Callable[[], Storage]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def reader() -> Iterator[tuple[InMemoryMetricReader, MeterProvider]]:
    found = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[found])
    yield found, provider
    provider.shutdown()


def points(reader: InMemoryMetricReader, name: str) -> list[tuple[dict[str, Any], Any]]:
    """``(attributes, value)`` of each data point of ``name`` (a histogram's value: its
    count)."""
    data = reader.get_metrics_data()
    found: list[tuple[dict[str, Any], Any]] = []
    if data is None:
        return found
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name != name:
                    continue
                for p in metric.data.data_points:
                    value = getattr(p, "value", None)
                    found.append(
                        (
                            dict(p.attributes or {}),
                            getattr(p, "count", None) if value is None else value,
                        )
                    )
    return found


def requests_by(reader: InMemoryMetricReader) -> dict[tuple[str, bool, str | None], int]:
    return {
        (a["distlimit.result"], a["distlimit.degraded"], a.get("distlimit.policy")): v
        for a, v in points(reader, "distlimit.requests")
    }


def _instrumented(
    storage: Storage, clock: FakeClock, provider: MeterProvider, **config: Any
) -> tuple[Flask, Limiter]:
    app, limiter, _ = make_app(storage, clock, **config)
    with app.app_context():
        otel.instrument(limiter.state(app), meter_provider=provider)
    return app, limiter


def test_requests_are_counted_by_result_and_declared_policy(
    backend: Backend, clock: FakeClock, reader: tuple[InMemoryMetricReader, MeterProvider]
) -> None:
    found, provider = reader
    app, limiter = _instrumented(backend(), clock, provider, DISTLIMIT_ALGORITHM="fixed_window")

    @app.get("/orders/<int:n>")
    @limiter.limit("2/minute", key_func=lambda: "tenant-a")
    @limiter.limit("5/minute;2/second", shadow=True)
    def orders(n: int) -> str:
        return "ok"

    client = app.test_client()
    assert [client.get(f"/orders/{n}").status_code for n in range(4)] == [200, 200, 429, 429]
    assert requests_by(found) == {
        ("admitted", False, "orders:2/minute"): 2,
        ("refused", False, "orders:2/minute"): 2,
    }
    # the client's values (key_func's "tenant-a", the path's numbers) are in no attribute
    every = [a for name in ("distlimit.requests", "distlimit.decisions")
             for a, _ in points(found, name)]  # fmt: skip
    assert every and not any("tenant-a" in str(a) or "/orders/" in str(a) for a in every)
    shadow = {a["distlimit.limit"]: v for a, v in points(found, "distlimit.shadow.refusals")}
    assert list(shadow.values()) == [1]  # the third request: the shadow 2/second would refuse
    assert "2/1" in next(iter(shadow))
    durations = points(found, "distlimit.storage.duration")
    assert [a for a, _ in durations] == [{"distlimit.outcome": "ok"}]
    assert durations[0][1] == 3  # the 4th was answered by the deny cache, without a call


class _Down(Storage):
    scheme = "down"

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def evaluate(self, checks: object, *, now_us: int | None = None) -> Evaluation:
        raise self.exc

    def ping(self) -> float:
        raise self.exc

    def scan(self, match: str) -> list[str]:  # type: ignore[override]
        return []

    def delete(self, keys: object) -> int:
        return 0

    def heartbeat(self, key: str, member: str, ttl: float) -> int:
        raise self.exc


def test_an_outage_is_unavailable_or_degraded_and_the_breaker_is_a_gauge(
    clock: FakeClock, reader: tuple[InMemoryMetricReader, MeterProvider]
) -> None:
    found, provider = reader
    timeout = StorageUnavailable("Redis is unavailable: TimeoutError: Timeout reading")
    timeout.__cause__ = TimeoutError("Timeout reading from 127.0.0.1:6379")
    app, limiter = _instrumented(_Down(timeout), clock, provider, DISTLIMIT_BREAKER_FAIL_MAX=2)
    app.add_url_rule("/open", "open", limiter.limit("5/minute")(lambda: "ok"))
    app.add_url_rule(
        "/closed", "closed", limiter.limit("5/minute", on_failure="closed")(lambda: "ok")
    )
    client = app.test_client()
    assert client.get("/open").status_code == 200
    assert client.get("/closed").status_code == 503
    assert client.get("/closed").status_code == 503  # the breaker is open now: no call
    assert requests_by(found) == {
        ("admitted", True, None): 1,  # the open policy answered: no limit decided it
        ("unavailable", True, None): 2,
    }
    durations = points(found, "distlimit.storage.duration")
    assert [(a, n) for a, n in durations] == [({"distlimit.outcome": "timeout"}, 2)]
    assert points(found, "distlimit.breaker.state") == [({"distlimit.node": "down:ratelimit"}, 2)]


def test_storage_outcomes() -> None:
    assert storage_outcome(None) == "ok"
    refused = StorageUnavailable("Redis is unavailable: ConnectionError")
    refused.__cause__ = ConnectionRefusedError()
    assert storage_outcome(refused) == "error"
    lost = StorageReplyLost("reply lost")
    assert storage_outcome(lost) == "error"
    import redis

    timed = StorageUnavailable("Redis is unavailable")
    timed.__cause__ = redis.exceptions.TimeoutError("Timeout reading")
    assert storage_outcome(timed) == "timeout"


def test_concurrency_slots_held_go_up_and_come_back(
    backend: Backend, clock: FakeClock, reader: tuple[InMemoryMetricReader, MeterProvider]
) -> None:
    found, provider = reader
    app, limiter = _instrumented(backend(), clock, provider)
    during: list[list[tuple[dict[str, Any], Any]]] = []

    @app.get("/slow")
    @limiter.concurrency(2)
    def slow() -> str:
        during.append(points(found, "distlimit.concurrency.slots"))
        return "ok"

    client = app.test_client()
    response = client.get("/slow")
    assert response.status_code == 200
    response.close()  # what the WSGI server does once the body is sent
    ((attributes, held),) = during[0]
    assert held == 1 and attributes["distlimit.limit"].endswith(":concurrency")
    ((_, after),) = points(found, "distlimit.concurrency.slots")
    assert after == 0


def test_the_slot_gauge_comes_back_after_send_file_downloads(
    backend: Backend,
    clock: FakeClock,
    reader: tuple[InMemoryMetricReader, MeterProvider],
    tmp_path: Path,
) -> None:
    """Issue 34, finding 2: the gauge went down in the response's ``close()``, which a
    ``send_file`` response never reaches (werkzeug serves its file directly): after 10
    downloads it read 10 with no slot held. It now goes down with the slots, by the ledger."""
    found, provider = reader
    app, limiter = _instrumented(backend(), clock, provider)
    download = tmp_path / "report.csv"
    download.write_bytes(b"a,b\n" * 1000)

    @app.get("/download")
    @limiter.concurrency(2)
    def fetch() -> Any:
        return send_file(download)

    client = app.test_client()
    for _ in range(10):
        with client.get("/download") as response:  # closed, as a server closes it
            assert response.get_data() == download.read_bytes()
    ((attributes, after),) = points(found, "distlimit.concurrency.slots")
    assert after == 0 and attributes["distlimit.limit"].endswith(":concurrency")


def test_the_slot_gauge_comes_back_when_another_after_request_hook_raises(
    backend: Backend, clock: FakeClock, reader: tuple[InMemoryMetricReader, MeterProvider]
) -> None:
    """An app's ``after_request`` hook registered after the limiter's runs before it; when it
    raises, Flask answers a 500 without the limiter's hook. The slots are given back by the
    request's ledger all the same, and the gauge with them (it went down in the limiter's
    ``after_request``: it read 1 per such request, with no slot held)."""
    found, provider = reader
    app, limiter = _instrumented(backend(), clock, provider)
    app.config["PROPAGATE_EXCEPTIONS"] = False  # a 500, as in production

    @app.get("/slow")
    @limiter.concurrency(2)
    def slow() -> str:
        return "ok"

    @app.after_request
    def broken(response: Response) -> Response:
        raise RuntimeError("the app's own hook fails")

    client = app.test_client()
    for _ in range(3):
        with client.get("/slow") as response:
            assert response.status_code == 500
    ((attributes, after),) = points(found, "distlimit.concurrency.slots")
    assert after == 0 and attributes["distlimit.limit"].endswith(":concurrency")


def test_a_request_is_counted_once_when_an_after_request_hook_raises(
    backend: Backend, clock: FakeClock, reader: tuple[InMemoryMetricReader, MeterProvider]
) -> None:
    """An app's ``after_request`` hook that runs before the limiter's and raises leaves Flask
    answering a 500 without the limiter's hook: each request is counted all the same, with the
    limiter's result (it was counted in the limiter's ``after_request``: not at all). One that
    runs after the limiter's makes Flask finalize the 500 again, through the limiter's hook a
    second time: each request is still counted once."""
    found, provider = reader
    app, limiter = _instrumented(backend(), clock, provider, DISTLIMIT_ALGORITHM="fixed_window")
    app.config["PROPAGATE_EXCEPTIONS"] = False  # a 500, as in production

    @app.get("/orders")
    @limiter.limit("2/minute")
    def orders() -> str:
        return "ok"

    def broken(response: Response) -> Response:
        raise RuntimeError("the app's own hook fails")

    client = app.test_client()
    app.after_request(broken)  # registered after the limiter's: runs before it
    for _ in range(3):
        assert client.get("/orders").status_code == 500
    assert requests_by(found) == {
        ("admitted", False, "orders:2/minute"): 2,
        ("refused", False, "orders:2/minute"): 1,
    }
    hooks = app.after_request_funcs[None]
    hooks.remove(broken)
    hooks.insert(0, broken)  # first registered: runs after the limiter's
    assert client.get("/orders").status_code == 500
    assert requests_by(found) == {
        ("admitted", False, "orders:2/minute"): 2,
        ("refused", False, "orders:2/minute"): 2,
    }


def test_a_request_whose_view_raises_through_the_server_is_counted_once(
    backend: Backend, clock: FakeClock, reader: tuple[InMemoryMetricReader, MeterProvider]
) -> None:
    """With exceptions propagating (``TESTING``, or a WSGI middleware that handles them), the
    app raises to its WSGI wrapper and no ``after_request`` hook sees a response: the request
    is counted all the same, once, with the limiter's result; an exempt one is not."""
    found, provider = reader
    app, limiter = _instrumented(backend(), clock, provider, DISTLIMIT_ALGORITHM="fixed_window")
    app.config["PROPAGATE_EXCEPTIONS"] = True

    @app.get("/orders")
    @limiter.limit("1/minute")
    def orders() -> str:
        raise RuntimeError("the view fails")

    @app.get("/health")
    @limiter.exempt
    def health() -> str:
        raise RuntimeError("the view fails")

    client = app.test_client()
    for path in ("/orders", "/health"):
        with pytest.raises(RuntimeError, match="the view fails"):
            client.get(path)
    assert client.get("/orders").status_code == 429
    assert requests_by(found) == {
        ("admitted", False, "orders:1/minute"): 1,
        ("refused", False, "orders:1/minute"): 1,
    }


def test_an_instrument_that_raises_never_fails_the_request_nor_keeps_its_slot(
    backend: Backend,
    clock: FakeClock,
    reader: tuple[InMemoryMetricReader, MeterProvider],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The request's count runs in the WSGI wrapper, after the app made the response and before
    the wrapper hands the body on: an SDK instrument that raises there is logged, and the
    response and the release of what the request held go on."""
    _, provider = reader
    app, limiter = _instrumented(backend(), clock, provider)

    @app.get("/one")
    @limiter.concurrency(1)
    def one() -> str:
        return "ok"

    class Broken:
        def add(self, amount: int, attributes: Any = None) -> None:
            raise ValueError("the exporter's view is broken")

    limiter.state(app).otel.instruments.made["requests"] = Broken()  # type: ignore[union-attr]
    client = app.test_client()
    for _ in range(3):  # a slot kept by the first would refuse the second
        with client.get("/one") as response:
            assert (response.status_code, response.get_data()) == (200, b"ok")
    assert caplog.text.count("OpenTelemetry failed to count a request") == 3


def test_a_concurrency_refusal_names_the_slot_limit(
    backend: Backend, clock: FakeClock, reader: tuple[InMemoryMetricReader, MeterProvider]
) -> None:
    found, provider = reader
    app, limiter = _instrumented(backend(), clock, provider)
    inner: list[int] = []

    @app.get("/one")
    @limiter.concurrency(1)
    def one() -> str:
        if not inner:
            inner.append(app.test_client().get("/one").status_code)
        return "ok"

    assert app.test_client().get("/one").status_code == 200 and inner == [429]
    assert requests_by(found) == {
        ("refused", False, "one:1 in flight"): 1,
        ("admitted", False, None): 1,  # no rate limit: nothing closest to denial
    }


def test_beside_prometheus_both_are_told(
    clock: FakeClock, reader: tuple[InMemoryMetricReader, MeterProvider]
) -> None:
    """``use_metrics(metrics_for(...))`` after init_app (the documented way) keeps OTel on."""
    from flask_distlimit.storage.memory import MemoryStorage

    found, provider = reader
    app, limiter = _instrumented(MemoryStorage(clock=clock), clock, provider)
    registry = CollectorRegistry()
    with app.app_context():
        limiter.state(app).guard.use_metrics(metrics_for(registry))
    app.add_url_rule("/", "index", limiter.limit("1/minute")(lambda: "ok"))
    client = app.test_client()
    assert [client.get("/").status_code for _ in range(2)] == [200, 429]
    assert registry.get_sample_value("distlimit_storage_latency_seconds_count") == 2
    decided = {a["distlimit.outcome"]: v for a, v in points(found, "distlimit.decisions")}
    assert decided == {"allowed": 1, "denied": 1}
    assert sum(v for _, v in points(found, "distlimit.requests")) == 2


def test_a_sink_added_by_two_threads_at_once_is_told_once(
    reader: tuple[InMemoryMetricReader, MeterProvider], clock: FakeClock
) -> None:
    """The first requests after a provider is set may wake the hook in several threads: the
    instruments join the guard's sinks once, or every count after would be doubled."""
    from flask_distlimit.storage.memory import MemoryStorage

    found, provider = reader
    app, limiter, _ = make_app(MemoryStorage(clock=clock), clock)
    app.add_url_rule("/", "index", limiter.limit("5/minute")(lambda: "ok"))
    guard = limiter.state(app).guard
    instruments = otel.OTelMetrics(provider)

    class Interleaved(list[Any]):
        """A sinks list that lets a second thread add the sink between a check and an add."""

        other_ran = False

        def __contains__(self, sink: object) -> bool:
            found = super().__contains__(sink)
            if not Interleaved.other_ran:
                Interleaved.other_ran = True
                guard.add_sink(sink)  # type: ignore[arg-type]
            return found

    guard._sinks = Interleaved()
    guard.add_sink(instruments)  # old code: [instruments, instruments], every count doubled
    assert guard.metrics is instruments
    assert app.test_client().get("/").status_code == 200
    decided = [v for _, v in points(found, "distlimit.decisions")]
    assert decided == [1]


def test_instrumenting_and_detaching_write_nothing_onto_the_guard(
    reader: tuple[InMemoryMetricReader, MeterProvider],
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys as _sys

    from flask_distlimit.storage.memory import MemoryStorage

    _, provider = reader
    app, limiter = _instrumented(MemoryStorage(clock=clock), clock, provider)
    with app.app_context():
        state = limiter.state(app)
    guard = state.guard
    written: list[tuple[str, str]] = []  # (the writing module, the attribute) from outside
    real = type(guard).__setattr__

    def spy(self: Any, name: str, value: Any) -> None:
        writer = _sys._getframe(1).f_globals["__name__"]
        if not writer.startswith("flask_distlimit.resilience."):
            written.append((writer, name))
        real(self, name, value)

    monkeypatch.setattr(type(guard), "__setattr__", spy)
    prometheus = metrics_for(CollectorRegistry())
    guard.use_metrics(prometheus)
    otel.instrument(state, meter_provider=MeterProvider())  # another provider: a new hook
    state.otel.detach()  # type: ignore[union-attr]
    assert written == []  # old code: otel wrote guard.compose_metrics
    assert guard.metrics is prometheus


def test_each_instrument_is_declared_once_for_both_sides() -> None:
    from flask_distlimit.telemetry.metrics import INSTRUMENTS

    attributes = [row[0] for row in INSTRUMENTS]
    assert len(attributes) == len(set(attributes))
    registry = CollectorRegistry()
    Metrics(registry)
    exported = {m.name for m in registry.collect()}
    assert exported == {row[2] for row in INSTRUMENTS if row[2] is not None}


def test_the_sink_answers_every_method_the_prometheus_metrics_answer() -> None:
    """The guard is typed with the Prometheus class; what it calls must exist on both."""
    public = {n for n in dir(Metrics) if not n.startswith("_") and callable(getattr(Metrics, n))}
    assert public - {"add"} == set(SINK_METHODS)  # add: how each side counts
    for name in SINK_METHODS:
        assert callable(getattr(otel.OTelMetrics, name))


def test_nothing_runs_without_the_api(monkeypatch: pytest.MonkeyPatch, clock: FakeClock) -> None:
    import importlib.util

    from flask_distlimit.storage.memory import MemoryStorage

    real = importlib.util.find_spec

    def hidden(name: str, *args: Any) -> Any:
        return None if name.startswith("opentelemetry") else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", hidden)
    app, limiter, _ = make_app(MemoryStorage(clock=clock), clock)
    with app.app_context():
        state = limiter.state(app)
    assert state.otel is None and state.guard.metrics is None


_GLOBAL_PROVIDER = """
import json
from flask import Flask
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from flask_distlimit import Limiter

app = Flask("auto")
app.config.update(DISTLIMIT_STORAGE_URL="memory://", DISTLIMIT_ALGORITHM="fixed_window")
limiter = Limiter(app)          # before the provider is set: the API's proxy takes it later
app.add_url_rule("/", "index", limiter.limit("2/minute")(lambda: "ok"))
client = app.test_client()
guard = limiter.state(app).guard
codes = [client.get("/").status_code]  # no provider yet: the guard tells no instruments
idle = guard.metrics is None
reader = InMemoryMetricReader()
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
codes += [client.get("/").status_code for _ in range(2)]
found = {}
for rm in reader.get_metrics_data().resource_metrics:
    for sm in rm.scope_metrics:
        for m in sm.metrics:
            if m.name == "distlimit.requests":
                for p in m.data.data_points:
                    found[p.attributes["distlimit.result"]] = p.value
told = guard.metrics is not None
print(json.dumps({"codes": codes, "requests": found, "idle": idle, "told": told}))
"""


@pytest.mark.slow
def test_on_by_itself_with_the_global_provider() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", _GLOBAL_PROVIDER],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    # the first request, before any provider: nothing told, nothing counted (the API's proxy
    # would drop it); the next request to end wakes the instruments, and is counted
    assert got == {
        "codes": [200, 200, 429],
        "requests": {"admitted": 1, "refused": 1},
        "idle": True,
        "told": True,
    }


def test_detached_instruments_count_no_more_requests(
    clock: FakeClock, reader: tuple[InMemoryMetricReader, MeterProvider]
) -> None:
    from flask_distlimit.storage.memory import MemoryStorage

    found, provider = reader
    app, limiter = _instrumented(MemoryStorage(clock=clock), clock, provider)
    app.add_url_rule("/", "index", limiter.limit("5/minute")(lambda: "ok"))
    client = app.test_client()
    assert client.get("/").status_code == 200
    limiter.state(app).otel.detach()  # type: ignore[union-attr]
    assert [client.get("/").status_code for _ in range(2)] == [200, 200]
    assert [v for _, v in points(found, "distlimit.requests")] == [1]  # old code: 3
    assert limiter.state(app).guard.metrics is None


def test_shared_instruments_are_made_once_per_provider(
    clock: FakeClock, reader: tuple[InMemoryMetricReader, MeterProvider]
) -> None:
    """Two apps, one provider: one set of instruments, each request counted once."""
    from flask_distlimit.storage.memory import MemoryStorage

    found, provider = reader
    apps = [
        _instrumented(MemoryStorage(clock=clock), clock, provider, name=f"a{i}") for i in range(2)
    ]
    for app, limiter in apps:
        app.add_url_rule("/", "index", limiter.limit("5/minute")(lambda: "ok"))
    threads = [threading.Thread(target=lambda a=app: a.test_client().get("/")) for app, _ in apps]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(v for _, v in points(found, "distlimit.requests")) == 2


def test_a_request_shed_by_the_worker_is_counted_once(
    clock: FakeClock, reader: tuple[InMemoryMetricReader, MeterProvider]
) -> None:
    from flask_distlimit.storage.memory import MemoryStorage

    found, provider = reader
    shed_at = {"critical": 0.5, "default": 0.5, "sheddable": 0.5}  # one thread: none gets in
    app, _ = _instrumented(
        MemoryStorage(clock=clock),
        clock,
        provider,
        DISTLIMIT_GLOBAL_LIMITS="100/minute",
        DISTLIMIT_WORKER_THREADS=1,
        DISTLIMIT_WORKER_SHED_AT=shed_at,
    )
    app.add_url_rule("/", "index", lambda: "ok")
    assert app.test_client().get("/").status_code == 503
    ((attributes, value),) = points(found, "distlimit.requests")
    assert value == 1 and attributes["distlimit.result"] == "shed"
    assert attributes["distlimit.shed.reason"] == "worker"


def test_an_api_too_old_warns_and_the_app_still_starts(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """opentelemetry-api before 1.23 has no bucket advice: creating the histogram raises."""
    from flask_distlimit.storage.memory import MemoryStorage

    def too_old(self: otel.OTelMetrics, meter_provider: Any = None) -> None:
        raise TypeError("create_histogram() got an unexpected keyword argument")

    monkeypatch.setattr(otel.OTelMetrics, "__init__", too_old)
    monkeypatch.setattr(otel, "_instruments_for", OnePer(otel.OTelMetrics))  # none made yet
    app, limiter, _ = make_app(MemoryStorage(clock=clock), clock)
    app.add_url_rule("/", "index", limiter.limit("1/minute")(lambda: "ok"))
    assert app.test_client().get("/").status_code == 200
    with app.app_context():
        assert limiter.state(app).otel is None
    assert "opentelemetry-api>=1.45" in caplog.text and "metrics are off" in caplog.text


def test_exempt_requests_are_not_counted(
    clock: FakeClock, reader: tuple[InMemoryMetricReader, MeterProvider]
) -> None:
    from flask_distlimit.storage.memory import MemoryStorage

    found, provider = reader
    app, limiter = _instrumented(
        MemoryStorage(clock=clock), clock, provider, DISTLIMIT_GLOBAL_LIMITS="10/minute"
    )
    app.add_url_rule("/free", "free", limiter.exempt(lambda: "ok"))
    app.add_url_rule("/", "index", lambda: "ok")
    client = app.test_client()
    assert client.get("/free").status_code == 200
    assert client.get("/").status_code == 200
    assert requests_by(found) == {("admitted", False, "global:10/minute"): 1}


def test_units_settled_are_counted_by_limit_and_unit(
    backend: Backend, clock: FakeClock, reader: tuple[InMemoryMetricReader, MeterProvider]
) -> None:
    """Issue 35: what requests really cost on limits settled after the response, in the limit's
    unit, on both sinks: tokens a ``settle`` answers, bytes a body sent (a stream's too)."""
    found, provider = reader
    app, limiter = _instrumented(backend(), clock, provider)
    registry = CollectorRegistry()
    with app.app_context():
        limiter.state(app).guard.use_metrics(metrics_for(registry))

    @app.get("/complete")
    @limiter.limit("100/day", cost=10, settle=lambda response: 3)
    def complete() -> str:
        return "ok"

    @app.get("/page")
    @limiter.limit("1000/hour", unit="content-bytes")
    def page() -> Response:
        return Response(iter([b"x" * 100, b"y" * 50]))

    client = app.test_client()
    for path in ("/complete", "/complete", "/page"):
        with client.get(path) as response:
            assert response.status_code == 200
            response.get_data()
    expected = {"requests": 6, "content-bytes": 150}
    settled = {a["distlimit.unit"]: v for a, v in points(found, "distlimit.settled.units")}
    assert settled == expected
    prometheus = {
        unit: sum(
            s.value
            for metric in registry.collect()
            for s in metric.samples
            if s.name == "distlimit_settled_units_total" and s.labels["unit"] == unit
        )
        for unit in expected
    }
    assert prometheus == expected


def test_an_admitted_request_makes_two_telemetry_calls(
    clock: FakeClock, reader: tuple[InMemoryMetricReader, MeterProvider]
) -> None:
    """Issue 36: the storage call's latency and decisions are told in one call, each decision
    counted in place; after_request counts the request. It was 5 calls (storage_call,
    evaluated, add per decision, request)."""
    from flask_distlimit.storage.memory import MemoryStorage

    found, provider = reader
    app, limiter = _instrumented(
        MemoryStorage(clock=clock), clock, provider, DISTLIMIT_GLOBAL_LIMITS="100/minute"
    )
    app.add_url_rule("/", "index", limiter.limit("10/second")(lambda: "ok"))
    client = app.test_client()
    client.get("/").close()  # the series' counters are made on the first request
    telemetry = os.path.dirname(otel.__file__)  # the package imported, wherever it is
    calls: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(telemetry):
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        assert client.get("/").status_code == 200
    finally:
        sys.setprofile(None)
    assert calls == ["evaluated", "request"]
    decided = {a["distlimit.limit"]: v for a, v in points(found, "distlimit.decisions")}
    assert len(decided) == 2 and set(decided.values()) == {2}
    assert [n for _, n in points(found, "distlimit.storage.duration")] == [2]


def test_opentelemetry_attributes_are_bounded_as_the_prometheus_labels(
    reader: tuple[InMemoryMetricReader, MeterProvider],
) -> None:
    """A limit label past the 1,000th counts under ``other``, a shed's priority and reason take
    only their documented values, at most 1,000 breakers are observed (they grew unbounded)."""
    from flask_distlimit.core.decision import Check, Decision
    from flask_distlimit.telemetry.metrics import MAX_BREAKER_LABELS, MAX_LIMIT_LABELS, OTHER

    found, provider = reader
    sink = otel.OTelMetrics(provider)
    allowed = Evaluation((Decision(True, 10, 9, 0.0, 0.0),))
    for i in range(MAX_LIMIT_LABELS + 500):
        sink.evaluated([Check(f"ratelimit:{{t}}:r_route{i}_10/60:gcra", "gcra", 10, 60)], allowed)
        sink.shed(f"priority-{i}", f"reason-{i}")
        sink.breaker_changed(f"redis:ratelimit@10.0.{i // 256}.{i % 256}:6379", "open")
    limits = {a["distlimit.limit"] for a, _ in points(found, "distlimit.decisions")}
    assert len(limits) == MAX_LIMIT_LABELS + 1 and OTHER in limits
    shed = {
        (a["distlimit.priority"], a["distlimit.shed.reason"])
        for a, _ in points(found, "distlimit.requests")
    }
    assert shed == {("default", OTHER)}
    assert len(points(found, "distlimit.breaker.state")) == MAX_BREAKER_LABELS
