"""What the OpenTelemetry API costs a request when no SDK is set (docs/failure-modes.md).

    python bench/otel_cost.py --rounds 41 --batch 400

Two apps, alike but for OpenTelemetry: each with one route limit (huge, never reached) and the
default tier limit, on ``memory://`` (no Redis: its noise would hide a few microseconds; the
instruments are told the same on every storage). The first is instrumented as ``init_app``
does when ``opentelemetry-api`` is installed: the API's global provider, its proxy, with no SDK
provider set, so every instrument is the API's no-op; the second has its hook detached, as an
app without the package. Every call is ``app(environ.copy(), start_response)`` of one environ
built once. Rounds are interleaved, the apps in a shuffled order; an app's time in a round is
the median of its batch, the cost is the difference within the round, and the median over the
rounds is printed with its 95 % confidence interval (``bench/intervals.py``).
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
from werkzeug.test import EnvironBuilder

from flask_distlimit import Limiter


def _app(*, otel: bool) -> Flask:
    app = Flask(f"otel-{otel}")
    app.config.update(DISTLIMIT_STORAGE_URL="memory://", DISTLIMIT_STARTUP_CHECK="off")
    limiter = Limiter(app)

    @app.get("/")
    @limiter.limit("1000000000/hour")
    def index() -> str:
        return "ok"

    state = limiter.state(app)
    assert state.otel is not None, "opentelemetry-api is not installed"
    if not otel:
        state.otel.detach()
        state.otel = None
    return app


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--batch", type=int, default=400)
    args = parser.parse_args()
    provider = type(get_meter_provider()).__name__
    assert provider == "_ProxyMeterProvider", f"an SDK provider is set ({provider})"
    apps = {"otel": _app(otel=True), "off": _app(otel=False)}
    environ = EnvironBuilder(path="/", environ_base={"REMOTE_ADDR": "10.0.0.1"}).get_environ()
    for app in apps.values():  # warm up: plans, instruments, key caches
        _batch(app, environ, 200)
    costs, off = [], []
    for _ in range(args.rounds):
        order = list(apps)
        random.shuffle(order)
        got = {name: _batch(apps[name], environ, args.batch) for name in order}
        costs.append(got["otel"] - got["off"])
        off.append(got["off"])
    low, high = median_ci(costs)
    print(
        f"OpenTelemetry API, no SDK: {statistics.median(costs):.2f} us per request "
        f"[{low:.2f} to {high:.2f}], over {statistics.median(off):.1f} us without it "
        f"({args.rounds} rounds of {args.batch} requests per app)"
    )


if __name__ == "__main__":
    main()
