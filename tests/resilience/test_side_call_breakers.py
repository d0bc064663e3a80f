"""Calls beside a request's (a concurrency slot's release, the read of the storage-kept identity
tag key) tell the breaker of the node they went to how they ended, on real servers: an outage
counts toward opening that node's breaker and no other's, an answer (an error reply included)
resets its count, and ``health()`` shows each node's breaker figures.

The servers are killed by PID (``kill -9``) inside the view, after the request's own call was
answered and before the release is sent; an error reply is made by the real script, fed
arguments it refuses for the release only. Clocks are fake: nothing waits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from flask import Flask, request
from redis.cluster import RedisCluster

from flask_distlimit import Limiter
from flask_distlimit.core.decision import Check
from flask_distlimit.errors import StorageUnavailable
from flask_distlimit.identity.digests import RETRY_INTERVAL, digest_key
from flask_distlimit.resilience.guard import Guard
from flask_distlimit.storage import from_url
from flask_distlimit.storage.base import Storage
from flask_distlimit.testing import CountingStorage
from tests.distlimit_fixtures import QUIET
from tests.servers import ClusterServers, RedisProcess, node_name, primaries, start_redis

pytestmark = [pytest.mark.redis]

T0_US = 1_700_000_000_000_000


class UsClock:
    """The limiter's injected clock, in microseconds; the breakers see it in seconds."""

    def __init__(self) -> None:
        self.now = T0_US

    def __call__(self) -> int:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += int(seconds * 1_000_000)


class SlotApp:
    """One route holding a slot of two concurrency limits (by ``X-Client``, by ``X-Team``)
    while it runs; ``during`` runs inside the view, after the request's own storage call and
    before the release. Policy ``open``, ``fail_max`` outages open a breaker."""

    def __init__(
        self, url: str, *, fail_max: int, storage: Storage | None = None, secret: bool = True
    ) -> None:
        self.clock = UsClock()
        self.during: Callable[[], None] = lambda: None
        app = Flask("side-calls")
        app.config.update(QUIET)
        if not secret:
            del app.config["SECRET_KEY"]  # the tag key is kept in the storage
        app.config.update(
            DISTLIMIT_STORAGE_URL=url,
            DISTLIMIT_FAILURE_POLICY="open",
            DISTLIMIT_BREAKER_FAIL_MAX=fail_max,
            DISTLIMIT_BREAKER_RESET_TIMEOUT=30,
            DISTLIMIT_REDIS_TIMEOUT=0.25,
        )
        self.limiter = Limiter(app, storage=storage, clock=self.clock)

        @app.get("/")
        @self.limiter.concurrency(1, key_func=lambda: request.headers["X-Client"])
        @self.limiter.concurrency(1, key_func=lambda: request.headers["X-Team"], scope="team")
        def index() -> str:
            self.during()
            return "ok"

        self.app = app
        self.state = self.limiter.state(app)
        self.guard: Guard = self.state.guard
        self.client = app.test_client()

    def get(self, who: str, team: str, during: Callable[[], None] = lambda: None) -> int:
        self.during = during
        try:
            return self.client.get("/", headers={"X-Client": who, "X-Team": team}).status_code
        finally:
            self.during = lambda: None

    def who_on(self, cluster: ClusterServers, node: str) -> str:
        """A header value whose slot key lives on ``node``."""
        for n in range(2000):
            tag = self.state.identity_tag(f"func:who-{n}")
            if node_name(cluster, f"{{{tag}}}") == node:
                return f"who-{n}"
        raise AssertionError(f"no identity on {node}")

    def failures(self) -> dict[str, tuple[str, int]]:
        """Each node's breaker: its state and its count of consecutive outages."""
        breakers = self.guard.breakers
        return {n: (breakers.get(n).state, breakers.get(n).failures) for n in breakers.states()}

    def figures(self) -> dict[str, Any]:
        nodes = self.guard.health()["breaker_nodes"]
        assert isinstance(nodes, dict)
        return nodes


def closed(failures: int = 0) -> dict[str, object]:
    return {"state": "closed", "failures": failures, "open_seconds": None}


# -- an outage met by a release counts on its node's breaker, and on no other -----------------


