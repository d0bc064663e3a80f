"""Bounded, clean logs and metrics: a client cannot forge a log line, flood the log, or grow the
Prometheus series.

- A failing dynamic-limit callable's exception (which may quote a header the client sent) is
  logged escaped and at most once a minute per limit: it used to be logged raw, once per fresh
  identity, so every request with a new tenant id could write an ERROR line.
- No metric label takes a value that grows with clients or quotas: 20,000 distinct values are
  driven through every label (``limit`` from static and dynamic keys, ``outcome``, ``priority``,
  ``reason``, ``breaker``) and the series stay bounded. A dynamic limit's rate used to be part
  of the ``limit`` label (12,000 quotas, 12,000 series).
"""

from __future__ import annotations

import logging

import pytest
from flask import Flask, request
from prometheus_client import CollectorRegistry

from flask_distlimit.core.decision import Check, Decision, Evaluation
from flask_distlimit.declare.dynamic_limits import LOG_TEXT_MAX, log_text
from flask_distlimit.storage.memory import MemoryStorage
from flask_distlimit.telemetry.metrics import MAX_BREAKER_LABELS, MAX_LIMIT_LABELS, OTHER, Metrics
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import clock, make_app

__all__ = ["clock"]  # a fixture used below

DISTINCT = 20_000


def _series(registry: CollectorRegistry) -> dict[str, set[tuple[tuple[str, str], ...]]]:
    """metric family -> the label sets of its samples (one per series)."""
    found: dict[str, set[tuple[tuple[str, str], ...]]] = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            found.setdefault(family.name, set()).add(tuple(sorted(sample.labels.items())))
    return found


def _values(registry: CollectorRegistry, label: str) -> set[str]:
    return {
        sample.labels[label]
        for family in registry.collect()
        for sample in family.samples
        if label in sample.labels
    }


@pytest.mark.slow
def test_twenty_thousand_distinct_values_through_every_label_keep_the_series_bounded() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    allowed = Decision(True, 10, 9, 0.0, 0.0)
    shadowed = Decision(True, 10, 9, 0.0, 0.0, shadow_denied=True)
    for i in range(DISTINCT):
        dynamic = Check(f"ratelimit:{{t{i}}}:r_orders_dyn_{i + 1}/60:gcra", "gcra", i + 1, 60)
        static = Check(f"ratelimit:{{t{i}}}:r_route{i}_10/60:fixed_window", "fixed_window", 10, 60)
        checks = [dynamic, static]
        metrics.evaluated(checks, Evaluation((allowed, allowed)))
        metrics.degraded(checks, Evaluation((allowed, allowed)))
        metrics.leased([dynamic.key, static.key])
        metrics.evaluated(checks, Evaluation((shadowed, shadowed)))
        metrics.watch_lease_units(dynamic.key, lambda label: 0.0)
        metrics.watch_lease_units(static.key, lambda label: 0.0)
        metrics.shed(f"priority-{i}", f"reason-{i}\n")
        metrics.breaker_changed(f"redis:ratelimit@10.0.{i // 256}.{i % 256}:6379", "open")

    limits = _values(registry, "limit")
    assert "r_orders_dyn:gcra" in limits  # every quota of the dynamic limit in one series
    assert not any("/60:gcra" in v for v in limits)
    assert len(limits) <= MAX_LIMIT_LABELS + 1 and OTHER in limits
    assert _values(registry, "outcome") <= {"allowed", "denied", "degraded"}
    assert _values(registry, "priority") == {"default"}
    assert _values(registry, "reason") == {OTHER}
    assert len(_values(registry, "breaker")) == MAX_BREAKER_LABELS
    series = _series(registry)
    assert sum(len(s) for s in series.values()) < 10 * (MAX_LIMIT_LABELS + 1) + MAX_BREAKER_LABELS


def test_a_removed_breaker_frees_its_place() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    for i in range(MAX_BREAKER_LABELS):
        metrics.breaker_changed(f"b{i}", "closed")
    metrics.breaker_changed("late", "open")
    assert "late" not in _values(registry, "breaker")
    metrics.breaker_removed("b0")
    metrics.breaker_changed("late", "open")
    assert "late" in _values(registry, "breaker") and "b0" not in _values(registry, "breaker")


@pytest.mark.slow
def test_a_dynamic_limit_of_many_quotas_is_one_series_per_outcome(clock: FakeClock) -> None:
    """Through the extension: 2,000 tenants, each with a quota of its own."""
    registry = CollectorRegistry()
    app, limiter, _ = make_app(MemoryStorage(clock=clock), clock)

    @app.get("/orders")
    @limiter.limit(
        lambda: f"{int(request.headers['X-Tenant']) + 1}/minute",
        key_func=lambda: request.headers["X-Tenant"],
    )
    def orders() -> str:
        return "ok"

    limiter.state(app).guard.use_metrics(Metrics(registry))
    client = app.test_client()
    for tenant in range(2_000):
        assert client.get("/orders", headers={"X-Tenant": str(tenant)}).status_code == 200
    decisions = _series(registry)["distlimit_decisions"]
    assert len(decisions) == 1, decisions


def test_log_text_escapes_and_bounds() -> None:
    assert log_text("a\nINFO forged line\x1b[31m") == "'a\\nINFO forged line\\x1b[31m'"
    long = log_text("x" * 10_000)
    assert len(long) < LOG_TEXT_MAX + 40 and "10000 characters" in long


def _failing_app(clock: FakeClock) -> Flask:
    app, limiter, _ = make_app(MemoryStorage(clock=clock), clock, DISTLIMIT_DYNAMIC_LIMIT_TTL=60)

    def plan() -> str:
        raise KeyError(f"unknown tenant {request.args['tenant']}")

    @app.get("/orders")
    @limiter.limit(plan, key_func=lambda: request.args["tenant"], fallback="2/minute")
    def orders() -> str:
        return "ok"

    return app


def test_a_failing_callable_logs_escaped_text_once_a_minute(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    app = _failing_app(clock)
    client = app.test_client()
    forged = "x\n2026-01-01 00:00:00 CRITICAL root: forged\x1b[2J"
    with caplog.at_level(logging.ERROR, logger="flask_distlimit"):
        for i in range(500):  # a fresh identity each time: the answer is never kept
            response = client.get("/orders", query_string={"tenant": f"{forged}{i}"})
            assert response.status_code == 200
        clock.advance(61.0)
        client.get("/orders", query_string={"tenant": forged})
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2
    for record in errors:
        text = record.getMessage()
        assert "\n" not in text and "\x1b" not in text and "fallback 2/minute" in text
    assert "499 failure(s) since the last line" in errors[1].getMessage()


@pytest.mark.parametrize("suffix", ["", ":k2", ":k13"])
def test_every_rate_of_a_dynamic_limit_has_one_label_after_a_second_key_func_too(
    suffix: str,
) -> None:
    """A route's second ``key_func`` limit with a callable value counts under ``...:k2``: its
    label dropped the rate only without that suffix, one label per rate answered."""
    from flask_distlimit.declare.keys import key_parts
    from flask_distlimit.telemetry.metrics import limit_label

    labels = set()
    for rate in ("100/60", "7/3600", "c5"):
        head, tail = key_parts("ratelimit", f"r:orders:dyn:{rate}{suffix}", "gcra")
        labels.add(limit_label(f"{head}t1{tail}"))
    assert labels == {f"r_orders_dyn{suffix.replace(':', '_')}:gcra"}
