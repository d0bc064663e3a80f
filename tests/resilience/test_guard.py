"""The guard on a scriptable storage and a fake clock: policies, breaker wiring, heartbeats,
repaired keys, health and metrics. (Real outages of real servers:
tests/resilience/test_faults*.py.)"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections.abc import Sequence

import pytest
from prometheus_client import CollectorRegistry

from flask_distlimit.core.decision import Check, Evaluation
from flask_distlimit.core.policies import validate_policy
from flask_distlimit.errors import ConfigurationError, StorageMisconfigured
from flask_distlimit.resilience.guard import Guard
from flask_distlimit.resilience.outcome import Outcome
from flask_distlimit.resilience.storage_log import MISCONFIGURED_LOG_INTERVAL
from flask_distlimit.telemetry.metrics import Metrics
from tests.guard_helpers import REFUSAL, FakeClock, ScriptedStorage, check

NOW = 1_700_000_000_000_000  # microseconds; one fixed window for every call of a test


def make(mode: str = "ok", **kwargs: object) -> tuple[Guard, ScriptedStorage, FakeClock]:
    storage = ScriptedStorage(mode)  # type: ignore[arg-type]
    clock = FakeClock()
    kwargs.setdefault("fallback_factory", ScriptedStorage)
    guard = Guard(storage, clock=clock, **kwargs)  # type: ignore[arg-type]
    return guard, storage, clock


def test_healthy_storage_answers_plainly() -> None:
    guard, storage, _ = make()
    outcome = guard.evaluate([check(limit=2)], now_us=NOW)
    assert outcome.evaluation is not None and outcome.evaluation.allowed
    assert not outcome.degraded and not outcome.unavailable
    assert storage.calls == 1


def test_policy_open_allows_marked_degraded() -> None:
    guard, _, _ = make("down", policy="open")
    assert guard.evaluate([check()], now_us=NOW) == Outcome(None, degraded=True)


def test_policy_closed_is_unavailable() -> None:
    guard, _, _ = make("down", policy="closed")
    assert guard.evaluate([check()], now_us=NOW) == Outcome(None, degraded=True, unavailable=True)


def test_per_route_policy_overrides_the_default() -> None:
    guard, _, _ = make("down", policy="open")
    assert guard.evaluate([check()], policy="closed", now_us=NOW).unavailable
    assert not guard.evaluate([check()], now_us=NOW).unavailable
    local = guard.evaluate([check(limit=5)], policy="local", now_us=NOW)
    assert local.degraded and local.evaluation is not None


def test_policy_local_enforces_each_limit_divided_by_instances() -> None:
    guard, _, _ = make("down", policy="local", instances=3)
    checks = [
        check("ratelimit:{a}:ip:fixed_window", limit=10),
        check("ratelimit:{a}:t:fixed_window", limit=100),
    ]
    outcomes = [guard.evaluate(checks, now_us=NOW) for _ in range(5)]
    assert all(o.degraded and not o.unavailable for o in outcomes)
    evaluations = [o.evaluation for o in outcomes]
    assert all(e is not None for e in evaluations)
    assert [e.allowed for e in evaluations if e] == [True, True, True, False, False]
    first = evaluations[0]
    assert first is not None
    assert [d.limit for d in first.decisions] == [3, 33]  # the headers show the reduced numbers
    assert [d.remaining for d in first.decisions] == [2, 32]


def test_local_share_is_at_least_one() -> None:
    guard, _, _ = make("down", policy="local", instances=5)
    first = guard.evaluate([check(limit=2)], now_us=NOW).evaluation
    second = guard.evaluate([check(limit=2)], now_us=NOW).evaluation
    assert first is not None and first.allowed and first.decisions[0].limit == 1
    assert second is not None and not second.allowed


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("open", Outcome(None, degraded=True)),
        ("closed", Outcome(None, degraded=True, unavailable=True)),
    ],
)
def test_an_error_reply_gets_the_policy_never_counts_as_an_outage_and_is_logged(
    policy: str, expected: Outcome, caplog: pytest.LogCaptureFixture
) -> None:
    """Never a 500 (the brief: bad Redis replies get a safe default): the failure policy
    answers, the breaker hears a success (the store answered), one ERROR line a minute."""
    guard, storage, clock = make("error", fail_max=2, policy=policy)
    with caplog.at_level(logging.ERROR, logger="flask_distlimit.guard"):
        for _ in range(5):
            assert guard.evaluate([check()], now_us=NOW) == expected
        clock.advance(MISCONFIGURED_LOG_INTERVAL)
        guard.evaluate([check()], now_us=NOW)
    assert guard.breaker.state == "closed"
    assert guard.breaker.failures == 0
    assert storage.calls == 6
    lines = [r for r in caplog.records if "cannot read" in r.getMessage()]
    assert len(lines) == 2  # once, then once a minute
    assert "scripted error reply" in lines[0].getMessage()


def test_a_side_call_s_error_reply_is_an_answer_counted_and_logged_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A heartbeat's or a lease record's error reply: the breaker hears a success, every one is
    counted in ``health()`` and the metric, and they share the request's one ERROR line a
    minute (each logged a traceback before)."""
    from flask_distlimit.errors import StorageResponseError

    guard, _, clock = make("ok", fail_max=1)
    registry = CollectorRegistry()
    guard.use_metrics(Metrics(registry))

    def call(storage: object) -> tuple[str, ...]:
        raise StorageResponseError("scripted bad heartbeat reply")

    with caplog.at_level(logging.ERROR, logger="flask_distlimit.guard"):
        for _ in range(3):
            guard.side_call("t:{x}:heartbeat", call, "the test's call")
        clock.advance(MISCONFIGURED_LOG_INTERVAL)
        guard.side_call("t:{x}:heartbeat", call, "the test's call")
    assert guard.breaker.state == "closed" and guard.breaker.failures == 0
    health = guard.health()
    assert health["unreadable_replies"] == 4
    assert health["unreadable_last"] == "scripted bad heartbeat reply"
    assert registry.get_sample_value("distlimit_unreadable_replies_total") == 4.0
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 2 and all("the test's call" in line for line in lines)
    assert all(r.exc_info is None for r in caplog.records)  # a line, not a traceback


