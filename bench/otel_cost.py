"""What OpenTelemetry costs a request: the API alone (no SDK), and an SDK provider
(docs/failure-modes.md).

    python bench/otel_cost.py --rounds 41 --batch 400 [--url redis://127.0.0.1:6379/0]

Three apps, alike but for OpenTelemetry: each with one route limit (huge, never reached) and
the default tier limit, on ``memory://`` (by default: Redis's noise would hide a few
microseconds, and the instruments are told the same on every storage). ``off`` is built as
without the API: no instruments, nothing counted when a response is made. ``api`` is instrumented as
``init_app`` does when ``opentelemetry-api`` is installed: the API's global provider, its
proxy, with no SDK provider set, so nothing reads the instruments. ``sdk`` records into an SDK
``MeterProvider`` read by an ``InMemoryMetricReader`` (production's setup, without an exporter
thread), collected after each of its batches, outside the timing, as a periodic reader would.
Every call is ``app(environ.copy(), start_response)`` of one environ built once. Rounds are
interleaved, the apps in a shuffled order; an app's time in a round is the median of its
batch. Printed: each app's median over the rounds, and each cost (the difference from ``off``
within a round) with the 95 % confidence interval of its median (``bench/intervals.py``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from flask import Flask
from intervals import median_ci  # beside this file
from opentelemetry.metrics import get_meter_provider
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from werkzeug.test import EnvironBuilder

from flask_distlimit import Limiter
from flask_distlimit.telemetry import otel


def _app(name: str, url: str, reader: InMemoryMetricReader | None = None) -> Flask:
    app = Flask(f"otel-{name}")
    app.config.update(
        SECRET_KEY="otel-cost",
        DISTLIMIT_STORAGE_URL=url,
        DISTLIMIT_KEY_PREFIX=f"otel-cost-{name}",
        DISTLIMIT_STARTUP_CHECK="off",
    )
    auto = otel.auto
    if name == "off":  # init_app as without the API: no instruments, no count
        otel.auto = lambda state: None  # type: ignore[assignment]
    try:
        limiter = Limiter(app)
    finally:
        otel.auto = auto

    @app.get("/")
    @limiter.limit("1000000000/hour")
    def index() -> str:
        return "ok"

    state = limiter.state(app)
    assert (state.otel is None) == (name == "off"), "opentelemetry-api is not installed"
    if reader is not None:
        otel.instrument(state, meter_provider=MeterProvider(metric_readers=[reader]))
    return app


NAMES = ("off", "api", "sdk")


def _batch(app: Flask, environ: dict[str, Any], n: int) -> float:
    """The median time of one request over ``n`` requests, microseconds."""
    times = []
    for _ in range(n):
        started = time.perf_counter_ns()
        body = app(environ.copy(), lambda status, headers, exc_info=None: None)
        b"".join(body)
        body.close()  # type: ignore[attr-defined]
        times.append(time.perf_counter_ns() - started)
    return statistics.median(times) / 1000


def _requests(reader: InMemoryMetricReader) -> float:
    """The requests the SDK reader saw counted (``distlimit.requests``), all series."""
    data = reader.get_metrics_data()
    return sum(
        p.value
        for resource in (data.resource_metrics if data else ())
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == "distlimit.requests"
        for p in metric.data.data_points
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--batch", type=int, default=400)
    parser.add_argument("--url", default="memory://", help="the storage (default: memory://)")
    args = parser.parse_args()
    provider = type(get_meter_provider()).__name__
    assert provider == "_ProxyMeterProvider", f"an SDK provider is set ({provider})"
    reader = InMemoryMetricReader()
    apps = {name: _app(name, args.url, reader if name == "sdk" else None) for name in NAMES}
    environ = EnvironBuilder(path="/", environ_base={"REMOTE_ADDR": "10.0.0.1"}).get_environ()
    for app in apps.values():  # warm up: plans, instruments, key caches
        _batch(app, environ, 200)
    times: dict[str, list[float]] = {name: [] for name in apps}
    for _ in range(args.rounds):
        order = list(apps)
        random.shuffle(order)
        for name in order:
            times[name].append(_batch(apps[name], environ, args.batch))
        _requests(reader)  # a collection, as a periodic reader makes
    counted = _requests(reader)
    assert counted == 200 + args.rounds * args.batch, f"the SDK saw {counted} requests"
    print(f"{args.rounds} rounds of {args.batch} requests per app, us per request")
    print(f"off (no OpenTelemetry): {statistics.median(times['off']):.1f}")
    for name, label in (("api", "api (the API, no SDK)"), ("sdk", "sdk (an SDK provider)")):
        costs = [t - off for t, off in zip(times[name], times["off"], strict=True)]
        low, high = median_ci(costs)
        print(
            f"{label}: {statistics.median(times[name]):.1f}, "
            f"+{statistics.median(costs):.2f} [{low:.2f} to {high:.2f}]"
        )


if __name__ == "__main__":
    main()
