"""A Redis that refuses the limiter (bad credentials, missing ACL permissions, a database index out
of range, a disabled command) raises StorageMisconfigured, an outage whose message names the
cause and the fix, on every storage path: the hand-packed EVALSHA of a storage-built single-node
pool, a ready redis-py client, Sentinel (its master and the Sentinels themselves) and Cluster (one
slot group and several). Real redis-server processes; no fakes."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from flask_distlimit.core.decision import Check
from flask_distlimit.errors import StorageMisconfigured, StorageResponseError
from flask_distlimit.storage import from_url
from flask_distlimit.storage.base import Storage
from flask_distlimit.storage.redis import RedisStorage
from flask_distlimit.storage.translate import ACL_GRANTS
from tests.servers import (
    SERVER,
    ClusterServers,
    RedisProcess,
    SentinelServers,
    start_redis,
    start_redis_with_acl,
)

pytestmark = pytest.mark.redis

PASSWORD = "adm1n-pw"
USERS = {
    # Redis 7.0 syntax: the brief's "ACL SETUSER limited on >pw ~* +@all -evalsha -eval".
    "limited": ["on", ">pw", "~*", "+@all", "-evalsha", "-eval"],
    "nokeys": ["on", ">pw", "~other:*", "+@all"],
    "notime": ["on", ">pw", "~*", "+@all", "-time"],  # refused inside the script
    # Exactly what the StorageMisconfigured message tells an operator to grant.
    "minimal": ["on", ">pw", "~t:*", *ACL_GRANTS.split()],
}
ONE = [Check("t:{alice}:per-ip:fixed_window", "fixed_window", 5, 60)]
TWO_SLOTS = [*ONE, Check("t:{bob}:per-ip:fixed_window", "fixed_window", 5, 60)]


@pytest.fixture(scope="module")
def acl_server() -> Iterator[RedisProcess]:
    server = start_redis_with_acl(PASSWORD, USERS)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def no_scripting() -> Iterator[RedisProcess]:
    """A server where EVALSHA is disabled (rename-command EVALSHA ""), as some proxies do."""
    server = start_redis("--rename-command", "EVALSHA", "")
    try:
        yield server
    finally:
        server.stop()


def refusal(storage: Storage, checks: list[Check] = ONE) -> str:
    """The message of the StorageMisconfigured that ``evaluate`` raises."""
    try:
        with pytest.raises(StorageMisconfigured) as caught:
            storage.evaluate(checks)
    finally:
        storage.close()
    return str(caught.value)


CASES = [
    pytest.param(":wrong@", "/0", ["WRONGPASS", "Fix the user name and password"], id="wrongpass"),
    pytest.param("nobody:pw@", "/0", ["WRONGPASS", "DISTLIMIT_STORAGE_URL"], id="unknown user"),
    pytest.param("", "/0", ["NOAUTH", "Fix the user name and password"], id="noauth"),
    pytest.param(
        "limited:pw@", "/0", ["NOPERM", "'evalsha'", "ACL SETUSER <user> +evalsha"], id="noperm"
    ),
    pytest.param("nokeys:pw@", "/0", ["NOPERM", "keys", "~<DISTLIMIT_KEY_PREFIX>:*"], id="keys"),
    pytest.param(
        "notime:pw@",
        "/0",
        # Redis 7: "... can't run this command"; Valkey 8: "ACL failure in script: ... 'time'"
        ["ACL failure in script" if SERVER == "valkey" else "can't run this command", "+time"],
        id="in-script",
    ),
    pytest.param(f":{PASSWORD}@", "/99", ["DB index is out of range", "redis://"], id="db 99"),
]


@pytest.mark.parametrize(("userinfo", "path", "expected"), CASES)
@pytest.mark.parametrize("client", ["built", "ready"], ids=["our pool", "redis-py client"])
def test_a_refusal_is_misconfigured_with_the_fix(
    acl_server: RedisProcess, userinfo: str, path: str, expected: list[str], client: str
) -> None:
    url = f"redis://{userinfo}127.0.0.1:{acl_server.port}{path}"
    ready = redis.Redis.from_url(url, socket_timeout=1)
    if client == "built":
        storage = from_url(url, timeout=1)
        assert isinstance(storage, RedisStorage) and storage.pool is not None  # the hot pool
    else:
        storage = RedisStorage(ready)
    try:
        message = refusal(storage)
    finally:
        ready.close()
    for text in expected:
        assert text in message
    assert PASSWORD not in message


@pytest.mark.parametrize("client", ["built", "ready"], ids=["our pool", "redis-py client"])
def test_a_disabled_command_is_misconfigured(no_scripting: RedisProcess, client: str) -> None:
    ready = redis.Redis(port=no_scripting.port, socket_timeout=1)
    storage = from_url(no_scripting.url, timeout=1) if client == "built" else RedisStorage(ready)
    try:
        message = refusal(storage)
    finally:
        ready.close()
    assert "unknown command 'EVALSHA'" in message
    assert "with args" not in message  # the keys and arguments stay out of the log
    assert "EVALSHA and SCRIPT LOAD" in message


def test_ping_and_script_checks_see_credential_and_database_refusals(
    acl_server: RedisProcess,
) -> None:
    for url in (
        f"redis://:wrong@127.0.0.1:{acl_server.port}/0",
        f"redis://:{PASSWORD}@127.0.0.1:{acl_server.port}/99",
    ):
        storage = from_url(url, timeout=1)
        try:
            with pytest.raises(StorageMisconfigured):
                storage.ping()
            with pytest.raises(StorageMisconfigured):
                storage.scripts_loaded()
            with pytest.raises(StorageMisconfigured):
                storage.heartbeat("t:instances", "me", 5)
        finally:
            storage.close()


def test_the_acl_grants_the_message_names_are_enough(acl_server: RedisProcess) -> None:
    """A user with exactly ACL_GRANTS and ~<prefix>:* runs every storage operation, including
    the reload after SCRIPT FLUSH (SCRIPT LOAD) and every algorithm."""
    admin = acl_server.client(password=PASSWORD)
    admin.flushall()
    admin.script_flush()
    storage = from_url(  # every call's token too: its SET needs a grant
        f"redis://minimal:pw@127.0.0.1:{acl_server.port}/0", timeout=1, request_tokens="always"
    )
    try:
        assert storage.scripts_loaded() is False
        assert storage.ping() > 0
        for algorithm in ("fixed_window", "sliding_window_log", "sliding_window_counter",
                          "token_bucket", "gcra"):  # fmt: skip
            checks = [Check(f"t:{{alice}}:r:{algorithm}", algorithm, 5, 60)]  # type: ignore[arg-type]
            assert storage.evaluate(checks).allowed
        admin.script_flush()
        assert storage.evaluate(TWO_SLOTS).allowed
        assert storage.heartbeat("t:instances", "me", 5) == 1
        assert storage.shared_value("t:identity-digest-key", "k", 0) == "k"  # PERSIST
        # the lease records, the dead process dropped and the records rebuilt included
        assert storage.publish_leases("t:leases", "gone", "{}", 0.001) == ()
        time.sleep(0.01)  # not a timed assertion: the record only gets older
        assert storage.publish_leases("t:leases", "me", "{}", 60) == ()
        assert [r.process for r in storage.lease_records("t:leases")] == ["me"]
        keys = sorted(storage.scan("t:*"))
        tokens = [k for k in keys if k.startswith("t:rq:")]  # each call's kept reply (a second)
        assert len(tokens) == 6  # SET under the user's ~t:* grant: one per evaluate
        # the algorithms', TWO_SLOTS', heartbeat's, digest key, lease records'
        assert len(keys) - len(tokens) == 5 + 2 + 2 + 1 + 2
        assert storage.delete(keys) == len(keys)
    finally:
        storage.close()
        admin.flushall()
        admin.close()


def test_any_other_error_reply_stays_a_bug(acl_server: RedisProcess) -> None:
    admin = acl_server.client(password=PASSWORD)
    storage = from_url(f"redis://:{PASSWORD}@127.0.0.1:{acl_server.port}/0", timeout=1)
    try:
        with pytest.raises(StorageResponseError) as caught:
            storage.shared_value("t:shared", "candidate", 10**17)  # PEXPIRE refuses the time
        assert not isinstance(caught.value, StorageMisconfigured)
    finally:
        storage.close()
        admin.flushall()
        admin.close()


# -- Sentinel ----------------------------------------------------------------------------------


def sentinel_hosts(group: SentinelServers) -> str:
    return ",".join(f"127.0.0.1:{s.port}" for s in group.sentinels)


@pytest.mark.sentinel
def test_sentinel_refusals_are_misconfigured(redis_sentinel: SentinelServers) -> None:
    hosts = sentinel_hosts(redis_sentinel)
    # The master refuses (the Sentinels accept their own default user).
    master = refusal(
        from_url(
            f"redis+sentinel://nobody:pw@{hosts}/mymaster"
            "?sentinel_username=default&sentinel_password=any",
            timeout=1,
        )
    )
    assert "WRONGPASS" in master
    # The Sentinels refuse: redis-py reports "no master found", with the causes in its text.
    sentinels = refusal(from_url(f"redis+sentinel://nobody:pw@{hosts}/mymaster", timeout=1))
    assert "Sentinels refuse the limiter's credentials" in sentinels
    assert "sentinel_username and sentinel_password" in sentinels
    database = refusal(from_url(f"redis+sentinel://{hosts}/mymaster/99", timeout=1))
    assert "DB index is out of range" in database


# -- Cluster -----------------------------------------------------------------------------------


def cluster_hosts(cluster: ClusterServers) -> str:
    return ",".join(f"127.0.0.1:{n.port}" for n in cluster.nodes[: cluster.primaries])


@pytest.mark.slow
@pytest.mark.cluster
def test_cluster_refusals_are_misconfigured(redis_cluster: ClusterServers) -> None:
    hosts = cluster_hosts(redis_cluster)
    # redis-py wraps the node's WRONGPASS in "Redis Cluster cannot be connected".
    wrong = refusal(from_url(f"redis+cluster://nobody:pw@{hosts}", timeout=1))
    assert "WRONGPASS" in wrong
    for node in redis_cluster.nodes:
        node.client().execute_command("ACL", "SETUSER", "limited", *USERS["limited"])
    try:
        url = f"redis+cluster://limited:pw@{hosts}"
        assert "NOPERM" in refusal(from_url(url, timeout=1))  # one slot group
        assert "NOPERM" in refusal(from_url(url, timeout=1), TWO_SLOTS)  # sent concurrently
    finally:
        for node in redis_cluster.nodes:
            node.client().execute_command("ACL", "DELUSER", "limited")


def test_a_cluster_url_on_a_single_server_is_misconfigured(no_scripting: RedisProcess) -> None:
    url = f"redis+cluster://127.0.0.1:{no_scripting.port}"
    message = refusal(from_url(url, timeout=1))
    assert "without cluster mode" in message
    assert "Use redis://" in message


def test_the_deployment_value_key_of_another_type_is_replaced(acl_server: RedisProcess) -> None:
    """Garbage on our key is repaired, never a 500: a hash where the digest key lives."""
    admin = acl_server.client(password=PASSWORD)
    admin.hset("t:identity-digest-key", "field", "a hash, not a string")
    storage = from_url(f"redis://minimal:pw@127.0.0.1:{acl_server.port}/0", timeout=1)
    try:
        assert storage.shared_value("t:identity-digest-key", "fresh", 60) == "fresh"
        assert storage.shared_value("t:identity-digest-key", "other", 60) == "fresh"
        assert 0 < admin.pttl("t:identity-digest-key") <= 60_000
    finally:
        storage.close()
        admin.flushall()
        admin.close()
