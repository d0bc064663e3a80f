"""The app ``bench/faults.py`` runs under gunicorn (``bench.faults_app:app``).

One route, ``GET /``, limited to ``FAULTS_LIMIT`` (default ``30/second``, fixed window) per
client, the client named by the ``X-Client`` request header. Configured from the environment:
``FAULTS_STORAGE_URL``, ``FAULTS_POLICY`` (``open``/``closed``/``local``), ``FAULTS_INSTANCES``
(an integer or ``auto``), ``FAULTS_TIMEOUT`` (``DISTLIMIT_REDIS_TIMEOUT``), ``FAULTS_RESET``
(``DISTLIMIT_BREAKER_RESET_TIMEOUT``) and ``FAULTS_PREFIX`` (``DISTLIMIT_KEY_PREFIX``).

Every response carries what the harness counts with:

- ``X-Worker-Pid``: the process that answered (admissions are counted per process);
- ``X-Limiter-Start`` / ``X-Limiter-End``: wall-clock seconds (``time.time()``) around the
  limiter's work, so an admission is counted in its window;
- ``X-Limiter-Ms``: the limiter's own time in this request, from the app's last
  ``before_request`` hook to the view (the limiter decides in a gate around the view), or to
  ``after_request`` when the limiter refused (429/503);
- ``X-Window-Reset-At``: when an admission was decided, the epoch seconds at which its window
  resets (``limiter.current_limits``' ``reset_at``): the window it was counted in, exactly;
- ``X-Fallback-Active``: ``1`` when this process's local fallback held counts after the request
  (its admissions are then held to the local share).

``GET /health`` (exempt) answers the pid; ``GET /tag/<name>`` (exempt) the Redis hash tag of
client ``<name>``'s keys (to place clients on Cluster shards).
"""

from __future__ import annotations

import os
import time

from flask import Flask, Response, request

from flask_distlimit import Limiter

app = Flask(__name__)
_instances = os.environ.get("FAULTS_INSTANCES", "3")
app.config.update(
    SECRET_KEY="faults-bench-secret-key-0123456789",
    DISTLIMIT_STORAGE_URL=os.environ["FAULTS_STORAGE_URL"],
    DISTLIMIT_FAILURE_POLICY=os.environ.get("FAULTS_POLICY", "open"),
    DISTLIMIT_INSTANCES=_instances if _instances == "auto" else int(_instances),
    DISTLIMIT_REDIS_TIMEOUT=float(os.environ.get("FAULTS_TIMEOUT", "0.1")),
    DISTLIMIT_BREAKER_RESET_TIMEOUT=float(os.environ.get("FAULTS_RESET", "2")),
    DISTLIMIT_KEY_PREFIX=os.environ.get("FAULTS_PREFIX", "faults"),
    DISTLIMIT_TIERS={"anonymous": ""},
    DISTLIMIT_HEADERS="legacy",
)
limiter = Limiter(app)
LIMIT = os.environ.get("FAULTS_LIMIT", "30/second")
PID = str(os.getpid())

_START, _END, _PERF = "faults.start", "faults.end", "faults.perf"


def _client() -> str:
    return request.headers.get("X-Client", "anonymous")


@app.before_request  # registered after Limiter(app): runs last of the hooks, before the gate
def _started() -> None:
    request.environ[_START] = time.time()
    request.environ[_PERF] = time.perf_counter()


@app.get("/")
@limiter.limit(LIMIT, algorithm="fixed_window", key_func=_client)
def index() -> str:
    request.environ[_END] = (time.time(), time.perf_counter())  # the limiter admitted
    return "ok"


@app.get("/health")
@limiter.exempt
def health() -> str:
    return PID


@app.get("/tag/<name>")
@limiter.exempt
def tag(name: str) -> str:
    return limiter.state(app).identity_tag(f"func:{name}")


@app.after_request
def _stamp(response: Response) -> Response:
    environ = request.environ
    response.headers["X-Worker-Pid"] = PID
    if _START in environ:
        end, perf = environ.get(_END) or (time.time(), time.perf_counter())
        response.headers["X-Limiter-Start"] = f"{environ[_START]:.6f}"
        response.headers["X-Limiter-End"] = f"{end:.6f}"
        response.headers["X-Limiter-Ms"] = f"{(perf - environ[_PERF]) * 1000:.3f}"
    decided = limiter.current_limits
    if decided:
        response.headers["X-Window-Reset-At"] = f"{decided[0].reset_at:.6f}"
    if limiter.state(app).guard.fallback_active:
        response.headers["X-Fallback-Active"] = "1"
    return response