def test_an_error_reply_under_local_is_decided_by_the_local_share() -> None:
    guard, _, _ = make("error", policy="local")
    outcome = guard.evaluate([check()], now_us=NOW)
    assert outcome.degraded and outcome.evaluation is not None
    assert outcome.evaluation.allowed


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("open", Outcome(None, degraded=True)),
        ("closed", Outcome(None, degraded=True, unavailable=True)),
    ],
)
def test_a_refusing_storage_is_an_outage_for_the_policy(policy: str, expected: Outcome) -> None:
    guard, storage, _ = make("refused", policy=policy, fail_max=3)
    for _ in range(5):
        assert guard.evaluate([check()], now_us=NOW) == expected
    assert guard.breaker.state == "open"  # counted like any outage
    assert storage.calls == 3


def test_a_refusing_storage_under_policy_local_enforces_locally() -> None:
    guard, _, _ = make("refused", policy="local", instances=2)
    outcomes = [guard.evaluate([check(limit=4)], now_us=NOW) for _ in range(3)]
    assert all(o.degraded and not o.unavailable for o in outcomes)
    assert [o.evaluation.allowed for o in outcomes if o.evaluation] == [True, True, False]


def refusal_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "flask_distlimit.guard" and r.levelno == logging.ERROR
    ]


