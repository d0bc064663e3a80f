"""A small, realistic API protected by Flask-DistLimit; ``python -m example_app`` runs it.

``create_app(config)`` builds the app. Settings come, in order of precedence, from ``config``,
from environment variables named ``DISTLIMIT_*`` or ``EXAMPLE_*`` (JSON values are decoded, as
Flask's ``from_prefixed_env`` does), then from :data:`DEFAULTS`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
from collections.abc import Mapping
from typing import Any, Final

from flask import Flask

from . import auth
from .api import bp, limiter
from .downstream import Downstream

__all__ = ["DEFAULTS", "create_app", "limiter"]

log = logging.getLogger(__name__)

#: The example's settings; small quotas so that a few curl commands show a 429.
DEFAULTS: Final[dict[str, Any]] = {
    "DISTLIMIT_STORAGE_URL": "memory://",
    "DISTLIMIT_ALGORITHM": "sliding_window_counter",
    "DISTLIMIT_TIERS": {
        "anonymous": "20/minute",
        "free": "60/minute",
        "pro": "300/minute",
        "internal": "10000/minute",
    },
    # A coarse per-IP flood limit beside the per-caller tiers (the two-tier defence).
    "DISTLIMIT_GLOBAL_LIMITS": "1000/minute",
    "DISTLIMIT_KEY_PREFIX": "example",
}


def _environment() -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name, raw in os.environ.items():
        if name.startswith(("DISTLIMIT_", "EXAMPLE_")):
            try:
                found[name] = json.loads(raw)
            except ValueError:
                found[name] = raw
    return found


def create_app(config: Mapping[str, Any] | None = None) -> Flask:
    """The example app; ``config`` overrides the environment and the defaults."""
    app = Flask(__name__)
    app.config.from_mapping(DEFAULTS)
    app.config.from_mapping(_environment())
    if config:
        app.config.from_mapping(config)
    if not app.config.get("SECRET_KEY"):
        app.config["SECRET_KEY"] = app.config.get("EXAMPLE_SECRET_KEY")
    if not app.config.get("SECRET_KEY"):
        # Fine for one process (tests, `flask run`). Every gunicorn worker must share one secret
        # (it signs the tokens and keys the API-key digests), so the launcher exports
        # EXAMPLE_SECRET_KEY before it starts them.
        app.config["SECRET_KEY"] = secrets.token_hex(32)
        log.warning(
            "EXAMPLE_SECRET_KEY is not set: tokens are valid in this process only, and "
            "`flask distlimit inspect` finds no counter another process made (run the inspect "
            "line that `python -m example_app` prints: it carries the launch's secret)"
        )
    # The token signing key, derived so that SECRET_KEY never signs two kinds of data.
    secret = str(app.config["SECRET_KEY"]).encode()
    jwt_key = hmac.new(secret, b"example-app jwt", hashlib.sha256).hexdigest()
    app.config["EXAMPLE_JWT_KEY"] = jwt_key
    # The limiter verifies the same tokens (signature, exp, aud, iss) before it believes a tier.
    app.config.setdefault("DISTLIMIT_JWT_KEYS", jwt_key)
    app.config.setdefault("DISTLIMIT_JWT_ALGORITHMS", ["HS256"])
    app.config.setdefault("DISTLIMIT_JWT_AUDIENCE", auth.AUDIENCE)
    app.config.setdefault("DISTLIMIT_JWT_ISSUER", auth.ISSUER)
    app.extensions["example_downstream"] = Downstream(str(app.config["DISTLIMIT_STORAGE_URL"]))
    limiter.init_app(app)
    app.register_blueprint(bp)
    return app
