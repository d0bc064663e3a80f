"""Whose bucket a request spends (issue 10): every kind of identity in a key space of its own,
digests keyed with a secret, API keys counted by the id the verifier accepted.

On memory, fakeredis and a real redis-server (``tests/distlimit_fixtures.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jwt
import pytest
from flask import request

from flask_distlimit import Limiter
from flask_distlimit.storage.base import Storage
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import backend, clock, make_app

__all__ = ["backend", "clock"]  # fixtures used below

Backend = Callable[[], Storage]

JWT_SECRET = "key-spaces-hs256-secret-0123456789abcdef"
AUDIENCE = "https://api.example.test"
ATTACKER = {"REMOTE_ADDR": "198.51.100.66"}


def _token(subject: str) -> str:
    claims = {"sub": subject, "aud": AUDIENCE, "exp": int(time.time()) + 600}
    return jwt.encode(claims, JWT_SECRET, algorithm="HS256")


# -- key spaces ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("forged", "victim_headers", "victim_environ"),
    [
        pytest.param("ip:203.0.113.9", {}, {"REMOTE_ADDR": "203.0.113.9"}, id="ip"),
        pytest.param("user:42", {"X-User": "42"}, {}, id="user"),
        pytest.param("jwt:sub:alice", {"Authorization": f"Bearer {_token('alice')}"}, {}, id="jwt"),
    ],
)
def test_a_key_func_value_never_spends_a_built_in_identity(
    backend: Backend,
    clock: FakeClock,
    forged: str,
    victim_headers: dict[str, str],
    victim_environ: dict[str, str],
) -> None:
    """/login limited per client and per submitted username: posting a username that spells a
    built-in identity spends that username's bucket, never the identity's."""
    app, limiter, _ = make_app(
        backend(),
        clock,
        DISTLIMIT_JWT_KEYS=JWT_SECRET,
        DISTLIMIT_JWT_ALGORITHMS=["HS256"],
        DISTLIMIT_JWT_AUDIENCE=AUDIENCE,
    )

    @limiter.identity_loader
    def who() -> tuple[str, str | None] | None:
        user = request.headers.get("X-User")
        return (user, None) if user else None

    @app.post("/login")
    @limiter.limit("5/minute")
    @limiter.limit("5/minute", key_func=lambda: request.form["username"])
    def login() -> str:
        return "ok"

    client = app.test_client()
    attempts = [
        client.post("/login", data={"username": forged}, environ_base=ATTACKER).status_code
        for _ in range(6)
    ]
    assert attempts == [200] * 5 + [429]
    first_real_login = client.post(
        "/login", data={"username": "victim"}, headers=victim_headers, environ_base=victim_environ
    )
    assert first_real_login.status_code == 200


def test_operators_name_a_key_func_identity_with_func(backend: Backend, clock: FakeClock) -> None:
    app, limiter, _ = make_app(backend(), clock)

    @app.post("/login")
    @limiter.limit("2/minute", key_func=lambda: request.form["username"])
    def login() -> str:
        return "ok"

    client = app.test_client()
    for _ in range(2):
        client.post("/login", data={"username": "alice"})
    assert client.post("/login", data={"username": "alice"}).status_code == 429
    state = Limiter.state(app)
    with pytest.raises(ValueError, match="func:alice"):
        state.reset_identity("alice")
    assert state.reset_identity("ip:alice") == 0  # another kind: not her bucket
    assert state.reset_identity("func:alice") == 1
    assert client.post("/login", data={"username": "alice"}).status_code == 200
