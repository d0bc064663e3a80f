"""The app :mod:`tests.resilience.test_instances` runs under gunicorn (``--preload``): one limited
route, ``DISTLIMIT_INSTANCES = "auto"``, every worker a heartbeat member of its own.

Configured from the environment: ``DISTLIMIT_STORAGE_URL`` and ``INSTANCES_TEST_PREFIX``.
"""

from __future__ import annotations

import os

from flask import Flask

from flask_distlimit import Limiter

app = Flask(__name__)
app.config.update(
    DISTLIMIT_STORAGE_URL=os.environ["DISTLIMIT_STORAGE_URL"],
    DISTLIMIT_KEY_PREFIX=os.environ["INSTANCES_TEST_PREFIX"],
    DISTLIMIT_INSTANCES="auto",
    DISTLIMIT_TIERS={"anonymous": ""},
)
limiter = Limiter(app)


@app.get("/")
@limiter.limit("1000000/hour")
def index() -> str:
    return str(os.getpid())
