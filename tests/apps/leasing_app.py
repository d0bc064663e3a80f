"""The app :mod:`tests.test_leases_gunicorn` and ``bench/leasing.py`` run under gunicorn.

Configured from the environment: ``DISTLIMIT_STORAGE_URL`` (a real Redis), ``LEASING_LIMIT``
(the value of both limits, default ``300/minute``), ``LEASING_PREFIX`` (the key prefix) and
``LEASING_LEASE`` (``true`` or a number of units, for ``/leased``).

- ``/leased``: one shared limit for every client (``key_func``), leased;
- ``/plain``: the same limit on a key of its own, not leased;
- ``/leases``: this process's PID and ``health()["leases"]`` (exempt).
"""

from __future__ import annotations

import json
import os

from flask import Flask

from flask_distlimit import Limiter

LIMIT = os.environ.get("LEASING_LIMIT", "300/minute")
LEASE = os.environ.get("LEASING_LEASE", "true")

app = Flask(__name__)
app.config.update(
    DISTLIMIT_STORAGE_URL=os.environ["DISTLIMIT_STORAGE_URL"],
    DISTLIMIT_KEY_PREFIX=os.environ.get("LEASING_PREFIX", "lease-test"),
    # Exactness, not outages: a slow answer on a busy machine must not become an outage.
    DISTLIMIT_REDIS_TIMEOUT=5.0,
    DISTLIMIT_FAILURE_POLICY="closed",
    DISTLIMIT_TIERS={"anonymous": ""},
    DISTLIMIT_HEADERS="none",
)
limiter = Limiter(app)


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


@app.get("/leases")
@limiter.exempt
def leases() -> str:
    return json.dumps({"pid": os.getpid(), "leases": limiter.health()["leases"]})
