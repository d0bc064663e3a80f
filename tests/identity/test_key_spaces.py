"""Whose bucket a request spends (issue 10): every kind of identity in a key space of its own,
digests keyed with a secret, API keys counted by the id the verifier accepted.

On memory, fakeredis and a real redis-server (``tests/distlimit_fixtures.py``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
import time
from collections.abc import Callable

import jwt
import pytest
import redis
from flask import Flask, request
from redis.crc import key_slot

from flask_distlimit import Limiter
from flask_distlimit.identity.digests import REFRESH_INTERVAL, SHARED_KEY_TTL
from flask_distlimit.storage.base import Storage
from flask_distlimit.storage.memory import MemoryStorage
from flask_distlimit.storage.redis import RedisStorage
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import backend, clock, make_app
from tests.servers import RedisProcess

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


class _Tenant:
    """A model object without ``__str__``: its text is its repr, with its memory address."""


def test_a_key_func_that_answers_no_key_skips_the_limit(backend: Backend, clock: FakeClock) -> None:
    """``key_func=lambda: g.get("tenant")`` answers ``None`` (or ``""``) for a client with no
    tenant: the limit is skipped for that request, as Flask-Limiter skips it (issue 33), never
    all such clients in one ``func:None`` bucket (one client could then lock every other out),
    nor the bucket of a tenant named "None"."""
    app, limiter, _ = make_app(backend(), clock)

    @app.get("/report")
    @limiter.limit(
        "2/minute", key_func=lambda: request.headers.get("X-Tenant", request.args.get("t"))
    )
    def report() -> str:
        return "ok"

    client = app.test_client()

    def status(addr: str, **headers: str) -> int:
        return client.get(
            "/report", headers=headers, environ_base={"REMOTE_ADDR": addr}
        ).status_code

    assert [status("198.51.100.1") for _ in range(3)] == [200, 200, 200]
    assert [status("198.51.100.2", X_Tenant="") for _ in range(3)] == [200, 200, 200]
    assert [status("198.51.100.1", X_Tenant="None") for _ in range(3)] == [200, 200, 429]
    assert status("198.51.100.4") == 200  # a tenant named "None" spent its own bucket


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(lambda: _Tenant(), id="object-with-repr"),
        pytest.param(lambda: b"acme", id="bytes"),
        pytest.param(lambda: True, id="bool"),
        pytest.param(lambda: 1.5, id="float"),
    ],
)
def test_a_key_func_answer_that_is_not_a_key_is_refused(
    clock: FakeClock, answer: Callable[[], object], caplog: pytest.LogCaptureFixture
) -> None:
    """A ``key_func`` that answers a model object (whose text holds its memory address, so every
    request would get a fresh quota) or bytes (``"b'acme'"``, apart from ``"acme"``) is a bug in
    the app: an ERROR naming the limit, never a silent bucket, and the limit applies under the
    client's identity, as if it had no ``key_func`` (under ``open`` too); never a 500."""
    app, limiter, _ = make_app(MemoryStorage(clock=clock), clock)

    @app.get("/report")
    @limiter.limit("2/minute", key_func=answer)  # type: ignore[arg-type]
    def report() -> str:
        return "ok"

    with caplog.at_level(logging.ERROR, logger="flask_distlimit"):
        client = app.test_client()
        assert [client.get("/report").status_code for _ in range(3)] == [200, 200, 429]
    assert re.search(r"key_func .* of the rate limit .*str or int", caplog.text)


def test_a_key_func_that_raises_an_http_error_answers_it_and_counts_nothing(
    backend: Backend, clock: FakeClock
) -> None:
    """``request.form["username"]`` on a post without one raises werkzeug's 400: the client
    gets that 400 (never a 500), and nothing is counted under any key."""
    app, limiter, counting = make_app(backend(), clock)

    @app.post("/login")
    @limiter.limit("2/minute", key_func=lambda: request.form["username"])
    def login() -> str:
        return "ok"

    client = app.test_client()
    assert [client.post("/login").status_code for _ in range(3)] == [400] * 3
    assert counting.evaluations == 0
    assert [client.post("/login", data={"username": "bob"}).status_code for _ in range(3)] == [
        200,
        200,
        429,
    ]


