"""The app :mod:`tests.extension.test_gunicorn` runs under gunicorn
(``tests.apps.gunicorn_app:app``).

Configured from the environment: ``DISTLIMIT_STORAGE_URL`` (a real Redis) and
``GUNICORN_TEST_LIMIT`` (the N of every limited route, per day, so nothing refills during a test;
a clock-aligned window that turns over mid-test admits N more, as an hourly one once did to the
load test at 05:00 UTC: a day makes that a midnight-only coincidence).
Clients are anonymous (keyed on their IP; ``DISTLIMIT_TRUSTED_PROXIES`` stays 0), and the anonymous
tier is large enough never to interfere. A storage outage answers 503 (policy ``closed``), so it
can never pass for extra admissions.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, ClassVar

from flask import Flask, g, request
from flask.views import MethodView

from flask_distlimit import Limiter

LIMIT = int(os.environ.get("GUNICORN_TEST_LIMIT", "20"))
ALGORITHMS = ("fixed_window", "sliding_window_log", "token_bucket", "gcra")

app = Flask(__name__)
app.config.update(
    DISTLIMIT_STORAGE_URL=os.environ["DISTLIMIT_STORAGE_URL"],
    DISTLIMIT_TIERS={"anonymous": "1000000/hour"},
    DISTLIMIT_KEY_PREFIX=os.environ.get("GUNICORN_TEST_PREFIX", "gunicorn-test"),
    # The test is about exactness, not outages: a machine busy with other work must not turn a
    # slow answer into an outage, and an outage must show as a 503, never as extra admissions.
    DISTLIMIT_REDIS_TIMEOUT=5.0,
    DISTLIMIT_FAILURE_POLICY="closed",
)
if os.environ.get("GUNICORN_TEST_SECRET") == "per-process":  # the mistake: each worker its own
    app.config["SECRET_KEY"] = os.urandom(16).hex()
limiter = Limiter(app)


@app.get("/health")
@limiter.exempt
def health() -> str:
    return f"ok {os.getpid()}"


def _route(algorithm: str) -> None:
    def view() -> str:
        return f"{algorithm} {os.getpid()}"

    view.__name__ = f"limited_{algorithm}"
    app.add_url_rule(
        f"/{algorithm}", view_func=limiter.limit(f"{LIMIT}/day", algorithm=algorithm)(view)
    )


for _algorithm in ALGORITHMS:
    _route(_algorithm)


@app.get("/by-ip")
@limiter.limit(f"{LIMIT}/day", algorithm="fixed_window")
def by_ip() -> str:
    return f"by-ip {os.getpid()}"


# -- issue 9: class-based views and a hook registered after Limiter(app), across workers -------


class Login(MethodView):
    decorators: ClassVar[list[Callable[..., Any]]] = [
        limiter.limit(f"{LIMIT}/day", algorithm="fixed_window")
    ]

    def get(self) -> str:
        return f"login {os.getpid()}"


class Catalogue(MethodView):  # no limit of its own: must never answer 429
    def get(self) -> str:
        return f"catalogue {os.getpid()}"


app.add_url_rule("/login", view_func=Login.as_view("login"))
app.add_url_rule("/catalogue", view_func=Catalogue.as_view("catalogue"))


@app.get("/tenant")
@limiter.limit(f"{LIMIT}/day", algorithm="fixed_window", key_func=lambda: g.tenant_id)
def tenant() -> str:
    return f"tenant {os.getpid()}"


@app.before_request  # after Limiter(app): the order of an app factory
def load_tenant() -> None:
    g.tenant_id = request.headers.get("X-Tenant", "none")
