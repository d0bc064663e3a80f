"""Identity tags: keyed digests, and the digest key a deployment without a secret keeps in its
storage (``flask_distlimit.identity.digests``)."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable

import pytest
import redis
from flask import Flask
from redis.cluster import RedisCluster

from flask_distlimit import Limiter
from flask_distlimit.errors import StorageUnavailable
from flask_distlimit.identity.digests import (
    _CACHE_SIZE,
    RETRY_INTERVAL,
    SECRET_SEEN_TTL,
    SHARED_KEY_TTL,
    IdentityTags,
    digest_key,
    tag_secret,
)
from flask_distlimit.storage.cluster import ClusterStorage
from flask_distlimit.storage.memory import MemoryStorage
from flask_distlimit.storage.redis import RedisStorage
from tests.servers import ClusterServers, RedisProcess

HEX20 = re.compile(r"[0-9a-f]{20}")


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _Flaky(MemoryStorage):
    """Refuses ``shared_value`` the first ``failures`` times, then keeps it as memory does."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures
        self.calls = 0

    def shared_value(self, key: str, candidate: str, ttl: int) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise StorageUnavailable("connection refused")
        return super().shared_value(key, candidate, ttl)


def test_tags_are_keyed_fixed_size_and_depend_on_the_secret() -> None:
    one, same, other = (
        IdentityTags(tag_secret(s)) for s in (b"secret-1", b"secret-1", b"secret-2")
    )
    for text in ("ip:203.0.113.9", "func:" + "x" * 10_000, "user:\ud800{}\n"):
        assert HEX20.fullmatch(one.tag(text))
        assert one.tag(text) == same.tag(text) != other.tag(text)
    assert one.tag("ip:1.2.3.4") != one.tag("func:ip:1.2.3.4")
    assert tag_secret(b"s") != b"s" and len(tag_secret(b"s")) == 32


def test_tags_are_cached_within_bounds_and_never_for_a_long_identity() -> None:
    tags = IdentityTags(tag_secret(b"s"))
    long = "func:" + "x" * 200  # a key_func may answer kilobytes: hashed every time
    assert tags.tag(long) == tags.tag(long) == IdentityTags(tag_secret(b"s")).tag(long)
    first = tags.tag("ip:203.0.113.9")
    for i in range(3 * _CACHE_SIZE):
        assert HEX20.fullmatch(tags.tag(f"ip:10.0.{i // 256}.{i % 256}"))
        assert len(tags._tags) <= _CACHE_SIZE and long not in tags._tags
    assert tags.tag("ip:203.0.113.9") == first  # made again, the same


def test_workers_on_one_redis_read_one_key_without_a_ttl(redis_client: redis.Redis) -> None:
    port = redis_client.connection_pool.connection_kwargs["port"]
    storages = [RedisStorage(host="127.0.0.1", port=port) for _ in range(3)]
    try:
        tags = [IdentityTags(storage=s, key_prefix="w") for s in storages]
        assert len({t.tag("ip:203.0.113.9") for t in tags}) == 1
        assert all(t.settled and t.source == "storage" for t in tags)
        assert SHARED_KEY_TTL == 0 and redis_client.ttl("w:identity-digest-key") == -1
        assert len(redis_client.get("w:identity-digest-key") or b"") == 64
    finally:
        for s in storages:
            s.close()


@pytest.mark.parametrize(
    "garbage",
    [b"\xff\xfe", b"", b"x", b"\xff" * 64, b"a" * 63, b"0" * 2_000_000],
    ids=["not-text", "empty", "one-byte", "not-letters", "short", "two-megabytes"],
)
def test_a_digest_key_of_another_form_is_replaced(
    redis_client: redis.Redis, garbage: bytes
) -> None:
    """A value no process wrote (bytes that are no text, a weak or a huge one) was adopted: a
    500 every few seconds (not text), a weak HMAC key, a read that times out (huge), or each
    process digesting identities its own way (a client counted once per process). Replaced by
    the first process that reads it, and adopted by every other."""
    redis_client.set("z:identity-digest-key", garbage)
    port = redis_client.connection_pool.connection_kwargs["port"]
    storages = [RedisStorage(host="127.0.0.1", port=port) for _ in range(2)]
    try:
        tags = [IdentityTags(storage=s, key_prefix="z") for s in storages]
        assert len({t.tag("ip:203.0.113.9") for t in tags}) == 1
        stored = redis_client.get("z:identity-digest-key") or b""
        assert len(stored) == 64 and stored != garbage and all(t.settled for t in tags)
    finally:
        for s in storages:
            s.close()


@pytest.mark.cluster
def test_workers_on_one_cluster_read_one_key(
    redis_cluster: ClusterServers, cluster_client: RedisCluster
) -> None:
    storages = [ClusterStorage(redis_cluster.startup_nodes) for _ in range(2)]
    try:
        tags = [IdentityTags(storage=s, key_prefix="c") for s in storages]
        assert tags[0].tag("user:42") == tags[1].tag("user:42")
        assert cluster_client.ttl("c:identity-digest-key") == -1
    finally:
        for s in storages:
            s.close()


