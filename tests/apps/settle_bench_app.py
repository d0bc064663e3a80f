"""The app ``bench/settle.py`` serves under gunicorn: one limit, with and without ``settle``.

``/plain`` and ``/settled`` each have a ``100000000/minute`` limit per tenant (never reached)
reserving 10 units; ``/settled`` settles each request to 7 (a release of 3 after every
response). Configured from ``DISTLIMIT_STORAGE_URL``.
"""

from __future__ import annotations

import os

from flask import Flask

from flask_distlimit import Limiter

app = Flask(__name__)
app.config.update(
    DISTLIMIT_STORAGE_URL=os.environ["DISTLIMIT_STORAGE_URL"],
    DISTLIMIT_REDIS_TIMEOUT=5.0,
    SECRET_KEY="settle-bench-" + "x" * 20,
)
limiter = Limiter(app)


@app.get("/health")
@limiter.exempt
def health() -> str:
    return "ok"


@app.get("/plain")
@limiter.limit("100000000/minute", key_func=lambda: "tenant-a", cost=10)
def plain() -> str:
    return "ok"


@app.get("/settled")
@limiter.limit("100000000/minute", key_func=lambda: "tenant-b", cost=10, settle=lambda r: 7)
def settled() -> str:
    return "ok"
