"""Leftover Flask-Limiter ``RATELIMIT_*`` keys (issue 26): one WARNING at ``init_app`` naming each
key and what replaces it, never silence (``RATELIMIT_DEFAULT = "1/minute"`` limits nothing here)
and never a refusal (Flask-Limiter may still run on the app while it is ported route by route).
"""

from __future__ import annotations

import logging

import flask_limiter
import pytest
from flask import Flask

from flask_distlimit import Limiter
from flask_distlimit.ops.migration import CONFIG_KEYS, leftover_keys_message


def _app(**config: object) -> Flask:
    app = Flask("leftover")
    app.config.update(SECRET_KEY="leftover-keys-" + "x" * 20, **config)
    return app


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "RATELIMIT_" in r.getMessage()
    ]


def test_leftover_keys_log_one_warning_naming_each_and_its_replacement(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = _app(
        RATELIMIT_DEFAULT="1/minute",
        RATELIMIT_STORAGE_URI="redis://localhost:6379",
        RATELIMIT_HEADERS_ENABLED=True,
    )
    with caplog.at_level(logging.WARNING, logger="flask_distlimit"):
        Limiter(app)
    (message,) = _warnings(caplog)
    assert "'leftover'" in message
    assert "RATELIMIT_DEFAULT -> DISTLIMIT_DEFAULT_LIMITS" in message
    assert "RATELIMIT_STORAGE_URI -> DISTLIMIT_STORAGE_URL" in message
    assert "RATELIMIT_HEADERS_ENABLED -> DISTLIMIT_HEADERS" in message
    assert "no effect" in message and "migrating-from-flask-limiter.md" in message


def test_the_leftover_default_really_limits_nothing_so_the_warning_is_true() -> None:
    app = _app(RATELIMIT_DEFAULT="1/minute")
    Limiter(app)
    app.get("/")(lambda: "ok")
    client = app.test_client()
    assert [client.get("/").status_code for _ in range(3)] == [200] * 3


def test_an_app_without_leftover_keys_hears_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="flask_distlimit"):
        Limiter(_app(DISTLIMIT_DEFAULT_LIMITS="1/minute"))
    assert _warnings(caplog) == []
    assert leftover_keys_message({"DISTLIMIT_ENABLED": True, "RATELIMITS": 1}) is None


def test_a_key_flask_limiter_does_not_have_either_is_named_as_such() -> None:
    message = leftover_keys_message({"RATELIMIT_DEFAULTS": "1/minute"})
    assert message is not None
    assert "RATELIMIT_DEFAULTS -> not a Flask-Limiter 4.x key either" in message


def test_every_flask_limiter_key_has_a_replacement_named() -> None:
    config_vars = flask_limiter.constants.ConfigVars
    theirs = {v for k, v in vars(config_vars).items() if k.isupper() and isinstance(v, str)}
    assert set(CONFIG_KEYS) == theirs
    message = leftover_keys_message(dict.fromkeys(theirs, 1))
    assert message is not None
    for key, replacement in CONFIG_KEYS.items():
        assert f"{key} -> {replacement}" in message


def test_flask_limiter_beside_on_the_same_app_still_starts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The keys may be Flask-Limiter's own during a port: warned about, never refused."""
    app = _app(RATELIMIT_STORAGE_URI="memory://", RATELIMIT_DEFAULT="5/minute")
    flask_limiter.Limiter(lambda: "127.0.0.1", app=app)
    with caplog.at_level(logging.WARNING, logger="flask_distlimit"):
        Limiter(app)
    assert len(_warnings(caplog)) == 1