@pytest.mark.cluster
@pytest.mark.slow
def test_a_release_that_finds_its_primary_dead_counts_on_that_primarys_breaker_only(
    cluster_factory: Callable[..., ClusterServers],
) -> None:
    """The client's slot lives on one primary, the team's on another; the third serves the
    instance heartbeat key (the one ``breaker_failures`` used to describe). The client's
    primary is killed inside the view: the request was answered, the release of its slot meets
    a refused connection, and that primary's breaker counts it (one failure of two); the team's
    slot is given back on its live primary, whose breaker, like the heartbeat primary's, stays
    closed at 0. The next request of that client fails on the dead primary too: its breaker
    opens, and ``health()`` shows every primary's figures, the dead one in the aggregate keys.
    """
    cluster = cluster_factory(replicas=0, node_timeout_ms=60_000)  # no failover
    side = SlotApp(cluster.url, fail_max=2)
    guard = side.guard
    heartbeat = node_name(cluster, guard.instances.key)
    dead, live = [n for n in primaries(cluster) if n != heartbeat]
    who, team = side.who_on(cluster, dead), side.who_on(cluster, live)
    try:
        assert side.get(who, team) == 200  # connected to both; both slots given back
        guard.health()  # makes the heartbeat primary's breaker, as health() always did
        assert side.failures() == {
            dead: ("closed", 0),
            live: ("closed", 0),
            heartbeat: ("closed", 0),
        }

        victim = cluster.node(int(dead.rpartition(":")[2]))
        assert side.get(who, team, during=victim.stop) == 200  # kill -9 inside the view
        assert side.failures() == {
            dead: ("closed", 1),
            live: ("closed", 0),
            heartbeat: ("closed", 0),
        }
        assert side.figures() == {dead: closed(1), live: closed(), heartbeat: closed()}
        health = guard.health()
        assert (health["breaker"], health["breaker_failures"]) == ("closed", 1)
        assert health["breaker_open_seconds"] is None
        assert side.get(team, team) == 200  # the team's slot was given back on its primary

        assert side.get(who, team) == 200  # degraded (policy open): the second outage
        opened = {"state": "open", "failures": 2, "open_seconds": 0.0}
        assert side.figures() == {dead: opened, live: closed(), heartbeat: closed()}
        side.clock.advance(12.5)
        health = guard.health()
        assert health["breaker_nodes"] == {
            dead: {**opened, "open_seconds": 12.5},
            live: closed(),
            heartbeat: closed(),
        }
        assert health["breakers"] == {dead: "open", live: "closed", heartbeat: "closed"}
        assert (health["breaker"], health["ok"]) == ("open", False)
        assert (health["breaker_failures"], health["breaker_open_seconds"]) == (2, 12.5)
        assert guard.breaker.state == "closed"  # the heartbeat key's node
    finally:
        side.state.storage.close()


@pytest.fixture
def server() -> Iterator[RedisProcess]:
    made = start_redis()
    try:
        yield made
    finally:
        made.stop()


def test_a_release_that_finds_the_single_node_dead_counts_on_its_breaker(
    server: RedisProcess,
) -> None:
    side = SlotApp(server.url, fail_max=2)
    try:
        assert side.get("alice", "a-team") == 200
        assert side.get("alice", "a-team", during=server.stop) == 200  # kill -9 inside the view
        assert side.failures() == {"redis": ("closed", 1)}  # the release's outage
        assert side.get("alice", "a-team") == 200  # degraded: the second outage opens it
        assert side.failures() == {"redis": ("open", 2)}
        assert side.figures() == {"redis": {"state": "open", "failures": 2, "open_seconds": 0.0}}
        assert side.guard.health()["breaker_failures"] == 2
    finally:
        side.state.storage.close()


# -- an error reply to a release is an answer: never a failure, and it resets the count -------


def garble_releases(monkeypatch: pytest.MonkeyPatch, module: Any, tag: str) -> None:
    """The release of a slot whose key holds ``tag`` gets arguments the real script refuses
    (an error reply); every other call is sent as it is."""
    script_args = module.script_args

    def garbled(checks: list[Check], *args: Any, **kwargs: Any) -> tuple[list[str], list[str]]:
        keys, argv = script_args(checks, *args, **kwargs)
        if any(c.release and tag in c.key for c in checks):
            return keys, [f"{argv[0]},7"]
        return keys, argv

    monkeypatch.setattr(module, "script_args", garbled)


