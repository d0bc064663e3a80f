"""One circuit breaker per storage node, on in-process storages with a fake routing and a fake
clock: a dead shard degrades only the keys it serves, all-or-nothing across shards, breakers
dropped with their nodes, a moved master (Sentinel) followed without waiting out the old one's
reset timeout, health and metrics per node. (The same on a real Redis Cluster:
tests/resilience/test_cluster_breakers.py; a real Sentinel failover:
tests/resilience/test_sentinel_breaker.py.)"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from flask_distlimit.core.decision import Check, Evaluation
from flask_distlimit.errors import (
    StorageBusy,
    StorageError,
    StorageResponseError,
    StorageUnavailable,
)
from flask_distlimit.resilience.breakers import DEFAULT_NODE, Breakers
from flask_distlimit.resilience.guard import Guard
from flask_distlimit.resilience.guard_core import REDISCOVER_INTERVAL
from flask_distlimit.storage.memory import MemoryStorage
from flask_distlimit.telemetry.metrics import Metrics
from tests.faults import kind_of
from tests.guard_helpers import FakeClock

NOW = 1_700_000_000_000_000  # microseconds: one fixed window for every call of a test
RESET = 30.0


def node_of(key: str) -> str:
    """The fake routing: tags starting with ``a`` (or none) on node a, the others on node b."""
    tag = key.partition("{")[2].partition("}")[0]  # "" without a tag: node a
    return "10.0.0.1:7001" if tag.startswith("a") or not tag else "10.0.0.2:7002"


A, B = "10.0.0.1:7001", "10.0.0.2:7002"


class Shards(MemoryStorage):
    """A memory store posing as a two-primary cluster; the nodes in ``down`` fail."""

    routed = True

    def __init__(self) -> None:
        super().__init__(clock=lambda: NOW)
        self.down: set[str] = set()
        self.topology: set[str] = {A, B}
        self.sent: list[str] = []  # the node of every part sent
        self.moved: dict[str, str] = {}  # a node whose slots another serves now
        self.garbled: set[str] = set()  # nodes that answer an error reply

    def evaluate(self, checks: Sequence[Check], *, now_us: int | None = None) -> Evaluation:
        if any(self.serving(c.key) in self.down for c in checks):
            raise StorageUnavailable("fake node down")
        if any(self.serving(c.key) in self.garbled for c in checks):
            raise StorageResponseError("fake error reply")
        return super().evaluate(checks, now_us=now_us)

    def serving(self, key: str) -> str:
        """The node serving ``key``: node_of's, unless its slots moved (a promoted replica)."""
        served = node_of(key)
        return self.moved.get(served, served)

    def nodes(self) -> Collection[str] | None:
        return set(self.topology)

    def route(self, checks: Sequence[Check]) -> list[tuple[str, list[int]]]:
        by_node: dict[str, list[int]] = {}
        for i, c in enumerate(checks):
            by_node.setdefault(self.serving(c.key), []).append(i)
        return list(by_node.items())

    def evaluate_parts(
        self, parts: Sequence[Sequence[Check]], *, now_us: int | None = None
    ) -> list[Evaluation | StorageError]:
        self.sent.extend(self.serving(p[0].key) for p in parts)
        return super().evaluate_parts(parts, now_us=now_us)

    def remaining(self, check: Check) -> int:
        return super().evaluate([replace(check, cost=0)], now_us=NOW).decisions[0].remaining


def limit(tag: str, n: int = 3, name: str = "ip") -> Check:
    return Check(f"t:{{{tag}}}:{name}:fixed_window", "fixed_window", n, 60)


def make(policy: str = "closed", **kwargs: object) -> tuple[Guard, Shards, FakeClock]:
    storage = Shards()
    clock = FakeClock()
    kwargs.setdefault("fail_max", 1)
    guard = Guard(
        storage,
        policy=policy,  # type: ignore[arg-type]
        reset_timeout=RESET,
        clock=clock,
        **kwargs,  # type: ignore[arg-type]
    )
    return guard, storage, clock


def kinds(guard: Guard, checks: list[Check], times: int) -> list[str]:
    return [kind_of(guard.evaluate(checks, now_us=NOW)) for _ in range(times)]


