"""The app :mod:`tests.resilience.test_leases_gunicorn` and ``bench/leasing.py`` run under gunicorn.

Configured from the environment: ``DISTLIMIT_STORAGE_URL`` (a real Redis), ``LEASING_LIMIT``
(the value of both limits, default ``300/minute``), ``LEASING_PREFIX`` (the key prefix) and
``LEASING_LEASE`` (``true`` or a number of units, for ``/leased``).

- ``/leased``: one shared limit for every client (``key_func``), leased;
- ``/plain``: the same limit on a key of its own, not leased;
- ``/tight``: ``LEASING_TIGHT`` (default ``1000/second``), shared, leased, fixed window; each
  admission is counted in Redis per window of the host's clock (``bench/leasing.py`` compares
  admissions per window with the limit): under ``<prefix>:admitted:<window>`` when the request
  was in one window from before the limiter decided (a ``before_request`` hook, which runs before
  the limiter's gate) to the view, else under ``<prefix>:straddled:<window the view ran in>``
  (decided in that window or the one before);
- ``/leases``: this process's PID and ``health()["leases"]`` (exempt).
"""

from __future__ import annotations

import json
import os
import time

import redis
from flask import Flask, g

from flask_distlimit import Limiter
from flask_distlimit.core.limits import parse_rates

LIMIT = os.environ.get("LEASING_LIMIT", "300/minute")
LEASE = os.environ.get("LEASING_LEASE", "true")
TIGHT = os.environ.get("LEASING_TIGHT", "1000/second")
PREFIX = os.environ.get("LEASING_PREFIX", "lease-test")
TIGHT_PERIOD = parse_rates(TIGHT)[0].period

app = Flask(__name__)
app.config.update(
    DISTLIMIT_STORAGE_URL=os.environ["DISTLIMIT_STORAGE_URL"],
    DISTLIMIT_KEY_PREFIX=PREFIX,
    # Exactness, not outages: a slow answer on a busy machine must not become an outage.
    DISTLIMIT_REDIS_TIMEOUT=5.0,
    DISTLIMIT_FAILURE_POLICY="closed",
    DISTLIMIT_TIERS={"anonymous": ""},
    DISTLIMIT_HEADERS="none",
)
limiter = Limiter(app)
book = redis.Redis.from_url(os.environ["DISTLIMIT_STORAGE_URL"])


@app.get("/health")
@limiter.exempt
def health() -> str:
    return f"ok {os.getpid()}"


@app.get("/leased")
@limiter.shared_limit(
    LIMIT,
    scope="leased",
    key_func=lambda: "everyone",
    algorithm="fixed_window",
    lease=True if LEASE == "true" else int(LEASE),
)
def leased() -> str:
    return "ok"


@app.get("/plain")
@limiter.shared_limit(LIMIT, scope="plain", key_func=lambda: "everyone", algorithm="fixed_window")
def plain() -> str:
    return "ok"


@app.before_request
def started() -> None:
    g.started = time.time()


@app.get("/tight")
@limiter.shared_limit(
    TIGHT, scope="tight", key_func=lambda: "everyone", algorithm="fixed_window", lease=True
)
def tight() -> str:
    window, now = int(g.started) // TIGHT_PERIOD, int(time.time()) // TIGHT_PERIOD
    book.incr(f"{PREFIX}:{'admitted' if window == now else 'straddled'}:{now}")
    return "ok"


@app.get("/leases")
@limiter.exempt
def leases() -> str:
    return json.dumps({"pid": os.getpid(), "leases": limiter.health()["leases"]})
