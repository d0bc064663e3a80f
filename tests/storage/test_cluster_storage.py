"""ClusterStorage on a real 3-primary Redis Cluster: checks grouped per hash slot, the groups in
flight at once, refunds when one group denies (or fails), results in the caller's order, SCAN over
every primary, fork safety, and a primary's death survived."""

from __future__ import annotations

import os
import signal
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, ClassVar

import pytest
import redis
from redis.cluster import RedisCluster

from flask_distlimit.core.decision import Check, Decision, Evaluation
from flask_distlimit.errors import StorageBusy, StorageUnavailable
from flask_distlimit.storage import from_url
from flask_distlimit.storage.cluster import ClusterStorage
from flask_distlimit.storage.heartbeat import Fleet
from flask_distlimit.storage.slot_keys import slot_of
from tests.faults import cut_under_the_request
from tests.servers import ClusterServers, tags_on_distinct_primaries
from tests.vectors import T0, VECTORS, Vector

pytestmark = [pytest.mark.redis, pytest.mark.cluster]


@pytest.fixture
def storage(
    redis_cluster: ClusterServers, cluster_client: RedisCluster
) -> Iterator[ClusterStorage]:
    built = from_url(redis_cluster.url, timeout=0.5)
    assert isinstance(built, ClusterStorage)
    yield built
    built.close()


@pytest.fixture
def tags(redis_cluster: ClusterServers) -> list[str]:
    return tags_on_distinct_primaries(redis_cluster, 3)


def evalsha_calls(cluster: ClusterServers) -> dict[int, int]:
    """EVALSHA calls so far, per primary port."""
    calls = {}
    for node in cluster.primary_nodes():
        client = node.client()
        try:
            stats = client.info("commandstats").get("cmdstat_evalsha", {"calls": 0})
        finally:
            client.close()
        calls[node.port] = int(stats["calls"])
    return calls


@pytest.mark.slow
def test_checks_are_grouped_by_slot_in_order_of_appearance(tags: list[str]) -> None:
    a, b, c = tags
    checks = [
        Check(f"t:{{{a}}}:ip:fixed_window", "fixed_window", 5, 60),
        Check(f"t:{{{b}}}:tenant:gcra", "gcra", 5, 60),
        Check(f"t:{{{a}}}:burst:token_bucket", "token_bucket", 5, 60),
        Check(f"t:{{{c}}}:global:sliding_window_log", "sliding_window_log", 5, 60),
    ]
    storage = ClusterStorage([("127.0.0.1", 1)])  # grouping needs no server
    assert storage.groups(checks) == [[0, 2], [1], [3]]
    assert slot_of(checks[0].key) == slot_of(checks[2].key) != slot_of(checks[1].key)


def test_one_script_call_per_slot_group_and_decisions_in_order(
    storage: ClusterStorage, redis_cluster: ClusterServers, tags: list[str]
) -> None:
    a, b, c = tags
    checks = [
        Check(f"t:{{{a}}}:ip:fixed_window", "fixed_window", 5, 60),
        Check(f"t:{{{b}}}:tenant:gcra", "gcra", 7, 60),
        Check(f"t:{{{a}}}:burst:token_bucket", "token_bucket", 9, 60),
        Check(f"t:{{{c}}}:global:sliding_window_log", "sliding_window_log", 11, 60),
    ]
    storage.evaluate(checks)  # loads the script on each primary
    before = evalsha_calls(redis_cluster)
    evaluation = storage.evaluate(checks)
    after = evalsha_calls(redis_cluster)
    assert evaluation.allowed
    assert [d.limit for d in evaluation.decisions] == [5, 7, 9, 11]
    assert [d.remaining for d in evaluation.decisions] == [3, 5, 7, 9]
    # Three slot groups on three primaries: exactly one EVALSHA on each.
    assert {port: after[port] - before[port] for port in after} == dict.fromkeys(after, 1)