def test_an_http_error_of_the_apps_code_still_spends_the_global_limits(
    backend: Backend, clock: FakeClock
) -> None:
    """An identity loader that answers 401 to a bad session, a ``key_func`` reading a form
    field (400 without it): the app's answer stands, but the request spends the per-address
    global limit first, as a 404 or a hook's 401 does: a client cannot guess credentials or
    flood bad posts past it. The route's own limits count nothing."""
    from flask import abort

    app, limiter, counting = make_app(backend(), clock, DISTLIMIT_GLOBAL_LIMITS="3/minute")

    @limiter.identity_loader
    def who() -> tuple[str, str | None] | None:
        session = request.headers.get("X-Session")
        if session is not None and session != "good":
            abort(401)
        return ("alice", None) if session else None

    @app.get("/me")
    @limiter.limit("10/minute")
    def me() -> str:
        return "ok"

    @app.post("/login")
    @limiter.limit("10/minute", key_func=lambda: request.form["username"])
    def login() -> str:
        return "ok"

    client = app.test_client()
    guesses = [client.get("/me", headers={"X-Session": f"guess{i}"}) for i in range(4)]
    assert [r.status_code for r in guesses] == [401, 401, 401, 429]
    other = {"REMOTE_ADDR": "192.0.2.8"}
    posts = [client.post("/login", environ_base=other).status_code for _ in range(4)]
    assert posts == [400, 400, 400, 429]
    assert all("}:g_3/60:" in c.key for calls in counting.checks for c in calls)
    assert all(len(calls) == 1 for calls in counting.checks)  # the global limit alone, once


def test_a_key_func_int_and_its_text_are_one_key(backend: Backend, clock: FakeClock) -> None:
    app, limiter, _ = make_app(backend(), clock)
    t = "7"

    @app.get("/report")
    @limiter.limit("2/minute", key_func=lambda: int(t) if "int" in request.args else t)
    def report() -> str:
        return "ok"

    client = app.test_client()
    assert client.get("/report?int=1").status_code == 200
    assert client.get("/report").status_code == 200
    assert client.get("/report?int=1").status_code == 429


# -- keyed digests -----------------------------------------------------------------------------


def _public_tag(identity: str) -> str:
    """The tag an unkeyed digest gives an identity: anyone can compute it offline."""
    return hashlib.blake2b(identity.encode(), digest_size=10).hexdigest()


@functools.cache
def _ground_usernames(count: int = 5) -> tuple[str, ...]:
    """Usernames an attacker ground, offline, into one Cluster slot of the unkeyed digest (about
    65,000 hashes: a fraction of a second)."""
    target = key_slot(_public_tag("func:u0").encode())
    found = ["u0"]
    i = 0
    while len(found) < count:
        i += 1
        if key_slot(_public_tag(f"func:u{i}").encode()) == target:
            found.append(f"u{i}")
    return tuple(found)


