"""One breaker per primary on a real 3-primary Redis Cluster: kill -9 one primary and only the
identities whose keys live on it get the failure policy; the others stay exactly limited. The
node comes back: its breaker closes after the reset timeout (of a fake clock, no sleeping).

The cluster's node timeout is long (60 s), so the cluster neither fails over nor declares
itself down while a primary is dead: this is the window in which the limiter alone decides
what a dead shard costs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace

import pytest
from flask import Flask, request
from redis.cluster import RedisCluster

from flask_distlimit import Limiter
from flask_distlimit.core.decision import Check
from flask_distlimit.defences.concurrency import SlotRelease
from flask_distlimit.errors import StorageUnavailable
from flask_distlimit.identity.digests import digest_key
from flask_distlimit.resilience.guard import Guard
from flask_distlimit.storage import from_url
from flask_distlimit.storage.base import Storage
from flask_distlimit.storage.cluster import ClusterStorage
from flask_distlimit.testing import CountingStorage
from tests.distlimit_fixtures import QUIET
from tests.faults import kind_of
from tests.guard_helpers import FakeClock
from tests.servers import ClusterServers, node_name, primaries, tags_on_distinct_primaries

pytestmark = [pytest.mark.redis, pytest.mark.cluster, pytest.mark.slow]

RESET = 30.0  # seconds of the fake clock
EXPECTED_ON_DEAD = {
    "closed": ["unavailable"] * 4,
    "open": ["degraded allowed"] * 4,
    "local": ["degraded allowed"] * 3 + ["degraded denied"],  # limit 3, one instance
}


def gcra(tag: str, name: str, limit: int = 3) -> Check:
    return Check(f"t:{{{tag}}}:{name}:gcra", "gcra", limit, 3600)  # no window edge to cross


def kinds(guard: Guard, checks: list[Check], times: int) -> list[str]:
    return [kind_of(guard.evaluate(checks)) for _ in range(times)]


def test_a_killed_primary_degrades_only_the_identities_it_serves(
    cluster_factory: Callable[..., ClusterServers],
) -> None:
    cluster = cluster_factory(node_timeout_ms=60_000)
    storage = from_url(cluster.url, timeout=0.25)
    assert isinstance(storage, ClusterStorage)
    clock = FakeClock()
    guards = {
        policy: Guard(storage, policy=policy, fail_max=1, reset_timeout=RESET, clock=clock)
        for policy in ("closed", "open", "local")
    }
    live_a, dead, live_b = tags_on_distinct_primaries(cluster, 3)
    victim = cluster.primary_for(f"{{{dead}}}")
    name = f"127.0.0.1:{victim.port}"
    try:
        for policy, guard in guards.items():
            assert kinds(guard, [gcra(dead, policy)], 1) == ["allowed"]  # connected everywhere
        victim.stop()  # kill -9
        for policy, guard in guards.items():
            assert kinds(guard, [gcra(dead, f"{policy}-2")], 4) == EXPECTED_ON_DEAD[policy]
            # Identities on the live primaries: counted by Redis, exactly, no policy applied.
            for tag in (live_a, live_b):
                assert kinds(guard, [gcra(tag, policy)], 5) == ["allowed"] * 3 + ["denied"] * 2
            health = guard.health()
            breakers = health["breakers"]
            assert isinstance(breakers, dict)
            assert breakers[name] == "open"
            assert [s for n, s in breakers.items() if n != name] == ["closed", "closed"]
            assert health["breaker"] == "open"

        # closed: a request with a check on the dead shard is refused before the live shard
        # spends anything.
        mixed = [gcra(live_a, "mixed", 10), gcra(dead, "mixed", 10)]
        assert kinds(guards["closed"], mixed, 3) == ["unavailable"] * 3
        peek = storage.evaluate([replace(mixed[0], cost=0)])
        assert peek.decisions[0].remaining == 10

        # The node comes back: its breaker closes after the reset timeout, not before.
        victim.start()
        cluster.wait_ok()
        closed = guards["closed"]
        assert kinds(closed, [gcra(dead, "back")], 1) == ["unavailable"]
        clock.advance(RESET)
        assert kinds(closed, [gcra(dead, "back")], 4) == ["allowed"] * 3 + ["denied"]
        assert set(closed.health()["breakers"].values()) == {"closed"}  # type: ignore[union-attr]
    finally:
        storage.close()


def test_through_the_app_only_the_dead_primarys_clients_get_503(
    cluster_factory: Callable[..., ClusterServers],
) -> None:
    cluster = cluster_factory(node_timeout_ms=60_000)
    app = Flask("shards")
    app.config.update(QUIET)
    app.config.update(
        DISTLIMIT_STORAGE_URL=cluster.url,
        DISTLIMIT_FAILURE_POLICY="closed",
        DISTLIMIT_BREAKER_FAIL_MAX=1,
        DISTLIMIT_REDIS_TIMEOUT=0.25,
    )
    limiter = Limiter(app)

    @app.get("/")
    @limiter.limit("3/hour", key_func=lambda: request.headers["X-Client"])
    def index() -> str:
        return "ok"

    state = limiter.state(app)
    by_port: dict[int, str] = {}  # a client per primary
    for n in range(1000):
        tag = state.identity_tag(f"func:client-{n}")
        by_port.setdefault(cluster.primary_for(f"{{{tag}}}").port, f"client-{n}")
        if len(by_port) == 3:
            break
    victim_port, *live_ports = sorted(by_port)
    client = app.test_client()

    def statuses(who: str, times: int) -> list[int]:
        return [client.get("/", headers={"X-Client": who}).status_code for _ in range(times)]

    try:
        assert statuses(by_port[victim_port], 1) == [200]
        cluster.node(victim_port).stop()  # kill -9
        assert statuses(by_port[victim_port], 3) == [503] * 3
        for port in live_ports:
            assert statuses(by_port[port], 5) == [200] * 3 + [429] * 2
        breakers = limiter.health(app)["breakers"]
        assert breakers == {
            f"127.0.0.1:{victim_port}": "open",
            **{f"127.0.0.1:{port}": "closed" for port in live_ports},
        }
    finally:
        state.storage.close()


def test_a_promoted_replica_gets_a_closed_breaker_without_waiting_out_the_dead_primarys(
    cluster_factory: Callable[..., ClusterServers],
) -> None:
    cluster = cluster_factory(node_timeout_ms=1000)
    storage = from_url(cluster.url, timeout=0.25)
    clock = FakeClock()
    guard = Guard(storage, policy="closed", fail_max=1, reset_timeout=RESET, clock=clock)
    tag = tags_on_distinct_primaries(cluster, 3)[0]
    try:
        assert kinds(guard, [gcra(tag, "before")], 1) == ["allowed"]
        victim = cluster.primary_for(f"{{{tag}}}")
        victim.stop()  # kill -9
        assert kinds(guard, [gcra(tag, "during")], 2) == ["unavailable"] * 2
        promoted = cluster.wait_for_promotion(victim)
        clock.advance(1.0)  # a thirtieth of the reset timeout: the slot map is asked again
        assert kinds(guard, [gcra(tag, "after")], 4) == ["allowed"] * 3 + ["denied"]
        breakers = guard.health()["breakers"]
        assert isinstance(breakers, dict)
        assert breakers[f"127.0.0.1:{promoted.port}"] == "closed"
        assert f"127.0.0.1:{victim.port}" not in breakers  # gone from the slot map
    finally:
        storage.close()


def test_a_slot_held_locally_is_released_by_that_fallback_after_its_slot_moved(
    cluster_factory: Callable[..., ClusterServers],
) -> None:
    """A concurrency slot taken by the dead primary's local fallback, given back after a
    replica was promoted in its place: the give-back goes to the fallback that counts the key
    (as a request's charge does), not to the new node's, which never counted it; else the slot
    stays held there and the client's next request is refused while the fallback holds."""
    cluster = cluster_factory(node_timeout_ms=1000)
    storage = from_url(cluster.url, timeout=0.25)
    clock = FakeClock()
    guard = Guard(storage, policy="local", fail_max=1, reset_timeout=RESET, clock=clock)
    tag = tags_on_distinct_primaries(cluster, 3)[0]

    def slot(token: int) -> Check:
        return Check(f"t:{{{tag}}}:c:concurrency", "concurrency", 1, 3600, 1, token=token)

    try:
        assert kinds(guard, [gcra(tag, "before")], 1) == ["allowed"]  # connected everywhere
        victim = cluster.primary_for(f"{{{tag}}}")
        victim.stop()  # kill -9
        assert kinds(guard, [slot(1)], 1) == ["degraded allowed"]  # held by its fallback
        held = SlotRelease(SimpleNamespace(guard=guard, storage_now=lambda: None))
        held.add([slot(1)])
        held.held_locally()
        cluster.wait_for_promotion(victim)
        storage.node(refresh=True)  # what the guard does while the dead node's breaker is open
        held.release()
        # the promoted replica never counted slot 1; the fallback that did has let it go
        assert kinds(guard, [slot(2)], 1) == ["allowed"]
    finally:
        storage.close()


# -- calls beside the request's: each asks the breaker of the node it goes to ------------------


class Counted(CountingStorage):
    """Counts the reads of the storage-kept identity tag key too."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.shared_reads = 0

    def shared_value(self, key: str, candidate: str, ttl: int) -> str:
        self.shared_reads += 1
        return super().shared_value(key, candidate, ttl)


def concurrency_app(
    url: str, storage: Storage | None = None, **config: object
) -> tuple[Flask, Limiter]:
    """One route holding a slot of each of two concurrency limits (by ``X-Client`` and by
    ``X-Team``) while it runs; policy open, one outage opens a breaker."""
    app = Flask("slots")
    app.config.update(QUIET)
    app.config.update(
        DISTLIMIT_STORAGE_URL=url,
        DISTLIMIT_FAILURE_POLICY="open",
        DISTLIMIT_BREAKER_FAIL_MAX=1,
        DISTLIMIT_REDIS_TIMEOUT=0.25,
        **config,
    )
    limiter = Limiter(app, storage=storage)

    @app.get("/")
    @limiter.concurrency(1, key_func=lambda: request.headers["X-Client"])
    @limiter.concurrency(1, key_func=lambda: request.headers.get("X-Team", "none"), scope="team")
    def index() -> str:
        return "ok"

    return app, limiter


def who_on(cluster: ClusterServers, limiter: Limiter, app: Flask, node: str) -> str:
    """A key_func value whose slot keys live on ``node``."""
    state = limiter.state(app)
    for n in range(2000):
        tag = state.identity_tag(f"func:who-{n}")
        if node_name(cluster, f"{{{tag}}}") == node:
            return f"who-{n}"
    raise AssertionError(f"no identity on {node}")


def test_a_slot_is_released_while_only_the_heartbeat_nodes_breaker_is_open(
    redis_cluster: ClusterServers, cluster_client: RedisCluster
) -> None:
    """The slot lives on a healthy primary, the instance heartbeat's primary has an open
    breaker: the slot is given back when the response ends (the next request takes it), not
    left to its lease because another node's breaker is open."""
    app, limiter = concurrency_app(redis_cluster.url)
    state = limiter.state(app)
    guard = state.guard
    heartbeat = node_name(redis_cluster, guard.instances.key)
    healthy = next(n for n in primaries(redis_cluster) if n != heartbeat)
    client = app.test_client()
    who = who_on(redis_cluster, limiter, app, healthy)
    headers = {"X-Client": who, "X-Team": who}
    try:
        assert client.get("/", headers=headers).status_code == 200  # connected, slots released
        guard.breakers.get(heartbeat).failure(StorageUnavailable("heartbeat node down"))
        assert guard.breaker.state == "open"  # the heartbeat key's node: what was asked before
        assert guard.breakers.get(healthy).state == "closed"
        # Each request takes both slots (limit 1 each) and gives them back when it ends.
        assert [client.get("/", headers=headers).status_code for _ in range(3)] == [200] * 3
    finally:
        state.storage.close()


def test_a_release_skips_the_dead_node_whose_breaker_is_open_and_releases_on_the_live_ones(
    cluster_factory: Callable[..., ClusterServers],
) -> None:
    """One request's slots on two primaries; the client's primary is killed and its breaker
    opens, the instance heartbeat's primary stays closed: the release sends nothing to the dead
    primary (no wait of the timeout on the request path; its lease gives that slot back), and
    gives back the slot on the live one (another client of the team takes it at once)."""
    cluster = cluster_factory(node_timeout_ms=60_000)  # no failover: the primary stays dead
    storage = Counted(from_url(cluster.url, timeout=0.25))
    app, limiter = concurrency_app(cluster.url, storage)
    state = limiter.state(app)
    guard = state.guard
    heartbeat = node_name(cluster, guard.instances.key)
    dead, live = [n for n in primaries(cluster) if n != heartbeat]
    who = who_on(cluster, limiter, app, dead)
    team = other = who_on(cluster, limiter, app, live)  # a team, and a client, on ``live``
    dead_tag = "{" + state.identity_tag(f"func:{who}") + "}"
    client = app.test_client()

    def get(who: str) -> int:
        with client.get("/", headers={"X-Client": who, "X-Team": team}) as response:
            return response.status_code

    def released_on_dead(since: int) -> list[Check]:
        return [
            c for call in storage.checks[since:] for c in call if c.release and dead_tag in c.key
        ]

    try:
        assert get(who) == 200  # connected to every primary; both slots given back
        assert released_on_dead(0)  # the release of a slot on that primary, while it lived
        cluster.node(int(dead.rpartition(":")[2])).stop()  # kill -9
        mark = len(storage.checks)
        assert get(who) == 200  # degraded (policy open): the dead primary's breaker opens
        assert guard.breakers.get(dead).state == "open"
        assert guard.breaker.state == "closed"  # the heartbeat key's node: what was asked before
        assert released_on_dead(mark) == []  # not sent: it would wait out the timeout
        assert get(other) == 200  # the team's slot (on the live primary) was given back
        mark = len(storage.checks)
        assert get(who) == 200
        assert released_on_dead(mark) == []
        assert storage.evaluations > 0
    finally:
        storage.close()


@pytest.mark.parametrize("open_on", ["the tag key's node", "another node"])
def test_the_identity_tag_key_is_read_unless_its_own_nodes_breaker_is_open(
    redis_cluster: ClusterServers, cluster_client: RedisCluster, open_on: str
) -> None:
    """With no app secret the tag key is kept in the storage: it is read unless the breaker of
    the primary serving it is open, whatever the breaker of another primary (the instance
    heartbeat's, asked before) says."""
    prefix = next(
        p
        for p in (f"tags{n}" for n in range(100))
        if node_name(redis_cluster, digest_key(p)) != node_name(redis_cluster, f"{p}:instances")
    )
    storage = Counted(from_url(redis_cluster.url, timeout=0.25))
    storage.ping()  # the client knows the slot map
    app = Flask("tags")
    app.config.update(
        DISTLIMIT_TIERS={"anonymous": ""},
        DISTLIMIT_KEY_PREFIX=prefix,
        DISTLIMIT_BREAKER_FAIL_MAX=1,  # no SECRET_KEY: the tag key is kept in the storage
    )
    limiter = Limiter(app, storage=storage)
    state = limiter.state(app)
    guard, tags = state.guard, state.tags
    assert tags.source == "storage"
    tag_node = node_name(redis_cluster, tags.storage_key)
    heartbeat = node_name(redis_cluster, guard.instances.key)
    assert heartbeat != tag_node
    node = tag_node if open_on == "the tag key's node" else heartbeat
    guard.breakers.get(node).failure(StorageUnavailable(f"{node} down"))
    assert guard.breakers.get(node).state == "open"
    try:
        assert storage.shared_reads == 0
        state.identity_tag("ip:203.0.113.9")
        if node == tag_node:  # not asked: a key of its own until the breaker closes
            assert (storage.shared_reads, tags.settled) == (0, False)
        else:  # read from its live primary
            assert (storage.shared_reads, tags.settled) == (1, True)
            assert cluster_client.get(tags.storage_key) is not None
    finally:
        storage.close()


def test_status_names_the_nodes_whose_breaker_is_not_closed(
    redis_cluster: ClusterServers, cluster_client: RedisCluster
) -> None:
    """``flask distlimit status`` on a Cluster: one primary's breaker open, not the instance
    heartbeat's. The line names that node (and exits 1), instead of "open (0 consecutive
    failures)", the heartbeat node's count, which pointed nowhere."""
    from flask_distlimit.cli import distlimit_cli

    app, limiter = concurrency_app(redis_cluster.url)
    state = limiter.state(app)
    guard = state.guard
    heartbeat = node_name(redis_cluster, guard.instances.key)
    nodes = primaries(redis_cluster)
    down = next(n for n in nodes if n != heartbeat)
    runner = app.test_cli_runner()
    try:
        for node in nodes:
            guard.breakers.get(node)
        result = runner.invoke(distlimit_cli, ["status"])
        assert result.exit_code == 0, result.output
        assert "breaker:           closed (all 3 nodes called)\n" in result.output
        guard.breakers.get(down).failure(StorageUnavailable("node down"))
        result = runner.invoke(distlimit_cli, ["status"])
        assert result.exit_code == 1, result.output
        line = f"breaker:           open ({down} open; 2 of 3 nodes called closed)\n"
        assert line in result.output
    finally:
        state.storage.close()
