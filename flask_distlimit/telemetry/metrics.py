"""Optional Prometheus metrics (the ``prometheus`` extra of Flask-DistLimit).

``prometheus_client`` is imported only when a :class:`Metrics` is built; nothing else in the package
needs it. Series (all prefixed ``distlimit_``):

- ``decisions_total{limit, outcome}``: per limit of each request; outcome ``allowed``, ``denied``
  or ``degraded`` (the storage failed and the failure policy answered);
- ``fallback_decisions_total{limit, outcome}``: decisions of the local fallback (``allowed`` /
  ``denied``), also counted as ``degraded`` above;
- ``shadow_denials_total{limit}``: requests a shadow limit would have refused (it did not;
  :mod:`flask_distlimit.defences.shadow`), whether the storage or the local fallback decided;
- ``shed_total{priority, reason}``: requests shed with a 503 (reason ``worker``: this
  process was busy, :mod:`flask_distlimit.defences.shedding`; ``fleet``: the fleet was,
  :mod:`flask_distlimit.defences.fleet`);
- ``leased_decisions_total{limit}``: requests a quota lease admitted in-process, without a
  storage call (:mod:`flask_distlimit.resilience.leases`; also counted as ``allowed`` above);
- ``lease_units{limit}``: units this process holds in quota leases of the limit (every identity's
  lease of it summed), read when scraped;
- ``worker_in_flight``: requests in flight in this process (when worker shedding is on);
- ``unreadable_replies_total``: storage replies the limiter could not read (an error reply or
  a reply of the wrong shape: a bug, data it does not expect), each answered by the failure
  policy and counted ``degraded`` above while the breaker stays closed; alert on any;
- ``side_call_failures_total``: calls beside a request's (a concurrency slot's give-back, a
  refund, a lease's give-back, an after-response charge) that failed and were skipped; each
  ends there, no request's decision changes;
- ``settled_units_total{limit, unit}``: what requests really cost on the limits settled after
  the response (``deduct_when``, ``settle``, ``unit="content-bytes"``;
  :mod:`flask_distlimit.request.deduction`), in the limit's unit (``requests`` or
  ``content-bytes``): tokens used, bytes sent; a long body's bytes while it is sent;
- ``storage_latency_seconds``: histogram of storage calls (successful or not);
- ``breaker_state{breaker}``: 0 closed, 1 half-open, 2 open; one series per storage node's
  breaker (:mod:`flask_distlimit.resilience.breakers`): ``breaker`` is the guard's name
  (``<scheme>:<key prefix>``) for a single node, ``<guard name>@<host:port>`` for a Sentinel
  master or a Cluster primary; a node's series is removed when it leaves the topology.

Every label takes values from a set that does not grow with clients or quotas:

- ``limit`` is the part of the storage key after the client's hash tag (``<limit id>:<algorithm>``),
  one per configured limit, never per client; a dynamic limit's rate is dropped from it
  (``r_orders_dyn_100/60:gcra`` is counted as ``r_orders_dyn:gcra``), since a callable may
  answer a different quota per tenant (12,000 quotas once made 12,000 series). Past
  :data:`MAX_LIMIT_LABELS` distinct values (more limits than any app declares) the rest are
  counted under ``limit="other"``;
- ``outcome`` is one of ``allowed``, ``denied``, ``degraded``; ``priority`` one of
  :data:`~flask_distlimit.core.priorities.PRIORITIES` (anything else is counted as ``default``);
  ``reason`` one of ``worker``, ``fleet`` (anything else: ``other``);
- ``unit`` is a declared unit (``requests``, ``content-bytes``);
- ``breaker`` has one value per storage node; past :data:`MAX_BREAKER_LABELS` live nodes (more
  than a Redis Cluster has), further nodes get no series.

Metric objects are registered once per registry; :func:`metrics_for` answers the same
:class:`Metrics` for the same registry, so two apps in one process share the series.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final, Generic, TypeVar

from flask_distlimit.core.decision import Check, Evaluation
from flask_distlimit.core.priorities import PRIORITIES
from flask_distlimit.errors import ConfigurationError

_T = TypeVar("_T")

__all__ = [
    "BREAKER_STATE_VALUES",
    "MAX_BREAKER_LABELS",
    "MAX_LIMIT_LABELS",
    "OTHER",
    "Metrics",
    "OnePer",
    "limit_label",
    "metrics_for",
]

BREAKER_STATE_VALUES = {"closed": 0, "half-open": 1, "open": 2}

_MAX_CHILDREN = 10_000
#: The most distinct ``limit`` label values; the rest count under :data:`OTHER`.
MAX_LIMIT_LABELS: Final = 1_000
#: The most storage nodes with a ``breaker_state`` series at once.
MAX_BREAKER_LABELS: Final = 1_000
#: The ``limit`` value of every limit past :data:`MAX_LIMIT_LABELS`, and the ``reason`` of
#: a shed reason that is not one of :data:`_REASONS`.
OTHER: Final = "other"
_REASONS: Final = frozenset({"worker", "fleet"})
#: A dynamic limit's rate in its key: its limit id ``<head>:dyn:100/60`` (``:dyn:c5`` for a
#: concurrency) is ``<head>_dyn_100/60`` there (:func:`flask_distlimit.declare.keys.key_parts`).
_DYNAMIC_RATE: Final = re.compile(r"(?<=_dyn)_c?\d+(?:/\d+)?(?=:[a-z_]+$)")

LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip


def limit_label(key: str) -> str:
    """``ratelimit:{tag}:r_orders_100/60:gcra`` -> ``r_orders_100/60:gcra``; a dynamic limit's
    rate is dropped: ``ratelimit:{tag}:r_x_dyn_100/60:gcra`` -> ``r_x_dyn:gcra``."""
    _, sep, rest = key.partition("}:")
    if not sep:
        return "unknown"
    return _DYNAMIC_RATE.sub("", rest) if "_dyn_" in rest else rest


class Metrics:
    """The Prometheus series of the guard, in ``registry`` (default: the global registry)."""

    def __init__(self, registry: Any = None) -> None:
        try:
            import prometheus_client as pc
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ConfigurationError(
                "Prometheus metrics need prometheus-client: "
                "pip install 'Flask-DistLimit[prometheus]'"
            ) from exc
        kw: dict[str, Any] = {} if registry is None else {"registry": registry}
        self.decisions = pc.Counter(
            "distlimit_decisions", "Rate-limit decisions by limit and outcome",
            ["limit", "outcome"], **kw,
        )  # fmt: skip
        self.fallback_decisions = pc.Counter(
            "distlimit_fallback_decisions", "Decisions of the in-process local fallback",
            ["limit", "outcome"], **kw,
        )  # fmt: skip
        self.shadow_denials = pc.Counter(
            "distlimit_shadow_denials", "Requests a shadow limit would have refused, by limit",
            ["limit"], **kw,
        )  # fmt: skip
        self.shed_requests = pc.Counter(
            "distlimit_shed", "Requests shed with a 503, by priority and reason",
            ["priority", "reason"], **kw,
        )  # fmt: skip
        self.worker_in_flight_gauge = pc.Gauge(
            "distlimit_worker_in_flight", "Requests in flight in this process", **kw,
        )  # fmt: skip
        self.storage_latency = pc.Histogram(
            "distlimit_storage_latency_seconds", "Latency of rate-limit storage calls",
            buckets=LATENCY_BUCKETS, **kw,
        )  # fmt: skip
        self.breaker_state = pc.Gauge(
            "distlimit_breaker_state", "Circuit breaker state: 0 closed, 1 half-open, 2 open",
            ["breaker"], **kw,
        )  # fmt: skip
        self.leased_decisions = pc.Counter(
            "distlimit_leased_decisions", "Requests admitted in-process out of a quota lease",
            ["limit"], **kw,
        )  # fmt: skip
        self.lease_units = pc.Gauge(
            "distlimit_lease_units", "Units this process holds in quota leases, by limit",
            ["limit"], **kw,
        )  # fmt: skip
        self.unreadable_replies = pc.Counter(
            "distlimit_unreadable_replies",
            "Storage replies the limiter could not read, answered by the failure policy", **kw,
        )  # fmt: skip
        self.side_call_failures = pc.Counter(
            "distlimit_side_call_failures",
            "Calls beside requests (a slot's give-back, a refund, an after-response charge) "
            "that failed and were skipped", **kw,
        )  # fmt: skip
        self.settled_units = pc.Counter(
            "distlimit_settled_units",
            "Units requests really cost on limits settled after the response, by limit and unit",
            ["limit", "unit"], **kw,
        )  # fmt: skip
        self._lease_gauges: set[str] = set()
        self._children: dict[tuple[bool, str, str], Any] = {}
        self._labels: set[str] = set()  # the limit label values given out
        self._breakers: set[str] = set()  # the breaker label values with a series
        self._lock = threading.Lock()
        self._observe = self.storage_latency.observe

    def _label(self, key: str) -> str:
        """The ``limit`` label of ``key``: :func:`limit_label`, or :data:`OTHER` past
        :data:`MAX_LIMIT_LABELS` distinct values."""
        label = limit_label(key)
        if label in self._labels:
            return label
        with self._lock:
            if len(self._labels) < MAX_LIMIT_LABELS:
                self._labels.add(label)
                return label
        return OTHER

    def _child(self, fallback: bool, key: str, outcome: str) -> Any:
        label = self._label(key)
        child = self._children.get((fallback, label, outcome))
        if child is None:
            family = self.fallback_decisions if fallback else self.decisions
            child = family.labels(limit=label, outcome=outcome)
            if len(self._children) < _MAX_CHILDREN:
                self._children[(fallback, label, outcome)] = child
        return child

    def _shadow_denied(self, key: str) -> None:
        label = self._label(key)
        child = self._children.get((True, label, "shadow"))
        if child is None:
            child = self.shadow_denials.labels(limit=label)
            if len(self._children) < _MAX_CHILDREN:
                self._children[(True, label, "shadow")] = child
        child.inc()

    def shed(self, priority: str, reason: str) -> None:
        priority = priority if priority in PRIORITIES else "default"
        reason = reason if reason in _REASONS else OTHER
        self.shed_requests.labels(priority=priority, reason=reason).inc()

    def worker_in_flight(self, value: int) -> None:
        self.worker_in_flight_gauge.set(value)

    def storage_call(self, seconds: float, outcome: str = "ok") -> None:
        self._observe(seconds)  # outcome (ok | timeout | error): OpenTelemetry's attribute

    def evaluated(self, checks: Sequence[Check], evaluation: Evaluation) -> None:
        for check, decision in zip(checks, evaluation.decisions, strict=False):
            self._child(False, check.key, "allowed" if decision.allowed else "denied").inc()
            if decision.shadow_denied:
                self._shadow_denied(check.key)

    def shadow_would_deny(self, keys: Sequence[str]) -> None:
        """Shadow limits (by storage key) that would have refused a request in a check the
        storage does not decide itself (a ``deduct_when`` limit's peek before the view)."""
        for key in keys:
            self._shadow_denied(key)

    def leased(self, keys: Sequence[str]) -> None:
        """Limits (by storage key) a quota lease admitted a request on, in-process."""
        for key in keys:
            self._child(False, key, "allowed").inc()
            label = self._label(key)
            child = self._children.get((False, label, "leased"))
            if child is None:
                child = self.leased_decisions.labels(limit=label)
                if len(self._children) < _MAX_CHILDREN:
                    self._children[(False, label, "leased")] = child
            child.inc()

    def watch_lease_units(self, key: str, held: Callable[[str], float]) -> None:
        """Report ``held(label)`` as ``lease_units`` of the limit of ``key`` when scraped."""
        label = self._label(key)
        if label == OTHER or label in self._lease_gauges:
            return
        self._lease_gauges.add(label)
        self.lease_units.labels(limit=label).set_function(lambda: held(label))

    def settled(self, key: str, unit: str, units: int) -> None:
        """``units`` more that requests really cost on the limit of ``key``, settled after the
        response (their bytes, the ``settle`` callable's answer)."""
        self.settled_units.labels(limit=self._label(key), unit=unit).inc(units)

    def degraded(self, checks: Sequence[Check], evaluation: Evaluation | None) -> None:
        for check in checks:
            self._child(False, check.key, "degraded").inc()
        if evaluation is not None:
            for check, decision in zip(checks, evaluation.decisions, strict=False):
                self._child(True, check.key, "allowed" if decision.allowed else "denied").inc()
                if decision.shadow_denied:
                    self._shadow_denied(check.key)

    def unreadable(self) -> None:
        """A storage reply the limiter could not read (the failure policy answered)."""
        self.unreadable_replies.inc()

    def side_call_failed(self) -> None:
        """A call beside a request's failed and was skipped (:meth:`Guard.side_failed
        <flask_distlimit.resilience.guard.Guard.side_failed>`)."""
        self.side_call_failures.inc()

    def breaker_changed(self, breaker: str, state: str) -> None:
        if breaker not in self._breakers:
            with self._lock:
                if len(self._breakers) >= MAX_BREAKER_LABELS:
                    return
                self._breakers.add(breaker)
        self.breaker_state.labels(breaker=breaker).set(BREAKER_STATE_VALUES.get(state, 2))

    def breaker_removed(self, breaker: str) -> None:
        """Drop the series of a breaker whose node left the topology."""
        with self._lock:
            self._breakers.discard(breaker)
        with contextlib.suppress(KeyError):  # never set in this registry
            self.breaker_state.remove(breaker)


class OnePer(Generic[_T]):
    """One object made per owner (a registry, a meter provider): instruments are registered
    once per owner, so every app of the process shares them."""

    def __init__(self, make: Callable[[Any], _T]) -> None:
        self._make = make
        self._made: dict[int, tuple[Any, _T]] = {}
        self._lock = threading.Lock()

    def __call__(self, owner: Any) -> _T:
        with self._lock:
            entry = self._made.get(id(owner))
            if entry is None or entry[0] is not owner:  # an id reused by a new owner
                entry = (owner, self._make(owner))
                self._made[id(owner)] = entry
            return entry[1]


_shared: Final = OnePer(lambda registry: Metrics(registry))


def metrics_for(registry: Any = None) -> Metrics:
    """The one :class:`Metrics` of ``registry`` (default: prometheus_client's global registry)."""
    return _shared(registry)
