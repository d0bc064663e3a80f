"""The identity digest key a deployment without a secret keeps in Redis survives memory pressure.

It used to carry a TTL of 400 days: under ``volatile-lru`` client-made keys got it evicted
(after 1,476 requests in the review), a process started afterwards wrote a new one, and every
limit counted each client twice. It now has no TTL, so no ``volatile-*`` policy (nor
``noeviction``) ever evicts it, and a process started after the pressure keys every client the
way the running ones do. Real redis-server processes with ``maxmemory`` and each policy.
"""

from __future__ import annotations

import logging

import pytest
import redis
from flask import Flask
from redis import exceptions as rx

from flask_distlimit import Limiter
from flask_distlimit.testing import FakeClock
from tests.servers import start_redis

pytestmark = pytest.mark.redis

KEY = "kept:identity-digest-key"


def _app(url: str, clock: FakeClock, name: str, **config: object) -> Flask:
    app = Flask(name)
    app.config.update(
        DISTLIMIT_STORAGE_URL=url,
        DISTLIMIT_TIERS={"anonymous": ""},
        DISTLIMIT_KEY_PREFIX="kept",
        DISTLIMIT_REDIS_TIMEOUT=2.0,
        **config,
    )
    limiter = Limiter(app, clock=clock)

    @app.get("/")
    @limiter.limit("3/minute")
    def index() -> str:
        return "ok"

    return app


def _pressure(client: redis.Redis, megabytes: int) -> None:
    """Write about ``megabytes`` MB of keys with a TTL, as client-chosen limit keys are: several
    times maxmemory, so the server evicts (or, under noeviction, refuses) over and over."""
    chunk = "v" * 1024
    for batch in range(megabytes * 10):
        try:
            with client.pipeline(transaction=False) as pipe:
                for i in range(100):
                    pipe.set(f"kept:{{c{batch}-{i}}}:route:fixed_window", chunk, ex=3600)
                pipe.execute()
        except rx.OutOfMemoryError:
            return


@pytest.mark.parametrize(
    "policy", ["volatile-lru", "volatile-lfu", "volatile-ttl", "volatile-random", "noeviction"]
)
@pytest.mark.slow
def test_the_digest_key_survives_eviction_and_a_new_process_counts_with_the_old(
    policy: str,
) -> None:
    server = start_redis("--maxmemory", "4mb", "--maxmemory-policy", policy)
    clock = FakeClock(start=1_700_000_040.0)
    admin = server.client()
    apps: list[Flask] = []
    try:
        old = _app(server.url, clock, "old")
        apps.append(old)
        assert old.test_client().get("/").status_code == 200  # reads (sets) the key
        assert admin.ttl(KEY) == -1
        _pressure(admin, 12)
        if policy != "noeviction":
            assert int(admin.info("stats")["evicted_keys"]) > 1000
        assert admin.exists(KEY), f"the digest key was evicted under {policy}"
        if policy == "noeviction":
            admin.flushdb()  # room for the counters; the key is written back by the old process
            clock.advance(60.0)
            assert old.test_client().get("/").status_code == 200
        else:
            admin.delete(*admin.keys("kept:{c*"))  # room for the counters again
        clock.advance(120.0)  # fresh windows for both (the sliding counter weighs the last)
        new = _app(server.url, clock, "new")
        apps.append(new)
        statuses = [app.test_client().get("/").status_code for app in (old, new) * 2]
        assert statuses == [200, 200, 200, 429]  # one client, keyed one way by both
    finally:
        for app in apps:
            Limiter.state(app).storage.close()
        admin.close()
        server.stop()


def test_a_ttl_left_by_an_older_version_is_removed() -> None:
    server = start_redis()
    admin = server.client()
    try:
        admin.set(KEY, "a" * 64, ex=400 * 86400)
        app = _app(server.url, FakeClock(start=1_700_000_040.0), "app")
        app.test_client().get("/")
        assert admin.get(KEY) == b"a" * 64 and admin.ttl(KEY) == -1
        Limiter.state(app).storage.close()
    finally:
        admin.close()
        server.stop()


def test_start_up_warns_when_no_secret_is_set(caplog: pytest.LogCaptureFixture) -> None:
    server = start_redis()
    try:
        clock = FakeClock(start=1_700_000_040.0)
        with caplog.at_level(logging.WARNING, "flask_distlimit"):
            app = _app(server.url, clock, "nosecret")
        lines = [r for r in caplog.records if "Neither DISTLIMIT_API_KEY_SECRET" in r.message]
        assert len(lines) == 1 and "noeviction" in lines[0].message
        Limiter.state(app).storage.close()
        caplog.clear()
        with caplog.at_level(logging.WARNING, "flask_distlimit"):
            app = _app(server.url, clock, "secret", SECRET_KEY="s" * 32)
        assert "Neither DISTLIMIT_API_KEY_SECRET" not in caplog.text
        Limiter.state(app).storage.close()
    finally:
        server.stop()