def test_an_error_reply_to_a_release_is_an_answer_on_the_single_node(
    redis_server: RedisProcess, redis_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One outage is on the count when the release goes out (after the request's own call,
    which reset it); the release meets an error reply: an answer, so the count goes back to 0
    (it would reach 2 of 2 and open the breaker, were it taken for an outage); counted as an
    unreadable reply; the request is answered 200."""
    from flask_distlimit.storage import redis as redis_storage

    side = SlotApp(redis_server.url, fail_max=2)
    garble_releases(monkeypatch, redis_storage, side.state.identity_tag("func:alice"))
    breaker = side.guard.breaker

    def one_outage() -> None:
        breaker.failure(StorageUnavailable("an outage before the release"))

    try:
        assert side.get("alice", "a-team", during=one_outage) == 200
        assert side.failures() == {"redis": ("closed", 0)}
        assert side.guard.health()["unreadable_replies"] == 1
    finally:
        side.state.storage.close()


@pytest.mark.cluster
def test_an_error_reply_to_a_release_is_an_answer_on_its_primary(
    redis_cluster: ClusterServers, cluster_client: RedisCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on one node, per primary: the primary whose release meets an error reply has one
    outage on its count when the release goes out, and the error reply resets it."""
    from flask_distlimit.storage import cluster as cluster_storage
    from flask_distlimit.storage import tokens

    side = SlotApp(redis_cluster.url, fail_max=2)
    guard = side.guard
    heartbeat = node_name(redis_cluster, guard.instances.key)
    garbled, other = [n for n in primaries(redis_cluster) if n != heartbeat]
    who, team = side.who_on(redis_cluster, garbled), side.who_on(redis_cluster, other)
    for module in (cluster_storage, tokens):  # tokens: where the slot groups' calls are made
        garble_releases(monkeypatch, module, side.state.identity_tag(f"func:{who}"))

    def one_outage() -> None:
        guard.breakers.get(garbled).failure(StorageUnavailable("an outage before the release"))

    try:
        assert side.get(who, team, during=one_outage) == 200
        assert side.failures()[garbled] == ("closed", 0)
        assert {side.failures()[n] for n in (other, heartbeat) if n in side.failures()} <= {
            ("closed", 0)
        }
        assert guard.health()["unreadable_replies"] == 1
        assert side.get(team, team) == 200  # the team's slot was given back, as ever
    finally:
        side.state.storage.close()


# -- the identity tag key's read ---------------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.slow
def test_the_tag_keys_read_counts_an_outage_on_its_own_primary_only(
    cluster_factory: Callable[..., ClusterServers],
) -> None:
    """No app secret: the identity tag key is kept in the storage. Its primary is killed
    before the first request: the read meets a refused connection and that primary's breaker
    counts it, the other primaries' (the instance heartbeat's among them) stay at 0. The read
    is tried again after :data:`RETRY_INTERVAL` (no sooner: no call per request); the second
    outage opens that breaker, after which the read is not tried while it is open."""
    cluster = cluster_factory(replicas=0, node_timeout_ms=60_000)
    prefix = next(
        p
        for p in (f"tags{n}" for n in range(100))
        if node_name(cluster, digest_key(p)) != node_name(cluster, f"{p}:instances")
    )
    storage = Counted(from_url(cluster.url, timeout=0.25))
    storage.ping()  # the client knows the slot map
    app = Flask("tags")
    app.config.update(
        DISTLIMIT_TIERS={"anonymous": ""},
        DISTLIMIT_KEY_PREFIX=prefix,
        DISTLIMIT_BREAKER_FAIL_MAX=2,  # no SECRET_KEY: the tag key is kept in the storage
    )
    clock = UsClock()
    limiter = Limiter(app, storage=storage, clock=clock)
    state = limiter.state(app)
    guard, tags = state.guard, state.tags
    tag_node = node_name(cluster, tags.storage_key)
    others = [n for n in primaries(cluster) if n != tag_node]
    for node in primaries(cluster):
        guard.breakers.get(node)
    try:
        cluster.primary_for(tags.storage_key).stop()  # kill -9
        state.identity_tag("ip:203.0.113.9")
        assert (storage.shared_reads, tags.settled) == (1, False)
        failures = {n: guard.breakers.get(n).failures for n in guard.breakers.states()}
        assert failures == {tag_node: 1, **dict.fromkeys(others, 0)}
        state.identity_tag("ip:203.0.113.9")
        assert storage.shared_reads == 1  # not before RETRY_INTERVAL
        clock.advance(RETRY_INTERVAL)
        state.identity_tag("ip:203.0.113.9")
        assert storage.shared_reads == 2
        assert guard.breakers.states() == {tag_node: "open", **dict.fromkeys(others, "closed")}
        clock.advance(RETRY_INTERVAL)
        state.identity_tag("ip:203.0.113.9")
        assert storage.shared_reads == 2  # its breaker is open: not tried
    finally:
        storage.close()


class Counted(CountingStorage):
    """Counts the reads of the storage-kept identity tag key."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.shared_reads = 0

    def shared_value(self, key: str, candidate: str, ttl: int) -> str:
        self.shared_reads += 1
        return super().shared_value(key, candidate, ttl)
