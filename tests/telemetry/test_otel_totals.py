"""OpenTelemetry's counters are totals kept in-process and read when the provider collects
(flask_distlimit.telemetry.otel): the instruments a provider is asked for, what a request makes
the SDK do, exact totals from many threads, and a forked child that starts from zero."""

from __future__ import annotations

import json
import os
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from flask_distlimit.core.decision import Check, Decision, Evaluation
from flask_distlimit.storage.base import Storage
from flask_distlimit.telemetry import otel
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import backend, clock
from tests.telemetry.test_otel import _instrumented, points, reader, requests_by

__all__ = ["backend", "clock", "reader"]

Backend = Callable[[], Storage]


class _Updates:
    """An SDK instrument, its synchronous updates (``add``, ``record``) written down by name."""

    def __init__(self, instrument: Any, name: str, updates: list[str]) -> None:
        self._instrument, self._name, self._updates = instrument, name, updates

    def add(self, amount: float, attributes: Any = None) -> None:
        self._updates.append(self._name)
        self._instrument.add(amount, attributes)

    def record(self, amount: float, attributes: Any = None) -> None:
        self._updates.append(self._name)
        self._instrument.record(amount, attributes)


class _Meter:
    """An SDK meter that writes down the kind of each instrument it is asked for."""

    def __init__(self, meter: Any) -> None:
        self.meter = meter
        self.kinds: dict[str, str] = {}
        self.updates: list[str] = []

    def __getattr__(self, create: str) -> Callable[..., Any]:
        def make(name: str, **kwargs: Any) -> Any:
            self.kinds[name] = create.removeprefix("create_")
            made = getattr(self.meter, create)(name, **kwargs)
            return made if "observable" in create else _Updates(made, name, self.updates)

        return make


class _Provider:
    """A MeterProvider handing out the SDK's meter through :class:`_Meter`."""

    def __init__(self, provider: MeterProvider) -> None:
        self.provider = provider
        self.meter: _Meter | None = None

    def get_meter(self, name: str, *args: Any, **kwargs: Any) -> _Meter:
        self.meter = _Meter(self.provider.get_meter(name, *args, **kwargs))
        return self.meter


def test_counters_are_observable_and_a_request_updates_the_sdk_once(
    backend: Backend, clock: FakeClock, reader: tuple[InMemoryMetricReader, MeterProvider]
) -> None:
    """Every counter and up-down counter is an observable instrument reading totals kept here
    (they were synchronous: a request made the SDK update the duration histogram, then each
    decision's counter and the requests counter, 4 updates for 2 limits, 10-15 us each); only
    the histogram is still synchronous. A reader sees the same sums as before."""
    found, provider = reader
    recording: Any = _Provider(provider)
    app, limiter = _instrumented(backend(), clock, recording, DISTLIMIT_GLOBAL_LIMITS="100/minute")
    app.add_url_rule("/", "index", limiter.limit("10/second")(lambda: "ok"))
    client = app.test_client()
    for _ in range(3):
        assert client.get("/").status_code == 200
    meter = recording.meter
    assert meter is not None
    observable = {"counter": "observable_counter", "up_down_counter": "observable_up_down_counter"}
    assert meter.kinds == {
        "distlimit.requests": observable["counter"],
        "distlimit.decisions": observable["counter"],
        "distlimit.fallback.decisions": observable["counter"],
        "distlimit.shadow.refusals": observable["counter"],
        "distlimit.leased.decisions": observable["counter"],
        "distlimit.storage.unreadable": observable["counter"],
        "distlimit.side_call.failures": observable["counter"],
        "distlimit.settled.units": observable["counter"],
        "distlimit.concurrency.slots": observable["up_down_counter"],
        "distlimit.storage.duration": "histogram",
        "distlimit.worker.in_flight": "observable_gauge",
        "distlimit.lease.units": "observable_gauge",
        "distlimit.breaker.state": "observable_gauge",
    }
    assert meter.updates == ["distlimit.storage.duration"] * 3  # one per storage call
    assert list(requests_by(found).values()) == [3]
    decided = points(found, "distlimit.decisions")
    assert len(decided) == 2 and {v for _, v in decided} == {3}
    data = found.get_metrics_data()
    assert data is not None
    sums = {
        m.name: m.data
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name in ("distlimit.requests", "distlimit.decisions")
    }
    assert len(sums) == 2
    for kept in sums.values():  # what a dashboard reads: monotonic sums, cumulative
        assert kept.is_monotonic and kept.aggregation_temporality.name == "CUMULATIVE"


def test_counts_from_many_threads_are_all_kept(
    reader: tuple[InMemoryMetricReader, MeterProvider],
) -> None:
    """gthread workers count from many threads at once: no count is lost between them."""
    found, provider = reader
    sink = otel.OTelMetrics(provider)
    checks = [Check("ratelimit:{t}:r_a_10/60:gcra", "gcra", 10, 60)]
    allowed = Evaluation((Decision(True, 10, 9, 0.0, 0.0),))
    rounds, workers = 2_000, 8

    def work() -> None:
        for _ in range(rounds):
            sink.evaluated(checks, allowed)
            sink.settled("ratelimit:{t}:r_a_10/60:gcra", "content-bytes", 3)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as they can
    try:
        threads = [threading.Thread(target=work) for _ in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert [v for _, v in points(found, "distlimit.decisions")] == [rounds * workers]
    assert [v for _, v in points(found, "distlimit.settled.units")] == [3 * rounds * workers]


def test_a_forked_child_reports_its_own_counts_only(
    reader: tuple[InMemoryMetricReader, MeterProvider],
) -> None:
    """gunicorn's ``preload_app`` builds the app in the master: a worker it forks starts from
    zero (it reported the master's counts as its own), with a lock of its own (the master's
    may be held by a thread the child does not have)."""
    found, provider = reader
    sink = otel.OTelMetrics(provider)
    for _ in range(3):
        sink.unreadable()
    read, write = os.pipe()
    sink._mutex.acquire()  # as another thread of the parent may hold it when a worker forks
    try:
        with warnings.catch_warnings():  # 3.12+ warns about forking a process that has threads
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: count once, report what its reader reads, leave at once
            code = 1
            try:
                report: dict[str, Any] = {"held": sink._mutex.locked()}
                if not report["held"]:  # else counting, or reading, would wait for ever
                    sink.unreadable()
                    counted = points(found, "distlimit.storage.unreadable")
                    report["counted"] = [v for _, v in counted]
                os.write(write, json.dumps(report).encode())
                code = 0
            finally:
                os._exit(code)
    finally:
        if sink._mutex.locked():
            sink._mutex.release()
    os.close(write)
    with os.fdopen(read) as pipe:
        child = json.loads(pipe.read())
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0, "the child failed"
    assert child == {"held": False, "counted": [1]}
    assert [v for _, v in points(found, "distlimit.storage.unreadable")] == [3]  # the parent's