@pytest.mark.parametrize(
    ("policy", "on_dead_node"),
    [
        ("closed", ["unavailable"] * 5),
        ("open", ["degraded allowed"] * 5),
        ("local", ["degraded allowed"] * 3 + ["degraded denied"] * 2),  # limit 3, one instance
    ],
)
def test_a_dead_node_degrades_only_the_keys_it_serves(policy: str, on_dead_node: list[str]) -> None:
    guard, storage, _ = make(policy)
    storage.down.add(B)
    assert kinds(guard, [limit("bob")], 5) == on_dead_node
    # Identities on the live node: exact, no policy applied, although node b's breaker is open.
    assert kinds(guard, [limit("alice")], 5) == ["allowed"] * 3 + ["denied"] * 2
    assert kinds(guard, [limit("anna", 2)], 3) == ["allowed"] * 2 + ["denied"]
    health = guard.health()
    assert health["breakers"] == {A: "closed", B: "open"}
    assert health["breaker"] == "open"  # the aggregate: the worst node
    assert health["ok"] is False


def test_closed_answers_503_before_spending_on_the_live_nodes() -> None:
    guard, storage, _ = make("closed")
    storage.down.add(B)
    guard.evaluate([limit("bob")], now_us=NOW)  # opens node b's breaker
    storage.sent.clear()
    mixed = [limit("alice"), limit("bob")]
    assert kinds(guard, mixed, 4) == ["unavailable"] * 4
    assert storage.sent == []  # node a was never asked: nothing spent there
    assert storage.remaining(limit("alice")) == 3
    assert kinds(guard, [limit("alice")], 1) == ["allowed"]  # node a alone: decided by it


def test_a_node_failing_during_the_call_gets_its_units_back_on_the_others() -> None:
    guard, storage, _ = make("closed", fail_max=5)  # node b's breaker stays closed: it is tried
    storage.down.add(B)
    mixed = [limit("alice"), limit("bob")]
    assert kinds(guard, mixed, 2) == ["unavailable"] * 2
    assert storage.sent == [A, B, A, B]
    assert storage.remaining(limit("alice")) == 3  # consumed, then given back, twice


def test_local_decides_the_dead_nodes_checks_and_a_local_denial_spends_nothing() -> None:
    guard, storage, _ = make("local")
    storage.down.add(B)
    mixed = [limit("alice", 10), limit("bob", 2)]
    outcomes = [guard.evaluate(mixed, now_us=NOW) for _ in range(4)]
    assert [kind_of(o) for o in outcomes] == ["degraded allowed"] * 2 + ["degraded denied"] * 2
    # Node a counted the two admitted requests only: the two the fallback refused gave back.
    assert storage.remaining(limit("alice", 10)) == 8
    denied = outcomes[-1].evaluation
    assert denied is not None and denied.denied_indexes() == [1]
    assert denied.decisions[0].remaining == 8  # node a's real state, for the headers


def test_a_live_node_that_denies_refuses_the_request_under_open() -> None:
    guard, storage, _ = make("open")
    storage.down.add(B)
    mixed = [limit("alice", 2), limit("bob", 100)]
    outcomes = [guard.evaluate(mixed, now_us=NOW) for _ in range(3)]
    assert [kind_of(o) for o in outcomes] == ["degraded allowed"] * 2 + ["degraded denied"]
    last = outcomes[-1].evaluation
    assert last is not None and last.denied_indexes() == [0]


def test_the_dead_nodes_breaker_closes_after_the_reset_timeout() -> None:
    guard, storage, clock = make("closed")
    storage.down.add(B)
    assert kinds(guard, [limit("bob")], 2) == ["unavailable"] * 2
    storage.down.clear()  # the node is back
    clock.advance(RESET - 0.001)
    assert kinds(guard, [limit("bob")], 1) == ["unavailable"]  # still open
    clock.advance(0.001)
    assert kinds(guard, [limit("bob")], 4) == ["allowed"] * 3 + ["denied"]  # trial, then closed
    assert guard.health()["breakers"] == {A: "closed", B: "closed"}
    assert guard.health()["breaker"] == "closed"


def test_breakers_of_nodes_gone_from_the_topology_are_dropped() -> None:
    guard, storage, _ = make("open")
    kinds(guard, [limit("alice"), limit("bob")], 1)
    assert set(guard.breakers.states()) >= {A, B}
    storage.topology = {A, "10.0.0.3:7003"}  # b left, c joined
    guard.health()
    assert set(guard.breakers.states()) == {A}
    guard.breakers.get("10.0.0.3:7003")
    assert set(guard.breakers.states()) == {A, "10.0.0.3:7003"}