def test_clients_cannot_grind_their_keys_into_one_cluster_slot(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, counting = make_app(backend(), clock)

    @app.post("/login")
    @limiter.limit("100/minute", key_func=lambda: request.form["username"])
    def login() -> str:
        return "ok"

    client = app.test_client()
    names = _ground_usernames()
    for name in names:
        assert client.post("/login", data={"username": name}).status_code == 200
    keys = [check.key for checks in counting.checks for check in checks]
    assert len(keys) == len(names)
    # Keyed with the app's secret, the ground names scatter (all in one slot by chance: 1 in
    # 16384**4), and no key carries a tag computable without the secret.
    assert len({key_slot(key.encode()) for key in keys}) > 1
    assert not any(_public_tag(f"func:{name}") in key for name in names for key in keys)


def _app_without_secret(url: str, clock: FakeClock, name: str) -> Flask:
    app = Flask(name)
    app.config.update(
        DISTLIMIT_STORAGE_URL=url,
        DISTLIMIT_TIERS={"anonymous": ""},
        DISTLIMIT_KEY_PREFIX="kept",
    )
    limiter = Limiter(app, clock=clock)

    @app.get("/")
    @limiter.limit("3/minute")
    def index() -> str:
        return "ok"

    return app


@pytest.mark.redis
def test_without_a_secret_every_worker_reads_the_key_the_storage_keeps(
    redis_server: RedisProcess,
    redis_client: redis.Redis,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two workers (apps) of one deployment without SECRET_KEY share their counts: both read the
    digest key the first one set in Redis, which never expires; they agree again after a flush."""
    first = _app_without_secret(redis_server.url, clock, "first")
    second = _app_without_secret(redis_server.url, clock, "second")
    apps = [first, second]
    try:
        statuses = [app.test_client().get("/").status_code for app in (first, second) * 2]
        assert statuses == [200, 200, 200, 429]
        assert SHARED_KEY_TTL == 0 and redis_client.ttl("kept:identity-digest-key") == -1
        assert not any(_public_tag("ip:127.0.0.1") in k.decode() for k in redis_client.scan_iter())
        assert Limiter.state(first).reset() == 1  # the counter, never the deployment's key
        assert redis_client.exists("kept:identity-digest-key")

        # A flushed Redis: a worker started now sets a new key; the running one adopts it at
        # its next refresh, and from then on they count together again.
        redis_client.flushall()
        third = _app_without_secret(redis_server.url, clock, "third")
        apps.append(third)
        third.test_client().get("/")
        clock.advance(max(REFRESH_INTERVAL, 120.0))  # the refresh is due; both windows fresh
        with caplog.at_level(logging.WARNING, "flask_distlimit"):
            statuses = [app.test_client().get("/").status_code for app in (first, third) * 2]
        assert statuses == [200, 200, 200, 429]
        assert "changed in the storage" in caplog.text
    finally:
        for app in apps:
            Limiter.state(app).storage.close()


def test_a_secret_needs_no_storage_round_trip(backend: Backend, clock: FakeClock) -> None:
    storage = backend()
    app, _, _ = make_app(storage, clock)  # SECRET_KEY set
    state = Limiter.state(app)
    assert state.tags.source == "secret" and state.tags.settled
    app.test_client().get("/nothing")
    if isinstance(storage, RedisStorage):
        assert not storage.client.exists("ratelimit:identity-digest-key")


# -- canonical API keys ------------------------------------------------------------------------

KEY = "0123456789abcdef0123456789abcdef"  # 32 hex digits; the verifier ignores case


def _spellings(count: int) -> list[str]:
    """``count`` spellings of KEY a case-insensitive verifier accepts (up to 2**16 of them)."""
    letters = [i for i, ch in enumerate(KEY) if ch.isalpha()]
    found = []
    for n in range(count):
        chars = list(KEY)
        for bit, i in enumerate(letters):
            if n >> bit & 1:
                chars[i] = chars[i].upper()
        found.append("".join(chars))
    return found


def test_an_api_key_is_counted_by_the_id_the_verifier_accepted(
    backend: Backend, clock: FakeClock
) -> None:
    app, limiter, counting = make_app(
        backend(), clock, DISTLIMIT_TIERS={"anonymous": "", "pro": ""}
    )

    @limiter.api_key_verifier
    def verify(raw: str) -> tuple[str, str | None] | None:
        """Case-insensitive: one key, many spellings; answers its canonical id and its tier."""
        canonical = raw.lower()
        return (f"key-{canonical[:6]}", "pro") if canonical == KEY else None

    @app.get("/reports")
    @limiter.limit("3/minute")
    def reports() -> str:
        return "ok"

    client = app.test_client()
    spellings = _spellings(6)
    assert len(set(spellings)) == 6
    statuses = [client.get("/reports", headers={"X-Api-Key": k}).status_code for k in spellings]
    assert statuses == [200, 200, 200, 429, 429, 429]
    state = Limiter.state(app)
    keys = {check.key for checks in counting.checks for check in checks}
    with app.app_context():
        named = state.checks_for(state.resolver.api_key_identity("key-012345"))
    assert keys == {check.key for _, check in named}
    # Still only an HMAC digest in the key: neither the key nor its id in clear.
    assert not any(KEY in k.lower() or "key-012345" in k for k in keys)


def test_a_reset_takes_only_its_own_apps_keys_when_a_prefix_extends_it(
    backend: Backend, clock: FakeClock
) -> None:
    """A prefix may hold ":" (``rl`` and ``rl:admin`` on one Redis): resetting the app of ``rl``
    forgets its own counts and its leases' records, not the counts of the app of ``rl:admin``
    (``<prefix>:*`` matched both)."""
    apps = {}
    for prefix in ("rl", "rl:admin"):
        app, limiter, _ = make_app(
            backend(),
            clock,
            name=prefix.replace(":", "-"),
            DISTLIMIT_KEY_PREFIX=prefix,
        )

        @app.get("/")
        @limiter.limit("3/minute", key_func=lambda: "alice")
        def index() -> str:
            return "ok"

        apps[prefix] = (app, limiter)
    for app, _ in apps.values():
        assert app.test_client().get("/").headers["X-RateLimit-Remaining"] == "2"
    outer, outer_limiter = apps["rl"]
    assert outer_limiter.reset(outer) >= 1
    inner, _ = apps["rl:admin"]
    assert inner.test_client().get("/").headers["X-RateLimit-Remaining"] == "1"  # kept
    assert outer.test_client().get("/").headers["X-RateLimit-Remaining"] == "2"  # forgotten
