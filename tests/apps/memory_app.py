"""The app :mod:`tests.ops.test_serving` runs under gunicorn (``tests.apps.memory_app:app``): the
default storage, ``memory://``, and a log line per record with the pid that wrote it."""

from __future__ import annotations

import logging
import os

from flask import Flask

from flask_distlimit import Limiter

logging.basicConfig(
    level=logging.WARNING, format="%(process)d %(levelname)s %(name)s: %(message)s", force=True
)

app = Flask(__name__)
app.config.update(DISTLIMIT_TIERS={"anonymous": "100/minute"})
limiter = Limiter(app)


@app.get("/pid")
def pid() -> str:
    return str(os.getpid())