def test_the_set_of_breakers_is_bounded() -> None:
    breakers = Breakers(name="t", fail_max=1, reset_timeout=1.0, limit=3)
    for n in range(10):
        breakers.get(f"10.0.0.{n}:1")
    breakers.get("10.0.0.2:1").failure(StorageUnavailable("x"))
    assert len(breakers.states()) == 3
    breakers.get("10.0.0.99:1")
    assert len(breakers.states()) == 3
    assert breakers.states()["10.0.0.2:1"] == "open"  # the closed ones go first


def test_metrics_and_logs_name_each_node(caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    guard, storage, _ = make("open", metrics=Metrics(registry))
    storage.down.add(B)
    with caplog.at_level("WARNING", logger="flask_distlimit.breaker"):
        kinds(guard, [limit("alice"), limit("bob")], 1)
    assert f"memory:ratelimit@{B}" in caplog.text
    gauge = "distlimit_breaker_state"
    assert registry.get_sample_value(gauge, {"breaker": f"memory:ratelimit@{B}"}) == 2
    assert registry.get_sample_value(gauge, {"breaker": f"memory:ratelimit@{A}"}) == 0
    storage.topology = {A}
    guard.health()  # b is gone: its series too
    assert registry.get_sample_value(gauge, {"breaker": f"memory:ratelimit@{B}"}) is None


def test_one_node_keeps_one_breaker_named_as_before() -> None:
    storage = MemoryStorage(clock=lambda: NOW)
    guard = Guard(storage, fail_max=1)
    assert guard.evaluate([limit("alice")], now_us=NOW).evaluation is not None
    health = guard.health()
    assert health["breakers"] == {DEFAULT_NODE: "closed"}
    assert health["breaker"] == "closed"
    assert guard.breaker.name == "memory:ratelimit"
    assert guard.breakers.all() == [guard.breaker]


class Moving(MemoryStorage):
    """One node at a time that a failover moves (as a Sentinel-discovered master)."""

    def __init__(self) -> None:
        super().__init__(clock=lambda: NOW)
        self.master = "10.0.0.1:6379"  # what the Sentinels say
        self.known = self.master  # what the storage last discovered
        self.dead: set[str] = set()
        self.asked = 0

    def node(self, refresh: bool = False) -> str:
        if refresh:
            self.asked += 1
            self.known = self.master
        return self.known

    def evaluate(self, checks: Sequence[Check], *, now_us: int | None = None) -> Evaluation:
        if self.known in self.dead:
            raise StorageUnavailable("master down")
        return super().evaluate(checks, now_us=now_us)


def test_a_moved_master_is_used_without_waiting_out_the_old_breaker() -> None:
    storage = Moving()
    clock = FakeClock()
    guard = Guard(storage, policy="closed", fail_max=2, reset_timeout=RESET, clock=clock)
    assert kinds(guard, [limit("alice")], 1) == ["allowed"]
    storage.dead.add("10.0.0.1:6379")
    assert kinds(guard, [limit("alice")], 3) == ["unavailable"] * 3
    assert guard.health()["breakers"] == {"10.0.0.1:6379": "open"}
    asked = storage.asked
    storage.master = "10.0.0.2:6379"  # the Sentinels fail over
    assert kinds(guard, [limit("alice")], 3) == ["unavailable"] * 3  # asked at most once a second
    assert storage.asked <= asked + 1
    clock.advance(REDISCOVER_INTERVAL)  # far less than the reset timeout
    assert kinds(guard, [limit("alice")], 2) == ["allowed"] * 2
    assert guard.health()["breakers"] == {"10.0.0.2:6379": "closed"}
    assert guard.breaker.name == "memory:ratelimit@10.0.0.2:6379"


def test_a_counting_wrapper_keeps_the_breaker_per_node() -> None:
    """``testing.CountingStorage`` around a routed storage: still one breaker per node, and each
    routed evaluation is counted once."""
    from flask_distlimit.testing import CountingStorage

    storage = Shards()
    counting = CountingStorage(storage)
    guard = Guard(counting, policy="closed", reset_timeout=RESET, clock=FakeClock(), fail_max=1)
    storage.down.add(B)
    assert kinds(guard, [limit("bob")], 2) == ["unavailable"] * 2
    assert kinds(guard, [limit("alice")], 4) == ["allowed"] * 3 + ["denied"]
    assert counting.evaluations == 5  # bob once (then his node's breaker is open), alice 4 times
    assert guard.health()["breakers"] == {A: "closed", B: "open"}


def test_a_refund_across_nodes_gives_nothing_back_to_a_shadow_limit_that_was_not_charged() -> None:
    """A shadow check that would deny is not charged; when another node then refuses the
    request, the give-back must not take a unit off the shadow limit's count."""
    guard, storage, _ = make("closed", fail_max=5)
    shadow = replace(limit("ann", 1, "shadow"), shadow=True)
    assert kinds(guard, [shadow], 1) == ["allowed"]  # its one unit: spent
    assert kinds(guard, [limit("bob", 1)], 1) == ["allowed"]  # bob's one unit: spent
    # ann's node admits (her shadow limit only would deny), bob's node denies: a refund.
    evaluation = guard.evaluate([shadow, limit("ann"), limit("bob", 1)], now_us=NOW).evaluation
    assert evaluation is not None and not evaluation.allowed
    assert storage.remaining(limit("ann")) == 3  # given back
    assert storage.remaining(replace(shadow, shadow=False)) == 0  # still spent, as counted


def test_local_counts_locally_only_the_keys_of_the_failed_node() -> None:
    """Found by the fault harness (cluster-primary, local): one process-wide fallback, engaged by
    the dead shard's failures, counted the healthy shards' keys too and refused them at this
    process's share while Redis answered them. Each node's fallback engages on its own."""
    guard, storage, clock = make("local", instances=3)
    storage.down.add(B)
    # bob's node is down: decided locally at this process's share, 9 // 3 = 3
    assert kinds(guard, [limit("bob", 9)], 4) == ["degraded allowed"] * 3 + ["degraded denied"]
    assert guard.fallbacks.of(B).engaged and not guard.fallbacks.of(A).holding
    # alice's node answers: Redis decides her whole limit, no share, nothing degraded
    assert kinds(guard, [limit("alice", 9)], 10) == ["allowed"] * 9 + ["denied"]
    assert not guard.fallbacks.of(A).holding
    health = guard.health()
    assert health["fallback_active"] is True and health["fallback_held_keys"] == 1
    # node b back: its fallback still counts bob (held to its window), alice is untouched
    storage.down.clear()
    clock.advance(RESET)
    assert kind_of(guard.evaluate([limit("bob", 9)], now_us=NOW)) == "degraded denied"


def test_local_decisions_across_failed_nodes_are_all_or_nothing() -> None:
    guard, storage, _ = make("local")
    storage.down.update({A, B})
    both = [limit("alice", 5), limit("bob", 1)]
    assert kind_of(guard.evaluate(both, now_us=NOW)) == "degraded allowed"
    # bob's fallback refuses: alice's gives back what it admitted for this request
    assert kinds(guard, both, 3) == ["degraded denied"] * 3
    assert kinds(guard, [limit("alice", 5)], 5) == ["degraded allowed"] * 4 + ["degraded denied"]


def test_a_key_decided_locally_stays_held_when_a_promoted_replica_serves_it() -> None:
    """Found by the fault harness (cluster-primary, local: 37 against 33 in one window): the
    local decisions of a dead primary's keys are unknown to the replica promoted in its place,
    which starts the window from zero. Its answers must still count against the fallback that
    decided the key, not against the fresh fallback of the new node."""
    guard, storage, clock = make("local", instances=3)
    storage.down.add(B)
    assert kinds(guard, [limit("bob", 9)], 4) == ["degraded allowed"] * 3 + ["degraded denied"]
    C = "10.0.0.3:7003"
    storage.moved[B] = C  # the replica promoted: bob's slot is served by C, which answers
    storage.topology = {A, C}
    clock.advance(1.0)  # the same window (NOW is fixed), within the engagement
    # Redis (C) admits bob afresh, but this process spent its share of the window: refused
    assert kinds(guard, [limit("bob", 9)], 2) == ["degraded denied"] * 2
    # alice on A, untouched throughout
    assert kinds(guard, [limit("alice", 9)], 9) == ["allowed"] * 9


def test_a_lease_is_renewed_only_while_its_own_nodes_breaker_is_closed() -> None:
    """A lease's top-up asks the breaker of the node serving the lease's key, not the process's
    first one (the heartbeat's): with node b's open, a lease on b takes no top-up to the failure
    policy, while one on a still renews."""
    guard, storage, _ = make("local")
    storage.down.add(B)
    on_b, on_a = limit("b"), limit("a")
    assert kinds(guard, [on_b], 1) == ["degraded allowed"]  # fail_max 1: b's breaker opens
    assert guard.breaker_of(on_b.key).state == "open"
    assert guard.breaker.state == "closed"  # the heartbeat key's node, a: what was asked before
    assert not guard.renewable(on_b.key)
    assert guard.renewable(on_a.key)


def test_a_lease_is_not_renewed_while_a_dead_primary_s_fallback_counts_its_key() -> None:
    """After a failover the key's node is the promoted replica, whose fallback holds nothing;
    the dead primary's still counts the key (it decided it locally) and keeps deciding it. A
    renewal alone (sent as ``open``) would go uncounted by it: 50 admitted against 40 (the fix
    review). Not renewed until that fallback's counts no longer matter."""
    guard, storage, clock = make("local")
    storage.down.add(B)
    bob = limit("bob", 9)
    assert kinds(guard, [bob], 1) == ["degraded allowed"]  # decided by B's fallback
    storage.moved[B] = C = "10.0.0.3:7003"  # the replica promoted
    storage.topology = {A, C}
    clock.advance(RESET + 1)  # B's breaker would let a call through: C's is closed
    assert guard.breaker_of(bob.key).state == "closed"
    assert not guard.renewable(bob.key)
    clock.advance(3600)
    assert guard.renewable(bob.key)


def beside(guard: Guard, storage: Shards, checks: list[Check]) -> list[str]:
    """The nodes :meth:`Guard.evaluate_beside` (a concurrency slot's release) sends parts to."""
    storage.sent.clear()
    guard.evaluate_beside(checks, "the test's call", now_us=NOW)
    return list(storage.sent)


def test_a_call_beside_the_request_goes_to_each_groups_node_unless_its_breaker_is_open() -> None:
    """:meth:`Guard.evaluate_beside` (a concurrency slot's release): to the nodes of the groups
    whose breaker lets calls through, whatever the breaker of the heartbeat key's node (a)
    says."""
    guard, storage, clock = make("open")
    on_a, on_b, on_a2 = limit("a"), limit("b"), limit("a2", name="team")
    assert beside(guard, storage, [on_a, on_b, on_a2]) == [A, B]  # one part per node
    storage.down.add(B)
    assert kinds(guard, [on_b], 1) == ["degraded allowed"]  # fail_max 1: b's breaker opens
    assert guard.breaker.state == "closed"  # the heartbeat key's node, a
    assert beside(guard, storage, [on_a, on_b, on_a2]) == [A]
    storage.down = {A}
    clock.advance(RESET)
    assert kinds(guard, [on_a, on_b], 1) == ["degraded allowed"]  # a opens, b's trial closes it
    assert guard.breaker.state == "open"
    assert beside(guard, storage, [on_a, on_b, on_a2]) == [B]


class OneNode(MemoryStorage):
    """A single-node store that records the parts sent."""

    def __init__(self) -> None:
        super().__init__(clock=lambda: NOW)
        self.parts: list[list[Check]] = []

    def evaluate_parts(
        self, parts: Sequence[Sequence[Check]], *, now_us: int | None = None
    ) -> list[Evaluation | StorageError]:
        self.parts.extend(list(p) for p in parts)
        return super().evaluate_parts(parts, now_us=now_us)


def test_one_node_is_sent_all_of_its_checks_or_none() -> None:
    storage = OneNode()
    guard = Guard(storage, fail_max=1)
    checks = [limit("a"), limit("b")]
    guard.evaluate_beside(checks, "the test's call", now_us=NOW)
    assert storage.parts == [checks]
    guard.breaker.failure(StorageUnavailable("down"))
    guard.evaluate_beside(checks, "the test's call", now_us=NOW)
    assert storage.parts == [checks]  # nothing more sent


def test_a_call_beside_the_request_hears_as_a_request_does_on_each_node() -> None:
    """An outage of a node counts on that node's breaker only; an error reply is an answer
    (the count goes back to 0, it never opens); a half-open breaker's one trial may be the
    side call's, whose answer closes it, and while another call holds the trial the side call
    is not sent."""
    guard, storage, clock = make("open", fail_max=2)
    on_a, on_b = limit("a"), limit("b")
    storage.down.add(B)
    assert beside(guard, storage, [on_a, on_b]) == [A, B]
    assert (guard.breakers.get(A).failures, guard.breakers.get(B).failures) == (0, 1)
    storage.down.clear()
    storage.garbled.add(B)
    assert beside(guard, storage, [on_a, on_b]) == [A, B]
    assert guard.breakers.get(B).failures == 0  # answered: an error reply is no outage
    assert guard.health()["unreadable_replies"] == 1
    storage.garbled.clear()
    storage.down.add(B)
    assert beside(guard, storage, [on_b]) == [B]
    assert beside(guard, storage, [on_b]) == [B]
    assert guard.breakers.states() == {A: "closed", B: "open"}  # 2 of 2: opened
    assert beside(guard, storage, [on_a, on_b]) == [A]
    storage.down.clear()
    clock.advance(RESET)
    trial = guard.breakers.get(B)
    assert trial.allow()  # a request takes the one trial: nothing beside it goes to b
    assert beside(guard, storage, [on_a, on_b]) == [A]
    trial.release()  # that trial ended without an answer (an unrelated exception)
    assert beside(guard, storage, [on_b]) == [B]  # the side call's trial, answered
    assert guard.breakers.states() == {A: "closed", B: "closed"}


def test_a_call_beside_the_request_never_raises_a_storage_bug_and_frees_the_trial(
    caplog: pytest.LogCaptureFixture,
) -> None:
    guard, storage, clock = make("open")
    storage.down.add(B)
    assert kinds(guard, [limit("b")], 1) == ["degraded allowed"]  # b's breaker opens
    storage.down.clear()
    clock.advance(RESET)

    def broken(parts: object, *, now_us: int | None = None) -> list[Evaluation | StorageError]:
        raise RuntimeError("a bug in a storage")

    storage.evaluate_parts = broken  # type: ignore[method-assign]
    guard.evaluate_beside([limit("b")], "the test's call", now_us=NOW)  # the trial: no raise
    assert "The test's call failed unexpectedly" in caplog.text
    assert guard.breakers.get(B).state == "half-open"
    assert guard.breakers.get(B).allow()  # the trial was freed for the next caller


def test_a_side_call_s_lost_reply_is_an_answer() -> None:
    """A reply lost to a cut connection that a fresh one answers (``StorageReplyLost``) is not
    an outage of the heartbeat's or the lease records' node, as for a request's call."""
    from flask_distlimit.errors import StorageReplyLost

    guard, _, _ = make("open", fail_max=2)
    key = limit("b").key
    guard.breaker_of(key).failure(StorageUnavailable("an outage before"))

    def cut(storage: object) -> tuple[str, ...]:
        raise StorageReplyLost("the reply was lost; a fresh connection answered")

    guard.side_call(key, cut, "the test's call")
    assert guard.breaker_of(key).failures == 0


def test_health_shows_each_nodes_breaker_and_the_worst_in_the_aggregate_keys() -> None:
    """Node b is down, node a serves the instance heartbeat key: ``breaker_nodes`` has both
    nodes' figures, and ``breaker``, ``breaker_failures`` and ``breaker_open_seconds`` describe
    b, the node that degrades requests (they were a's: ``0`` and ``None``)."""
    guard, storage, clock = make("open", fail_max=2)
    storage.down.add(B)
    kinds(guard, [limit("b")], 2)
    clock.advance(4.25)
    health = guard.health()
    assert health["breaker_nodes"] == {
        A: {"state": "closed", "failures": 0, "open_seconds": None},
        B: {"state": "open", "failures": 2, "open_seconds": 4.25},
    }
    assert health["breakers"] == {A: "closed", B: "open"}
    assert (health["breaker"], health["breaker_failures"]) == ("open", 2)
    assert health["breaker_open_seconds"] == 4.25
    assert guard.breaker.state == "closed"  # the heartbeat key's node
    storage.down.clear()
    clock.advance(RESET)
    kinds(guard, [limit("b")], 1)  # the trial closes b's breaker
    storage.down.add(A)
    kinds(guard, [limit("a")], 1)  # one outage of a: all closed, a counts one
    health = guard.health()
    assert (health["breaker"], health["breaker_failures"]) == ("closed", 1)
    assert health["breaker_open_seconds"] is None


@pytest.mark.parametrize(
    ("policy", "on_garbled_node"),
    [
        ("closed", ["unavailable"] * 4),
        ("open", ["degraded allowed"] * 4),
        ("local", ["degraded allowed"] * 3 + ["degraded denied"]),  # limit 3, one instance
    ],
)
def test_a_node_answering_error_replies_gets_the_policy_for_its_keys_only(
    policy: str, on_garbled_node: list[str]
) -> None:
    """Never a 500 on a Cluster either: the error reply's checks go to the failure policy, the
    other nodes' answers stand (what they admitted is given back when the policy refuses), and
    the node's breaker stays closed (it answered)."""
    guard, storage, _ = make(policy)
    storage.garbled.add(B)
    assert kinds(guard, [limit("bob")], 4) == on_garbled_node
    assert kinds(guard, [limit("alice")], 4) == ["allowed"] * 3 + ["denied"]
    mixed = [limit("anna"), limit("bea")]
    kind = kinds(guard, mixed, 1)[0]
    assert kind == ("unavailable" if policy == "closed" else "degraded allowed")
    assert storage.remaining(limit("anna")) == (3 if policy == "closed" else 2)
    assert guard.breakers.states() == {A: "closed", B: "closed"}


def test_a_lost_reply_on_a_cluster_admits_without_the_local_fallback_as_on_one_node() -> None:
    """A reply lost to a cut connection that a fresh one answered (``StorageReplyLost``): the
    node is up, so under ``local`` its fallback does not take over its keys for a reset timeout
    (each request then held to a local share while Redis answers): the request is admitted,
    marked degraded, as on a single node. Node a's check beside it is decided by Redis."""
    from flask_distlimit.errors import StorageReplyLost

    guard, storage, _ = make("local", fail_max=1)
    lost = {B}

    def cut(storage_evaluate: object = storage.evaluate) -> object:
        def evaluate(checks: Sequence[Check], *, now_us: int | None = None) -> Evaluation:
            if any(storage.serving(c.key) in lost for c in checks):
                raise StorageReplyLost("the reply was lost; a fresh connection answered")
            return storage_evaluate(checks, now_us=now_us)  # type: ignore[operator]

        return evaluate

    storage.evaluate = cut()  # type: ignore[method-assign]
    on_a, on_b = limit("a"), limit("b")
    outcome = guard.evaluate([on_a, on_b], now_us=NOW)
    assert (kind_of(outcome), outcome.degraded) == ("degraded allowed", True)
    assert storage.remaining(on_a) == 2  # counted by Redis
    assert not any(f.holding for f in guard.fallbacks.all())
    assert guard.breakers.states() == {A: "closed", B: "closed"}
    lost.clear()
    assert kinds(guard, [on_b], 4) == ["allowed"] * 3 + ["denied"]  # Redis's quota, not a share


class BusyShards(Shards):
    """Node b's calls queue past their budget in this process (every pooled connection busy)."""

    def evaluate(self, checks: Sequence[Check], *, now_us: int | None = None) -> Evaluation:
        if any(self.serving(c.key) == B for c in checks):
            raise StorageBusy("every connection busy (fake)")
        return super().evaluate(checks, now_us=now_us)


@pytest.mark.parametrize("policy", ["open", "local", "closed"])
def test_a_node_whose_calls_queue_is_neither_failed_nor_answered_by_the_policy(
    policy: str,
) -> None:
    # This process's load on one primary's pool: the request is refused (busy, a 503) under
    # every policy, the node's breaker hears nothing, and node a gives back what it took.
    storage = BusyShards()
    guard = Guard(storage, policy=policy, fail_max=1, reset_timeout=RESET)  # type: ignore[arg-type]
    both = [limit("alice", 2), limit("bob", 2)]
    for _ in range(3):
        outcome = guard.evaluate(both, now_us=NOW)
        assert (outcome.busy, outcome.unavailable, outcome.evaluation) == (True, True, None)
    assert guard.breakers.states() == {A: "closed", B: "closed"}
    assert [b.failures for b in guard.breakers.all()] == [0, 0]
    assert storage.remaining(both[0]) == 2  # given back each time