def test_memory_keeps_one_key_per_storage() -> None:
    shared = MemoryStorage()
    a, b = IdentityTags(storage=shared), IdentityTags(storage=shared)
    assert a.tag("ip:1.2.3.4") == b.tag("ip:1.2.3.4")
    assert IdentityTags(storage=MemoryStorage()).tag("ip:1.2.3.4") != a.tag("ip:1.2.3.4")


def test_a_storage_down_at_start_up_is_tried_again_later(caplog: pytest.LogCaptureFixture) -> None:
    clock = _Clock()
    storage = _Flaky(failures=1)
    tags = IdentityTags(storage=storage, clock=clock)
    with caplog.at_level(logging.WARNING, "flask_distlimit"):
        provisional = tags.tag("ip:1.2.3.4")
        assert tags.tag("ip:1.2.3.4") == provisional  # no retry before RETRY_INTERVAL
    assert storage.calls == 1 and not tags.settled
    assert "Set DISTLIMIT_API_KEY_SECRET or SECRET_KEY" in caplog.text
    clock.now += RETRY_INTERVAL
    settled = tags.tag("ip:1.2.3.4")
    assert tags.settled and storage.calls == 2
    assert settled == IdentityTags(storage=storage).tag("ip:1.2.3.4")  # the deployment's key


def test_no_attempt_while_the_breaker_is_open() -> None:
    clock = _Clock()
    storage = _Flaky(failures=0)
    open_ = [True]
    heard: list[BaseException | None] = []
    asked: list[tuple[str, str]] = []

    class Guard:
        def open_side_call(
            self, key: str, what: str
        ) -> Callable[[BaseException | None], None] | None:
            asked.append((key, what))
            return None if open_[0] else heard.append

    tags = IdentityTags(storage=storage, clock=clock, guard=Guard())
    tags.tag("ip:1.2.3.4")
    assert storage.calls == 0 and not tags.settled
    open_[0] = False
    clock.now += RETRY_INTERVAL
    tags.tag("ip:1.2.3.4")
    assert storage.calls == 1 and tags.settled
    assert heard == [None]  # the breaker hears the answer
    assert asked == [(digest_key("ratelimit"), "the identity tag key's read")] * 2


def test_tools_require_the_key_or_fail() -> None:
    storage = _Flaky(failures=1)
    tags = IdentityTags(storage=storage)
    with pytest.raises(StorageUnavailable):
        tags.require()
    tags.require()
    assert tags.settled
    IdentityTags(tag_secret(b"s")).require()  # a secret needs no storage


def test_threads_arriving_first_wait_for_the_shared_key() -> None:
    started = threading.Event()
    release = threading.Event()

    class Slow(MemoryStorage):
        def shared_value(self, key: str, candidate: str, ttl: int) -> str:
            started.set()
            release.wait(5)
            return super().shared_value(key, candidate, ttl)

    storage = Slow()
    tags = IdentityTags(storage=storage)
    found: list[str] = []
    threads = [
        threading.Thread(target=lambda: found.append(tags.tag("ip:9.9.9.9"))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    assert started.wait(5)
    release.set()
    for t in threads:
        t.join(5)
    assert len(found) == 4 and len(set(found)) == 1
    assert found[0] == IdentityTags(storage=storage).tag("ip:9.9.9.9")


def test_neither_a_secret_nor_a_storage_is_refused() -> None:
    with pytest.raises(ValueError, match="secret or a storage"):
        IdentityTags()


def _secret_app(url: str, secret: str, prefix: str = "secrets") -> Flask:
    app = Flask("worker")
    app.config.update(SECRET_KEY=secret, DISTLIMIT_STORAGE_URL=url, DISTLIMIT_KEY_PREFIX=prefix)
    Limiter(app)
    return app


def test_processes_started_with_different_secrets_are_told_at_start_up(
    redis_server: RedisProcess, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A random SECRET_KEY per process (``os.urandom`` at import, each gunicorn worker its own)
    keyed every client apart in every worker: each limit admitted once per worker, silently."""
    apps = []
    with caplog.at_level(logging.ERROR, "flask_distlimit"):
        apps += [_secret_app(redis_server.url, "same-" + "s" * 30) for _ in range(2)]
        assert not caplog.records  # two workers, one secret
        apps.append(_secret_app(redis_server.url, "other-" + "s" * 30))
        apps.append(_secret_app(redis_server.url, "third-" + "s" * 30, prefix="own"))
        apps.append(_secret_app(redis_server.url, "third-" + "s" * 30, prefix="x-digest-key"))
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("2 secrets key identities") and "'secrets:identity-secrets'" in line
    assert "SECRET_KEY" in line and "DISTLIMIT_KEY_PREFIX" in line
    # the storage keeps a tag of each secret, never the secret, and forgets it
    members = redis_client.zrange("secrets:identity-secrets", 0, -1)
    assert len(members) == 2 and all(HEX20.fullmatch(m.decode()) for m in members)
    assert not any(b"same-" in m or b"other-" in m for m in members)
    assert 0 < redis_client.pttl("secrets:identity-secrets") <= SECRET_SEEN_TTL * 1000
    assert redis_client.exists("x-digest-key:identity-secrets")  # under its prefix, whatever it is
    for app in apps:
        Limiter.state(app).storage.close()
