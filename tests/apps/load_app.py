"""The app :mod:`tests.extension.test_load` runs under gunicorn: the default configuration under
load.

Configured from the environment: ``DISTLIMIT_STORAGE_URL`` (a real Redis), ``LOAD_TEST_LIMIT``
(the N of every limited route, per hour in a sliding log, so nothing leaves it during a test,
even one that crosses the hour: a clock-aligned fixed window of an hour turned over under a CI
run at 05:00:00 UTC and admitted twice the limit),
``LOAD_TEST_PREFIX`` (the key prefix), ``LOAD_TEST_SLEEP`` (seconds ``/limited`` holds its
request after the limiter admitted it, so that many are in flight at once) and
``LOAD_TEST_ADMITTED`` (a file each admitted view appends one byte to, in every worker: the
admissions counted where they happen, however late their responses). Everything else is
the default: ``DISTLIMIT_REDIS_TIMEOUT`` 0.1 s, the breaker's five failures, failure policy
``open`` (a request the policy answers is marked ``X-RateLimit-Degraded``, which the test counts).

- ``/limited``: ``LOAD_TEST_LIMIT/hour`` per client (sliding window log), then sleeps;
- ``/cpu``: the same limit on its own key, then spends ``LOAD_TEST_CPU`` seconds of CPU in
  Python (holding the GIL or the event loop), so that the workers keep every core busy;
- ``/health``: exempt, for the test to wait on;
- ``/breaker``: exempt; this process's breaker state and consecutive failures, and its PID.
"""

from __future__ import annotations

import os
import time

from flask import Flask

from flask_distlimit import Limiter

LIMIT = int(os.environ.get("LOAD_TEST_LIMIT", "50"))
SLEEP = float(os.environ.get("LOAD_TEST_SLEEP", "0.05"))
CPU = float(os.environ.get("LOAD_TEST_CPU", "0.002"))

app = Flask(__name__)
app.config.update(
    DISTLIMIT_STORAGE_URL=os.environ["DISTLIMIT_STORAGE_URL"],
    DISTLIMIT_KEY_PREFIX=os.environ.get("LOAD_TEST_PREFIX", "load-test"),
)
limiter = Limiter(app)
_ADMITTED = os.environ.get("LOAD_TEST_ADMITTED")


def admitted() -> None:
    """One byte more in ``LOAD_TEST_ADMITTED`` (``O_APPEND``: whole, from any worker)."""
    if _ADMITTED:
        fd = os.open(_ADMITTED, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)


@app.get("/limited")
@limiter.limit(f"{LIMIT}/hour", algorithm="sliding_window_log")
def limited() -> str:
    admitted()
    time.sleep(SLEEP)  # gevent's under -k gevent (monkey-patched)
    return "ok"


@app.get("/cpu")
@limiter.limit(f"{LIMIT}/hour", algorithm="sliding_window_log")
def cpu() -> str:
    admitted()
    until = time.perf_counter() + CPU
    spins = 0
    while time.perf_counter() < until:
        spins += 1
    return f"ok {spins}"


@app.get("/health")
@limiter.exempt
def health() -> str:
    return f"ok {os.getpid()}"


@app.get("/breaker")
@limiter.exempt
def breaker() -> dict[str, object]:
    guard = limiter.state(app).guard
    return {
        "pid": os.getpid(),
        "state": guard.breakers.state,
        "failures": sum(b.failures for b in guard.breakers.all()),
    }
