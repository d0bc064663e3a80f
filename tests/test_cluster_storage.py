"""ClusterStorage on a real 3-primary Redis Cluster: checks grouped per hash slot, the groups sent
concurrently, refunds when one group denies, results in the caller's order, SCAN over every
primary, fork safety of the group thread pool, and a primary's death survived."""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import pytest
from redis.cluster import RedisCluster

from flask_distlimit.decision import Check, Decision, Evaluation
from flask_distlimit.errors import StorageUnavailable
from flask_distlimit.storage import from_url
from flask_distlimit.storage.cluster import ClusterStorage, slot_of
from tests.servers import ClusterServers
from tests.vectors import T0, VECTORS, Vector

pytestmark = [pytest.mark.redis, pytest.mark.cluster]


def tags_on_distinct_primaries(cluster: ClusterServers, count: int) -> list[str]:
    """Hash tags whose slots are served by ``count`` different primaries."""
    found: dict[int, str] = {}
    for n in range(1000):
        tag = f"client-{n}"
        port = cluster.primary_for(f"{{{tag}}}").port
        found.setdefault(port, tag)
        if len(found) == count:
            return list(found.values())
    raise AssertionError("could not spread tags over the primaries")


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


def test_groups_are_sent_concurrently(
    storage: ClusterStorage, tags: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    checks = [Check(f"t:{{{tag}}}:ip:fixed_window", "fixed_window", 5, 60) for tag in tags]
    # Every group call waits at a barrier for the other two: sequential calls would never meet.
    barrier = threading.Barrier(3, timeout=10)
    threads: set[int] = set()
    real_call = storage._call

    def meeting_call(*args: object) -> Evaluation:
        threads.add(threading.get_ident())
        barrier.wait()
        return real_call(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(storage, "_call", meeting_call)
    assert storage.evaluate(checks).allowed
    assert len(threads) == 3
    assert threading.get_ident() in threads  # the caller's thread sends one group itself


def test_a_single_group_uses_no_thread_pool(storage: ClusterStorage, tags: list[str]) -> None:
    a = tags[0]
    checks = [
        Check(f"t:{{{a}}}:ip:fixed_window", "fixed_window", 5, 60),
        Check(f"t:{{{a}}}:burst:gcra", "gcra", 5, 60),
    ]
    for _ in range(3):
        assert storage.evaluate(checks).allowed
    assert storage._executor is None


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


def test_start_up_needs_no_cluster_and_a_dead_one_is_unavailable() -> None:
    storage = from_url("redis+cluster://127.0.0.1:1", timeout=0.1)
    with pytest.raises(StorageUnavailable):
        storage.evaluate([Check("t:{a}:ip:fixed_window", "fixed_window", 5, 60)])


def test_fork_gets_its_own_connections_and_group_threads(
    storage: ClusterStorage, tags: list[str]
) -> None:
    checks = [Check(f"t:{{{tag}}}:ip:fixed_window", "fixed_window", 5, 60) for tag in tags]
    assert storage.evaluate(checks).allowed  # the parent has connections and worker threads
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
def test_a_killed_primary_is_replaced_by_its_replica(
    cluster_factory: Callable[..., ClusterServers],
) -> None:
    cluster = cluster_factory()
    storage = from_url(cluster.url, timeout=0.2)
    check = Check("t:{victim}:ip:fixed_window", "fixed_window", 100, 600)
    assert storage.evaluate([check]).allowed
    primary = cluster.primary_for(check.key)
    primary.stop()  # kill -9
    with pytest.raises(StorageUnavailable):
        storage.evaluate([check])
    promoted = cluster.wait_for_promotion(primary)
    assert promoted.port != primary.port
    # The storage finds the new primary by itself (MOVED / topology refresh); the replica
    # may or may not have received the last write, so only allowance is asserted.
    errors = 0
    for _ in range(50):
        try:
            assert storage.evaluate([check]).allowed
            break
        except StorageUnavailable:
            errors += 1
    assert errors < 50
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