def test_a_refusal_is_logged_at_error_once_a_minute_on_the_clock(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # fail_max high: every request reaches the storage and is refused.
    guard, storage, clock = make("refused", fail_max=1000)
    with caplog.at_level(logging.ERROR, logger="flask_distlimit.guard"):
        for _ in range(20):
            guard.evaluate([check()], now_us=NOW)
        assert len(refusal_lines(caplog)) == 1
        clock.advance(MISCONFIGURED_LOG_INTERVAL - 0.001)
        guard.evaluate([check()], now_us=NOW)
        assert len(refusal_lines(caplog)) == 1
        clock.advance(0.001)
        for _ in range(20):
            guard.evaluate([check()], now_us=NOW)
        assert len(refusal_lines(caplog)) == 2
        storage.mode = "down"  # a plain outage is the breaker's business, never this line
        clock.advance(MISCONFIGURED_LOG_INTERVAL)
        guard.evaluate([check()], now_us=NOW)
    lines = refusal_lines(caplog)
    assert len(lines) == 2
    assert storage.calls == 42
    assert REFUSAL in lines[0]  # the cause and the fix
    assert "'open'" in lines[0] and "scripted:ratelimit" in lines[0]


def test_the_refusal_log_follows_the_breaker_trials(caplog: pytest.LogCaptureFixture) -> None:
    """With the breaker open only its trials reach the storage: one line per minute still."""
    guard, _, clock = make("refused", fail_max=2, reset_timeout=30)
    with caplog.at_level(logging.ERROR, logger="flask_distlimit.guard"):
        for _ in range(3 * 60):  # three minutes, a request per second
            guard.evaluate([check()], now_us=NOW)
            clock.advance(1)
    assert len(refusal_lines(caplog)) == 3


def test_a_forked_child_logs_the_refusal_again(caplog: pytest.LogCaptureFixture) -> None:
    guard, _, _ = make("refused", fail_max=1000)
    with caplog.at_level(logging.ERROR, logger="flask_distlimit.guard"):
        guard.evaluate([check()], now_us=NOW)
        guard._after_fork()  # what os.register_at_fork runs in a child
        guard.evaluate([check()], now_us=NOW)
    assert len(refusal_lines(caplog)) == 2


def test_breaker_opens_then_answers_without_the_storage() -> None:
    guard, storage, _ = make("down", fail_max=3, reset_timeout=30)
    for _ in range(10):
        assert guard.evaluate([check()], now_us=NOW).degraded
    assert guard.breaker.state == "open"
    assert storage.calls == 3


def test_after_recovery_local_counts_hold_until_their_window_ends() -> None:
    """The breaker closes, but a key decided locally stays counted here until the quota its local
    decisions saw is whole again: Redis never learnt of those admissions."""
    guard, storage, clock = make("down", policy="local", fail_max=1, reset_timeout=1, instances=2)
    key = [check(limit=4)]  # share 2; its window ends 40 s after NOW
    assert [guard.evaluate(key, now_us=NOW).evaluation.allowed for _ in range(2)] == [True, True]
    assert guard.fallback.active
    storage.mode = "ok"
    clock.advance(0.5)
    assert guard.evaluate(key, now_us=NOW).degraded  # still open
    assert storage.calls == 1
    clock.advance(0.5)
    trial = guard.evaluate(key, now_us=NOW)  # Redis admits it, but this process's share is spent
    assert guard.breaker.state == "closed"
    assert trial.degraded and trial.evaluation is not None and not trial.evaluation.allowed
    other = guard.evaluate([check("ratelimit:{other}:route:fixed_window", limit=4)], now_us=NOW)
    assert not other.degraded  # never decided locally: Redis alone decides it
    calls = storage.calls
    refused = guard.evaluate(key, now_us=NOW)  # refused here, without asking Redis
    assert refused.degraded and refused.evaluation is not None
    assert not refused.evaluation.allowed and refused.evaluation.decisions[0].limit == 2
    assert refused.evaluation.decisions[0].retry_after == 40.0  # when the share is whole again
    assert storage.calls == calls
    clock.advance(39)
    assert guard.fallback.active
    clock.advance(1)  # the window ended: what was admitted locally no longer counts anywhere
    assert not guard.fallback.active
    outcome = guard.evaluate(key, now_us=NOW + 40_000_000)
    assert not outcome.degraded
    assert outcome.evaluation is not None and outcome.evaluation.decisions[0].limit == 4
    assert outcome.evaluation.decisions[0].remaining == 3  # counting resumed from the storage


def test_failed_trial_keeps_degrading() -> None:
    guard, storage, clock = make("down", fail_max=1, reset_timeout=1)
    guard.evaluate([check()], now_us=NOW)
    clock.advance(1)
    assert guard.evaluate([check()], now_us=NOW).degraded
    assert storage.calls == 2
    assert guard.breaker.state == "open"


def test_repaired_keys_are_logged_at_warning_key_only(caplog: pytest.LogCaptureFixture) -> None:
    guard, storage, _ = make()
    storage.repaired = ("ratelimit:{abc}:route:fixed_window",)
    with caplog.at_level(logging.WARNING, logger="flask_distlimit.guard"):
        outcome = guard.evaluate([check()], now_us=NOW)
    assert not outcome.degraded
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 1
    assert "ratelimit:{abc}:route:fixed_window" in messages[0]


def test_auto_instances_beat_when_due_and_divide_the_fallback() -> None:
    guard, storage, clock = make(policy="local", instances="auto", heartbeat_interval=5, fail_max=1)
    key = "ratelimit:instances"
    # Two other live processes.
    storage.heartbeats[key] = {"host-a:1:x": 15.0, "host-b:2:y": 15.0}
    guard.evaluate([check()], now_us=NOW)
    assert storage.calls == 2  # the request's call, then one heartbeat
    assert guard.instances.member in storage.heartbeats[key]
    assert guard.instances.seen == 3
    guard.evaluate([check()], now_us=NOW)
    assert storage.calls == 3  # not due again yet
    clock.advance(5)
    guard.evaluate([check()], now_us=NOW)
    assert storage.calls == 5
    storage.mode = "down"
    degraded = guard.evaluate([check(limit=30)], now_us=NOW)
    assert degraded.evaluation is not None
    assert degraded.evaluation.decisions[0].limit == 10
    assert guard.health()["instances_seen"] == 3


def test_auto_instances_before_any_heartbeat_divide_by_one() -> None:
    guard, _, _ = make("down", policy="local", instances="auto")
    evaluation = guard.evaluate([check(limit=30)], now_us=NOW).evaluation
    assert evaluation is not None and evaluation.decisions[0].limit == 30


def test_heartbeat_outage_counts_for_the_breaker() -> None:
    guard, storage, _ = make(instances="auto", fail_max=1)

    def failing_heartbeat(key: str, member: str, ttl: float) -> int:
        from flask_distlimit.errors import StorageUnavailable

        raise StorageUnavailable("gone between two calls")

    storage.heartbeat = failing_heartbeat  # type: ignore[method-assign]
    outcome = guard.evaluate([check()], now_us=NOW)
    assert not outcome.degraded  # the request itself was decided by the storage
    assert guard.breaker.state == "open"


def test_member_is_host_pid_and_changes_in_a_forked_child() -> None:
    guard, _, _ = make(instances="auto")
    parent = guard.instances.member
    assert parent.split(":")[1] == str(os.getpid())
    read, write = os.pipe()
    with warnings.catch_warnings():  # 3.12+ warns about forking a process that has threads
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: report its member and leave at once
        try:
            os.write(write, guard.instances.member.encode())
        finally:
            os._exit(0)
    os.close(write)
    child = os.read(read, 200).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert child.split(":")[1] == str(pid)
    assert child != parent


def test_health_reports_latency_breaker_scripts_and_instances() -> None:
    guard, storage, _ = make(fail_max=1)
    health = guard.health()
    assert health["ok"] is True
    assert health["breaker"] == "closed"
    assert health["scripts_loaded"] is True
    assert isinstance(health["latency_ms"], float)
    storage.mode = "down"
    guard.evaluate([check()], now_us=NOW)
    health = guard.health()
    assert health["ok"] is False
    assert health["breaker"] == "open"
    assert health["latency_ms"] is None
    assert health["error"]


@pytest.mark.parametrize(
    ("mode", "error_type", "says"),
    [
        ("down", "StorageUnavailable", "scripted outage"),
        ("refused", "StorageMisconfigured", REFUSAL),
        ("error", "StorageResponseError", "scripted error reply"),
        ("broken", "RuntimeError", "unexpected RuntimeError from the storage: scripted bug with"),
    ],
)
def test_health_never_raises(mode: str, error_type: str, says: str) -> None:
    guard, _, _ = make(mode)
    health = guard.health()
    assert health["ok"] is False
    assert health["error_type"] == error_type
    assert says in str(health["error"])
    assert "\n" not in str(health["error"])  # one line
    assert health["breaker"] == "closed"  # an explicit check never moves the breaker
    assert health["latency_ms"] is None


class _RefusesScripts(ScriptedStorage):
    """PING answers, the script is refused: what an ACL user without EVALSHA sees."""

    probed: Sequence[Check] = ()

    def evaluate(self, checks: Sequence[Check], *, now_us: int | None = None) -> Evaluation:
        self.probed = checks
        raise StorageMisconfigured(REFUSAL)


def test_health_evaluates_at_cost_zero_so_a_refused_script_shows() -> None:
    storage = _RefusesScripts()
    health = Guard(storage, key_prefix="app:rl").health()
    assert health["ok"] is False and health["error_type"] == "StorageMisconfigured"
    assert isinstance(health["latency_ms"], float)  # the server answers PING
    [probe] = storage.probed
    assert probe.cost == 0 and probe.key.startswith("app:rl:")  # within the ACL's key pattern


def test_metrics_count_decisions_latency_breaker_and_fallback() -> None:
    registry = CollectorRegistry()
    guard, storage, clock = make(
        policy="local", fail_max=1, reset_timeout=1, metrics=Metrics(registry)
    )
    checks = [check(limit=1)]
    guard.evaluate(checks, now_us=NOW)
    guard.evaluate(checks, now_us=NOW)

    def value(name: str, **labels: str) -> float:
        got = registry.get_sample_value(name, labels)
        return 0.0 if got is None else got

    limit = "route:fixed_window"
    assert value("distlimit_decisions_total", limit=limit, outcome="allowed") == 1
    assert value("distlimit_decisions_total", limit=limit, outcome="denied") == 1
    assert value("distlimit_storage_latency_seconds_count") == 2
    assert value("distlimit_breaker_state", breaker="scripted:ratelimit") == 0
    storage.mode = "down"
    guard.evaluate(checks, now_us=NOW)
    guard.evaluate(checks, now_us=NOW)
    assert value("distlimit_breaker_state", breaker="scripted:ratelimit") == 2
    assert value("distlimit_decisions_total", limit=limit, outcome="degraded") == 2
    # The local budget starts from what the storage last said: nothing left.
    assert value("distlimit_fallback_decisions_total", limit=limit, outcome="allowed") == 0
    assert value("distlimit_fallback_decisions_total", limit=limit, outcome="denied") == 2
    assert value("distlimit_storage_latency_seconds_count") == 3  # open: storage not called
    storage.mode = "ok"
    clock.advance(1)
    guard.evaluate(checks, now_us=NOW + 60_000_000)
    assert value("distlimit_breaker_state", breaker="scripted:ratelimit") == 0


def test_the_client_identity_never_becomes_a_metric_label() -> None:
    registry = CollectorRegistry()
    guard, _, _ = make(metrics=Metrics(registry))
    for client in ("aaa", "bbb", "ccc"):
        guard.evaluate([check(f"ratelimit:{{{client}}}:route:gcra")], now_us=NOW)
    labels = {
        s.labels["limit"]
        for m in registry.collect()
        for s in m.samples
        if m.name == "distlimit_decisions"
    }
    assert labels == {"route:gcra"}


@pytest.mark.parametrize("bad", ["fail-open", "", None, "OPEN"])
def test_unknown_policy_is_a_configuration_error(bad: object) -> None:
    with pytest.raises(ConfigurationError, match=r"open.*closed.*local"):
        validate_policy(bad)
    with pytest.raises(ConfigurationError):
        Guard(ScriptedStorage(), policy=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [{"instances": 0}, {"instances": "many"}, {"fail_max": 0}, {"reset_timeout": -1}],
)
def test_bad_settings_are_configuration_errors(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError, match="DISTLIMIT_"):
        Guard(ScriptedStorage(), **kwargs)  # type: ignore[arg-type]


def test_concurrent_storage_calls_overlap_through_the_guard() -> None:
    """Two threads are inside the storage at once: the guard holds no lock around the call.
    Counted, not timed: each call waits at a barrier for the other, which a guard that ran
    calls one at a time would never let it meet (the barrier breaks after 5 s)."""
    barrier = threading.Barrier(2, timeout=5)

    class Meeting(ScriptedStorage):
        def evaluate(self, checks: Sequence[Check], *, now_us: int | None = None) -> Evaluation:
            barrier.wait()  # raises BrokenBarrierError when the other call never comes
            return super().evaluate(checks, now_us=now_us)

    storage = Meeting()
    guard = Guard(storage)
    results: list[bool] = []
    ts = [
        threading.Thread(target=lambda: results.append(not guard.evaluate([check()]).degraded))
        for _ in range(2)
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert results == [True, True] and not barrier.broken
    assert storage.calls == 2


@pytest.mark.slow
def test_closed_breaker_path_adds_only_microseconds() -> None:
    storage = ScriptedStorage()
    guard = Guard(storage)
    checks = [check()]
    n = 20_000

    def per_call(fn: object) -> float:
        started = time.perf_counter()
        for _ in range(n):
            fn(checks, now_us=NOW)  # type: ignore[operator]
        return (time.perf_counter() - started) / n

    bare = min(per_call(storage.evaluate) for _ in range(3))
    guarded = min(per_call(guard.evaluate) for _ in range(3))
    # ~1 us here; loose bound for a noisy shared machine (bench/bench_failure.py measures it).
    assert guarded - bare < 20e-6


def test_a_storage_failing_every_other_call_admits_one_share() -> None:
    """Issue 11: each success used to drop the local counts, so every failed call met an empty
    store and was admitted: 20 of 40 here, where this process's share is 5."""
    guard, storage, _ = make(policy="local", instances=2)
    key = [check(limit=10)]
    admitted = 0
    for n in range(40):
        storage.mode = "down" if n % 2 else "ok"
        outcome = guard.evaluate(key, now_us=NOW)
        assert outcome.evaluation is not None
        admitted += outcome.evaluation.allowed
    assert admitted == 5  # 1 before the first failure, then 9 // 2 = 4 from what Redis said
    assert guard.breaker.state == "closed"


def test_the_local_budget_starts_from_what_the_storage_last_said() -> None:
    guard, storage, clock = make(policy="local", instances=3, fail_max=1, reset_timeout=1)
    key = [check(limit=30)]  # share 10
    assert all(guard.evaluate(key, now_us=NOW).evaluation.allowed for _ in range(24))  # type: ignore[union-attr]
    storage.mode = "down"
    local = [guard.evaluate(key, now_us=NOW).evaluation for _ in range(4)]
    assert [e.allowed for e in local if e] == [True, True, False, False]  # 6 left // 3 = 2
    assert local[0] is not None and local[0].decisions[0].limit == 10
    clock.advance(40)  # a new window: what Redis said is stale, the share is whole
    later = [guard.evaluate(key, now_us=NOW + 40_000_000).evaluation for _ in range(11)]
    assert [e.allowed for e in later if e] == [True] * 10 + [False]


def test_keys_counted_only_while_failures_go_on_hand_back_a_reset_timeout_later() -> None:
    guard, storage, clock = make(policy="local", instances=2, reset_timeout=5)
    local = [check("ratelimit:{a}:r:fixed_window", limit=100)]
    remote = [check("ratelimit:{b}:r:fixed_window", limit=100)]
    storage.mode = "down"
    assert guard.evaluate(local, now_us=NOW).degraded  # a failure: 5 s of counting everything
    storage.mode = "ok"
    assert not guard.evaluate(remote, now_us=NOW).degraded
    assert guard.fallback.held() == 2  # the one Redis answered counts here too
    clock.advance(5)
    assert not guard.fallback.engaged
    assert not guard.evaluate(remote, now_us=NOW).degraded
    assert guard.fallback.held() == 1  # {b} handed back; {a}'s local admission holds 35 s more
    clock.advance(35)
    assert not guard.fallback.active


def test_other_policies_never_count_locally() -> None:
    guard, storage, _ = make(policy="open")
    storage.mode = "down"
    guard.evaluate([check(limit=4)], policy="local", now_us=NOW)  # one local route
    storage.mode = "ok"
    for _ in range(10):
        outcome = guard.evaluate([check(limit=100)], now_us=NOW)  # routes under "open"
        assert not outcome.degraded
    assert len(guard.last_known) == 0


def test_metrics_can_be_attached_to_a_running_guard() -> None:
    registry = CollectorRegistry()
    guard, _, _ = make("down", fail_max=1)
    guard.evaluate([check()], now_us=NOW)
    guard.use_metrics(Metrics(registry))
    assert (
        registry.get_sample_value("distlimit_breaker_state", {"breaker": "scripted:ratelimit"}) == 2
    )
    guard.evaluate([check()], now_us=NOW)
    labels = {"limit": "route:fixed_window", "outcome": "degraded"}
    assert registry.get_sample_value("distlimit_decisions_total", labels) == 1


def test_a_forked_child_never_inherits_a_held_breaker_lock() -> None:
    guard, _, _ = make(fail_max=1)
    guard.breaker._lock.acquire()  # as if another thread were changing state at fork time
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            try:
                from flask_distlimit.errors import StorageUnavailable

                guard.breaker.failure(StorageUnavailable("x"))  # would deadlock on the copy
                os._exit(0 if guard.breaker.state == "open" else 1)
            finally:
                os._exit(2)
    finally:
        guard.breaker._lock.release()
    deadline = time.monotonic() + 10
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("the child deadlocked on the breaker lock")
        time.sleep(0.01)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