class RecordingConnection(redis.Connection):
    """Logs every EVALSHA sent and every script reply read, with the node's port."""

    log: ClassVar[list[tuple[str, int]]] = []

    def send_packed_command(self, command: Any, *args: Any, **kwargs: Any) -> None:
        packed = b"".join(command) if isinstance(command, list) else bytes(command)
        if b"\r\nEVALSHA\r\n" in packed:
            RecordingConnection.log.append(("send", int(self.port)))
        super().send_packed_command(command, *args, **kwargs)

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        reply = super().read_response(*args, **kwargs)
        if isinstance(reply, bytes) and b"," in reply:  # the script's "now,allowed,..." reply
            RecordingConnection.log.append(("read", int(self.port)))
        return reply


def test_groups_are_in_flight_at_once(
    redis_cluster: ClusterServers, cluster_client: RedisCluster, tags: list[str]
) -> None:
    storage = ClusterStorage(
        redis_cluster.startup_nodes, timeout=0.5, connection_class=RecordingConnection
    )
    checks = [Check(f"t:{{{tag}}}:ip:fixed_window", "fixed_window", 5, 60) for tag in tags]
    storage.evaluate(checks)  # connects, loads the script
    RecordingConnection.log.clear()
    assert storage.evaluate(checks).allowed
    # Every group's EVALSHA was on the wire before the first reply was read.
    kinds = [kind for kind, _ in RecordingConnection.log]
    assert kinds == ["send"] * 3 + ["read"] * 3
    assert len({port for _, port in RecordingConnection.log}) == 3
    storage.close()


def test_a_single_group_goes_straight_through(
    storage: ClusterStorage, tags: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    a = tags[0]
    checks = [
        Check(f"t:{{{a}}}:ip:fixed_window", "fixed_window", 5, 60),
        Check(f"t:{{{a}}}:burst:gcra", "gcra", 5, 60),
    ]

    def no_fan_out(*args: object) -> None:
        raise AssertionError("a single slot group must not take the fan-out path")

    monkeypatch.setattr(storage, "_run_all", no_fan_out)
    assert [storage.evaluate(checks).allowed for _ in range(3)] == [True] * 3


def test_a_stalled_primary_costs_one_timeout_and_the_others_are_refunded(
    storage: ClusterStorage, redis_cluster: ClusterServers, tags: list[str]
) -> None:
    stalled = redis_cluster.primary_for(f"{{{tags[0]}}}")
    fast = ClusterStorage(redis_cluster.startup_nodes, timeout=0.1)
    checks = [Check(f"t:{{{tag}}}:ip:fixed_window", "fixed_window", 5, 60) for tag in tags]
    fast.evaluate(checks)  # connected everywhere, 1 unit used on each limit
    stalled.signal(signal.SIGSTOP)  # shorter than the cluster's node timeout: no failover
    try:
        started = time.monotonic()
        with pytest.raises(StorageUnavailable, match="Timeout"):
            fast.evaluate(checks)
        elapsed = time.monotonic() - started
    finally:
        stalled.signal(signal.SIGCONT)
    assert elapsed < 1.5
    # The two groups that answered consumed, then gave their unit back.
    peek = storage.evaluate([replace(c, cost=0) for c in checks[1:]])
    assert [d.remaining for d in peek.decisions] == [4, 4]
    fast.close()


def test_a_denying_group_refunds_the_groups_that_consumed(
    storage: ClusterStorage, tags: list[str]
) -> None:
    ip, tenant, _ = tags
    per_ip = Check(f"t:{{{ip}}}:ip:fixed_window", "fixed_window", 5, 60)
    per_tenant = Check(f"t:{{{tenant}}}:tenant:token_bucket", "token_bucket", 2, 60)
    log = Check(f"t:{{{ip}}}:log:sliding_window_log", "sliding_window_log", 10, 60)
    checks = [per_ip, per_tenant, log]
    assert [storage.evaluate(checks).allowed for _ in range(2)] == [True, True]
    denied = storage.evaluate(checks)
    assert not denied.allowed
    assert denied.denied_indexes() == [1]
    # The per-IP group consumed, then gave back: its state is as before the denied request.
    assert [d.remaining for d in denied.decisions] == [3, 0, 8]
    assert denied.decisions[0].allowed and denied.decisions[2].allowed
    peek = storage.evaluate([replace(c, cost=0) for c in checks])
    assert [d.remaining for d in peek.decisions] == [3, 0, 8]


@pytest.mark.slow
@pytest.mark.parametrize(
    "algorithm", ["fixed_window", "sliding_window_log", "token_bucket", "gcra"]
)
def test_refunds_keep_every_exact_algorithm_whole(
    storage: ClusterStorage, tags: list[str], algorithm: str
) -> None:
    ip, tenant, _ = tags
    per_ip = Check(f"t:{{{ip}}}:ip:{algorithm}", algorithm, 10, 60)  # type: ignore[arg-type]
    per_tenant = Check(f"t:{{{tenant}}}:tenant:fixed_window", "fixed_window", 3, 60)
    results = [storage.evaluate([per_ip, per_tenant]).allowed for _ in range(8)]
    assert results == [True] * 3 + [False] * 5
    alone = [storage.evaluate([per_ip]).allowed for _ in range(10)]
    assert alone == [True] * 7 + [False] * 3  # the 5 denials cost the per-IP limit nothing


def test_script_flush_on_every_primary_is_recovered(
    storage: ClusterStorage, redis_cluster: ClusterServers, tags: list[str]
) -> None:
    checks = [Check(f"t:{{{tag}}}:ip:fixed_window", "fixed_window", 5, 60) for tag in tags]
    assert storage.evaluate(checks).allowed
    assert storage.scripts_loaded()
    for node in redis_cluster.primary_nodes():
        client = node.client()
        client.script_flush()
        client.close()
    assert not storage.scripts_loaded()
    assert [d.remaining for d in storage.evaluate(checks).decisions] == [3, 3, 3]


def test_scan_delete_ping_heartbeat_span_every_primary(
    storage: ClusterStorage, redis_cluster: ClusterServers, tags: list[str]
) -> None:
    keys = [f"t:{{{tag}}}:ip:fixed_window" for tag in tags]
    storage.evaluate([Check(k, "fixed_window", 5, 60) for k in keys])
    assert sorted(storage.scan("t:*")) == sorted(keys)
    assert storage.delete(keys) == 3
    assert list(storage.scan("t:*")) == []
    assert 0 < storage.ping() < 1
    assert storage.heartbeat("t:{instances}", "a", 30) == 1
    assert storage.heartbeat("t:{instances}", "b", 30) == 2
    # The key the Limiter uses has no hash tag; the fleet sizes beside it share its slot.
    assert storage.heartbeat_fleet("t:instances", "a", 30, known=3) == Fleet(1, 3)
    assert storage.heartbeat_fleet("t:instances", "b", 30) == Fleet(2, 3)


def test_lease_records_are_published_and_read_in_one_slot(storage: ClusterStorage) -> None:
    # The key the Limiter uses (<prefix>:leases) has no hash tag; the records beside it share
    # its slot (a script on two keys of different slots would fail with CROSSSLOT).
    for key in ("t:leases", "t:{leases}"):
        assert storage.publish_leases(key, "a", '{"leases": {}}', 30) == ()
        assert storage.publish_leases(key, "b", '{"leases": {}}', 30) == ()
        records = storage.lease_records(key)
        assert sorted(r.process for r in records) == ["a", "b"]
        assert all(r.text == '{"leases": {}}' and 0 <= r.age < 30 for r in records)


def test_leased_units_go_back_to_their_window_on_the_node_of_their_key(
    storage: ClusterStorage, tags: list[str]
) -> None:
    now, minute = 1_700_000_040_000_000, 60_000_000  # a whole minute
    for tag in tags:  # one key on each primary
        key = f"t:{{{tag}}}:hot:fixed_window"
        evaluation = storage.evaluate([Check(key, "fixed_window", 100, 60, 11)], now_us=now)
        assert evaluation.now_us == now  # one group: its node's clock
        assert storage.give_back(key, "fixed_window", 60, now // minute, 10, now_us=now) == 10
        peek = storage.evaluate([Check(key, "fixed_window", 100, 60, 0)], now_us=now)
        assert peek.decisions[0].remaining == 99


def test_client_settings_are_timeouts_without_retries(
    redis_cluster: ClusterServers, cluster_client: RedisCluster
) -> None:
    storage = from_url(redis_cluster.url, timeout=0.25)
    assert isinstance(storage, ClusterStorage)
    client = storage.client
    # get_retries() and maint_notifications_enabled() are newer than redis-py 5.0 (the lowest
    # version .ci/run tests): checked where they exist, the timeouts everywhere
    if hasattr(client.retry, "get_retries"):
        assert client.retry.get_retries() == 0
    for node in client.get_nodes():
        pool = client.get_redis_connection(node).connection_pool
        assert isinstance(pool, redis.BlockingConnectionPool)
        assert pool.timeout == 0.25
        kwargs = pool.connection_kwargs
        assert kwargs["socket_timeout"] == kwargs["socket_connect_timeout"] == 0.25
        if hasattr(pool, "maint_notifications_enabled"):
            assert not pool.maint_notifications_enabled()  # no relaxed 10 s timeouts
        connection = pool.make_connection()
        if hasattr(connection.retry, "get_retries"):
            assert connection.retry.get_retries() == 0
        assert connection.health_check_interval == 0
    storage.close()


def test_start_up_needs_no_cluster_and_a_dead_one_is_unavailable() -> None:
    storage = from_url("redis+cluster://127.0.0.1:1", timeout=0.1)
    with pytest.raises(StorageUnavailable):
        storage.evaluate([Check("t:{a}:ip:fixed_window", "fixed_window", 5, 60)])


def test_fork_gets_its_own_connections(storage: ClusterStorage, tags: list[str]) -> None:
    checks = [Check(f"t:{{{tag}}}:ip:fixed_window", "fixed_window", 5, 60) for tag in tags]
    assert storage.evaluate(checks).allowed  # the parent has a connection to every primary
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read_end)
            storage.reset_after_fork()
            remaining = [d.remaining for d in storage.evaluate(checks).decisions]
            os.write(write_end, repr(remaining).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        report = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert report == "[3, 3, 3]"
    assert [d.remaining for d in storage.evaluate(checks).decisions] == [2, 2, 2]


@pytest.mark.slow
@pytest.mark.parametrize("groups", [1, 3], ids=["one slot group", "three slot groups"])
def test_a_killed_primary_is_replaced_by_its_replica(
    cluster_factory: Callable[..., ClusterServers], groups: int
) -> None:
    cluster = cluster_factory()
    storage = from_url(cluster.url, timeout=0.2)
    tags = tags_on_distinct_primaries(cluster, 3)[:groups]
    checks = [Check(f"t:{{{tag}}}:ip:fixed_window", "fixed_window", 100, 600) for tag in tags]
    assert storage.evaluate(checks).allowed
    victim = cluster.primary_for(checks[0].key)
    victim.stop()  # kill -9
    with pytest.raises(StorageUnavailable):
        storage.evaluate(checks)
    promoted = cluster.wait_for_promotion(victim)
    assert promoted.port != victim.port
    # The storage finds the new primary by itself (topology refresh after the connection
    # error, or MOVED); the replica may or may not have received the last write, so only
    # allowance is asserted.
    for _ in range(50):
        try:
            assert storage.evaluate(checks).allowed
            break
        except StorageUnavailable:
            time.sleep(0.1)
    else:
        raise AssertionError("the storage never reached the promoted replica")
    storage.close()


# -- the engine's shared vectors on the cluster -----------------------------------------------


class ClusterEngine:
    """The vectors' engine on a ClusterStorage; ``spread`` gives every limit its own hash tag,
    so a call spans several slot groups (concurrent calls, refunds on denial)."""

    def __init__(self, storage: ClusterStorage, spread: bool) -> None:
        self.storage = storage
        self.spread = spread

    def _keyed(self, checks: Sequence[Check]) -> list[Check]:
        if not self.spread:
            return list(checks)
        return [replace(c, key=c.key.replace("}", f"-{i}}}", 1)) for i, c in enumerate(checks)]

    def evaluate(self, checks: Sequence[Check], *, now_us: int | None = None) -> Evaluation:
        return self.storage.evaluate(self._keyed(checks), now_us=now_us)

    def refund(self, checks: Sequence[Check], *, now_us: int | None = None) -> Evaluation:
        keyed = self._keyed(checks)
        groups = self.storage.groups(keyed)
        parts = [[keyed[i] for i in group] for group in groups]
        results = self.storage._run_all(parts, now_us, refund=True)
        decisions: dict[int, Decision] = {}
        for group, result in zip(groups, results, strict=True):
            assert isinstance(result, Evaluation)
            decisions.update(zip(group, result.decisions, strict=True))
        return Evaluation(tuple(decisions[i] for i in range(len(keyed))))


@pytest.mark.slow
@pytest.mark.parametrize("spread", [False, True], ids=["one slot", "one slot per limit"])
@pytest.mark.parametrize("vector", VECTORS, ids=[v.name for v in VECTORS])
def test_shared_vectors_on_the_cluster(
    storage: ClusterStorage, vector: Vector, spread: bool
) -> None:
    engine = ClusterEngine(storage, spread)
    prefix = f"vec:{{{zlib.crc32(vector.name.encode())}}}"
    for n, call in enumerate(vector.calls):
        checks = vector.checks(call.costs, prefix)
        run = engine.refund if call.refund else engine.evaluate
        got = run(checks, now_us=T0 + call.at)
        want = tuple(
            e.decision(lim.limit) for e, lim in zip(call.expect, vector.limits, strict=True)
        )
        assert got.decisions == want, f"call {n} at +{call.at} us, costs {call.costs}"
        assert got.allowed == all(e.allowed for e in call.expect)


# -- nodes for the per-primary breakers, and the one safe retry --------------------------------


def test_route_names_the_primary_of_each_slot_group(
    storage: ClusterStorage, redis_cluster: ClusterServers, tags: list[str]
) -> None:
    a, b, c = tags
    checks = [
        Check(f"t:{{{a}}}:ip:fixed_window", "fixed_window", 5, 60),
        Check(f"t:{{{b}}}:tenant:gcra", "gcra", 5, 60),
        Check(f"t:{{{a}}}:burst:token_bucket", "token_bucket", 5, 60),
        Check(f"t:{{{c}}}:global:gcra", "gcra", 5, 60),
    ]
    first = redis_cluster.startup_nodes[0]
    # Before the client knows the topology: every group on the first startup node (no I/O).
    assert storage.nodes() is None
    assert storage.route(checks) == [(f"{first[0]}:{first[1]}", g) for g in storage.groups(checks)]
    storage.evaluate(checks)  # connects
    names = [f"127.0.0.1:{redis_cluster.primary_for(k).port}" for k in (a, b, c)]
    assert storage.route(checks) == [(names[0], [0, 2]), (names[1], [1]), (names[2], [3])]
    assert storage.nodes() == frozenset(
        f"127.0.0.1:{n.port}" for n in redis_cluster.primary_nodes()
    )


class FailingSendConnection(redis.Connection):
    """A send on a connection made before ``made_before`` fails, as on a socket the server
    closed unseen; with ``always`` every EVALSHA send fails. ``attempts`` counts EVALSHA sends."""

    made: ClassVar[int] = 0
    made_before: ClassVar[int] = 0
    always: ClassVar[bool] = False
    attempts: ClassVar[int] = 0
    serial = 0

    def on_connect(self) -> None:
        super().on_connect()
        FailingSendConnection.made += 1
        self.serial = FailingSendConnection.made

    def send_packed_command(self, command: Any, *args: Any, **kwargs: Any) -> None:
        packed = b"".join(command) if isinstance(command, list) else bytes(command)
        if b"\r\nEVALSHA\r\n" in packed:
            FailingSendConnection.attempts += 1
            if self.always or self.serial < self.made_before:
                self.disconnect()
                raise redis.ConnectionError("Error 32 while writing to socket. Broken pipe.")
        super().send_packed_command(command, *args, **kwargs)


def test_a_failed_send_is_made_once_more_on_a_fresh_connection(
    redis_cluster: ClusterServers, cluster_client: RedisCluster, tags: list[str]
) -> None:
    storage = ClusterStorage(
        redis_cluster.startup_nodes, timeout=0.5, connection_class=FailingSendConnection
    )
    checks = [Check(f"t:{{{tag}}}:ip:fixed_window", "fixed_window", 5, 60) for tag in tags]
    try:
        storage.evaluate(checks)  # connects, loads the script
        FailingSendConnection.made_before = FailingSendConnection.made + 1  # every pooled one
        FailingSendConnection.attempts = 0
        assert [d.remaining for d in storage.evaluate(checks).decisions] == [3] * 3
        assert FailingSendConnection.attempts == 6  # each group: a failed send, then one more
        FailingSendConnection.always = True  # the second send fails too: no third
        FailingSendConnection.attempts = 0
        with pytest.raises(StorageUnavailable):
            storage.evaluate(checks)
        assert FailingSendConnection.attempts == 6
        FailingSendConnection.always = False
        peek = storage.evaluate([replace(c, cost=0) for c in checks])
        assert [d.remaining for d in peek.decisions] == [3] * 3  # nothing counted twice
    finally:
        FailingSendConnection.always = False
        FailingSendConnection.made_before = 0
        storage.close()


def test_a_group_cut_under_the_request_is_made_again_and_counted_once(
    redis_cluster: ClusterServers, cluster_client: RedisCluster, tags: list[str]
) -> None:
    """Issue 11, item 4, on a Cluster: one group's connection is closed while its primary holds
    the script (CLIENT PAUSE WRITE, then CLIENT KILL): the group is made again within the
    deadline, every group answers, and each limit counts the request once."""
    storage = ClusterStorage(redis_cluster.startup_nodes, timeout=3.0)
    checks = [Check(f"t:{{{tag}}}:ip:fixed_window", "fixed_window", 5, 60) for tag in tags]
    try:
        storage.evaluate(checks)  # connected everywhere, 1 unit used on each limit
        admin = redis_cluster.primary_for(f"{{{tags[0]}}}").client()
        admin.config_resetstat()
        thread = cut_under_the_request(admin)
        try:
            evaluation = storage.evaluate(checks)
        finally:
            thread.join()
        repeats = admin.info("commandstats").get("cmdstat_get", {}).get("calls", 0)
        admin.close()
        assert repeats == 1  # the repeat asked for the first try's kept reply: none, so it ran
        assert evaluation.allowed
        assert [d.remaining for d in evaluation.decisions] == [3, 3, 3]
        peek = storage.evaluate([replace(c, cost=0) for c in checks])
        assert [d.remaining for d in peek.decisions] == [3, 3, 3]
    finally:
        storage.close()


def test_connections_a_primary_closed_while_idle_are_replaced_and_counted_once(
    redis_cluster: ClusterServers, cluster_client: RedisCluster, tags: list[str]
) -> None:
    """The hot call does not probe a pooled connection at checkout: one the primary closed
    while idle loses the reply (or fails the send), and the group is made again on a new
    connection, marked as a repeat, within the deadline; counted once."""
    storage = ClusterStorage(redis_cluster.startup_nodes, timeout=3.0)
    checks = [Check(f"t:{{{tag}}}:ip:fixed_window", "fixed_window", 5, 60) for tag in tags]
    try:
        storage.evaluate(checks)  # connected everywhere, 1 unit used on each limit
        admin = redis_cluster.primary_for(f"{{{tags[0]}}}").client()
        mine = admin.client_id()
        for client in admin.client_list(_type="normal"):
            if int(client["id"]) != mine:
                admin.client_kill_filter(_id=int(client["id"]))
        admin.config_resetstat()
        evaluation = storage.evaluate(checks)
        repeats = admin.info("commandstats").get("cmdstat_get", {}).get("calls", 0)
        admin.close()
        assert repeats == 1  # the repeat asked for the kept reply: none (never sent), so it ran
        assert [d.remaining for d in evaluation.decisions] == [3, 3, 3]
        peek = storage.evaluate([replace(c, cost=0) for c in checks])
        assert [d.remaining for d in peek.decisions] == [3, 3, 3]
    finally:
        storage.close()


def test_a_calm_cluster_s_calls_carry_no_token_but_its_refunds_do(
    redis_cluster: ClusterServers, cluster_client: RedisCluster, tags: list[str]
) -> None:
    """request_tokens="auto": while no connection failed, no group's call keeps its reply; a
    refund (given back twice, it would give back twice) always does; a group cut under the
    request arms the tokens for every call after it."""
    storage = ClusterStorage(redis_cluster.startup_nodes, timeout=5.0)  # replies kept 10 s
    checks = [Check(f"t:{{{tag}}}:ip:fixed_window", "fixed_window", 5, 60) for tag in tags]
    admins = [redis_cluster.primary_for(f"{{{tag}}}").client() for tag in tags]

    def kept() -> int:
        pairs = zip(admins, tags, strict=True)
        return sum(len(admin.keys(f"t:rq:{{{tag}}}:*")) for admin, tag in pairs)

    try:
        storage.evaluate(checks)
        storage.evaluate(checks)
        assert kept() == 0
        storage.refund(checks)
        assert kept() == 3  # one per group
        assert [d.remaining for d in storage.evaluate(checks).decisions] == [3] * 3
        assert storage.tokens.armed_until < time.monotonic()
        thread = cut_under_the_request(admins[0])
        try:
            storage.evaluate(checks)
        finally:
            thread.join()
        assert storage.tokens.armed_until > time.monotonic()
        storage.evaluate(checks)
        assert kept() == 3 + 1 + 3  # the cut group's repeat, then every group's call
    finally:
        for admin in admins:
            admin.close()
        storage.close()


def test_a_primary_s_pool_with_every_connection_busy_neither_arms_nor_refreshes(
    redis_cluster: ClusterServers, cluster_client: RedisCluster, tags: list[str]
) -> None:
    """A group that waited for a connection of its primary's pool past its queue budget met
    load, not a lost node: the tokens stay calm and the topology is not asked again."""
    storage = ClusterStorage(
        redis_cluster.startup_nodes, timeout=0.05, max_connections=1, queue_timeout=0.05
    )
    checks = [Check(f"t:{{{tag}}}:ip:fixed_window", "fixed_window", 5, 60) for tag in tags]
    try:
        storage.evaluate(checks)  # every primary's pool holds its one connection
        client = storage.client
        node = client.get_node_from_key(checks[0].key)
        pool = storage._pipeline_of(client, node).pool
        held = pool.checkout(time.monotonic() + 5.0)
        refreshed: list[int] = []
        initialize = client.nodes_manager.initialize

        def counted() -> None:
            refreshed.append(1)
            initialize()

        client.nodes_manager.initialize = counted  # type: ignore[method-assign]
        try:
            results = storage.evaluate_parts([[checks[0]]])
        finally:
            pool.release(held)
            client.nodes_manager.initialize = initialize  # type: ignore[method-assign]
        assert isinstance(results[0], StorageBusy)  # this process's load: not the node's
        assert "queue budget (0.05 s)" in str(results[0])  # the budget it waited, not "0 s"
        assert storage.tokens.armed_until < time.monotonic()
        assert refreshed == []
    finally:
        storage.close()


def test_a_primary_that_timed_out_does_not_arm_the_tokens(
    redis_cluster: ClusterServers, cluster_client: RedisCluster, tags: list[str]
) -> None:
    """A timeout is a slow node (load), not a closed connection: no reply was repeated, and
    arming would add the token's SET to every call for a minute while Redis is slowest. The
    single node arms on connection errors only; the Cluster now does the same."""
    stalled = redis_cluster.primary_for(f"{{{tags[0]}}}")
    fast = ClusterStorage(redis_cluster.startup_nodes, timeout=0.1)
    checks = [Check(f"t:{{{tag}}}:ip:fixed_window", "fixed_window", 5, 60) for tag in tags]
    try:
        fast.evaluate(checks)  # connected everywhere
        stalled.signal(signal.SIGSTOP)  # shorter than the cluster's node timeout: no failover
        try:
            results = fast.evaluate_parts([[c] for c in checks])
        finally:
            stalled.signal(signal.SIGCONT)
        assert isinstance(results[0], StorageUnavailable) and "Timeout" in str(results[0])
        assert fast.tokens.armed_until < time.monotonic()
    finally:
        fast.close()


class LoseRefundReply(redis.Connection):
    """A connection to ``port`` that, while ``armed``, reads a refund's reply (the script ran)
    and then drops it, as a primary dying after it ran would; from then on, connecting to
    ``port`` is refused until the test lets it go (``refusing``)."""

    port_lost: ClassVar[int] = 0
    armed: ClassVar[bool] = False
    refusing: ClassVar[bool] = False
    losing = False

    def connect(self, *args: Any, **kwargs: Any) -> None:
        if LoseRefundReply.refusing and self.port == LoseRefundReply.port_lost:
            raise redis.ConnectionError("refused (the test's dead primary)")
        super().connect(*args, **kwargs)

    def send_packed_command(self, command: Any, *args: Any, **kwargs: Any) -> None:
        packed = b"".join(command) if isinstance(command, list) else bytes(command)
        # the refund mode's head: the server's time (-1), then mode 1
        self.losing = (
            LoseRefundReply.armed
            and self.port == LoseRefundReply.port_lost
            and b"\r\nEVALSHA\r\n" in packed
            and b"\r\n-1,1," in packed
        )
        super().send_packed_command(command, *args, **kwargs)

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        reply = super().read_response(*args, **kwargs)
        if self.losing:
            self.losing = LoseRefundReply.armed = False
            LoseRefundReply.refusing = True
            self.disconnect()
            raise redis.ConnectionError("Connection closed by server (the test's lost reply)")
        return reply


def test_a_refund_made_again_on_a_promoted_replica_is_given_back_once(
    redis_cluster: ClusterServers, cluster_client: RedisCluster, tags: list[str]
) -> None:
    """A refund ran on its primary, the reply was lost and the primary stayed unreachable; the
    topology then names another primary (a promoted replica, which got the refund's writes):
    the refund is made there as a repeat of its request token, and answers the first try's
    kept reply. Made as a new call, it gave back twice: one unit more than was taken."""
    storage = ClusterStorage(
        redis_cluster.startup_nodes, timeout=2.0, connection_class=LoseRefundReply
    )
    check = Check(f"t:{{{tags[0]}}}:ip:fixed_window", "fixed_window", 5, 365 * 86400)
    admin = redis_cluster.primary_for(f"{{{tags[0]}}}").client()
    try:
        for _ in range(3):
            storage.evaluate([check])
        assert admin.hget(check.key, "n") == b"3"
        LoseRefundReply.port_lost = admin.connection_pool.connection_kwargs["port"]
        asked = {"n": 0}
        real = storage._primary_of

        def primary_of(key: str) -> str | None:
            # the lost path asks before and after refreshing the topology: "promoted" then
            asked["n"] += 1
            if asked["n"] == 1:
                return real(key)
            LoseRefundReply.refusing = False  # the "replica" (the same server) is reachable
            return "127.0.0.1:1"

        storage._primary_of = primary_of  # type: ignore[method-assign]
        LoseRefundReply.armed = True
        refunded = storage.refund([check])
        assert asked["n"] >= 2  # the lost path ran
        assert admin.hget(check.key, "n") == b"2"  # one unit given back, not two
        assert refunded.decisions[0].remaining == 3
    finally:
        LoseRefundReply.armed = LoseRefundReply.refusing = False
        admin.close()
        storage.close()


@pytest.mark.parametrize("algorithm", ["fixed_window", "sliding_window_counter", "gcra"])
def test_a_reservation_is_given_back_on_the_node_of_each_key(
    storage: ClusterStorage, tags: list[str], algorithm: str
) -> None:
    """Issue 35: a settlement's release checks on keys of two primaries, in one call, give
    back what was reserved there (each always under a request token: made once)."""
    ip, tenant, _ = tags
    keys = [f"t:{{{ip}}}:settle:{algorithm}", f"t:{{{tenant}}}:settle:{algorithm}"]
    reserve = [Check(k, algorithm, 10, 60, 4) for k in keys]  # type: ignore[arg-type]
    assert [d.remaining for d in storage.evaluate(reserve).decisions] == [6, 6]
    back = [replace(c, cost=3, release=True) for c in reserve]
    assert [d.remaining for d in storage.evaluate(back).decisions] == [9, 9]
