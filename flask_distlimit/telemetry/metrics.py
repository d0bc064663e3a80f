"""Prometheus metrics (the ``prometheus`` extra), and the one table of every instrument.

:data:`INSTRUMENTS` declares each instrument once, for Prometheus (:class:`Metrics`) and
OpenTelemetry (:mod:`.otel`). What a sink is told, and the gauges' values, are written once in
:class:`Instruments`: a side only says how it counts on one series (``_counter``, kept per
series) and reads the gauges when scraped; :class:`Sinks` tells every sink a guard has.
``prometheus_client`` is imported only when a :class:`Metrics` is built. Every label (and
OpenTelemetry attribute) takes values from a set that does not grow with clients or quotas:
``limit`` is :func:`limit_label` (past :data:`MAX_LIMIT_LABELS` values, :data:`OTHER`),
``breaker`` one per live node (at most :data:`MAX_BREAKER_LABELS`). :func:`metrics_for`
answers one :class:`Metrics` per registry, so two apps in one process share the series. The
series and their meaning: docs/failure-modes.md, "Observability".
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, Generic, TypeAlias, TypeVar, cast

from flask_distlimit.core.decision import Check, Evaluation
from flask_distlimit.core.priorities import PRIORITIES
from flask_distlimit.errors import ConfigurationError

_T = TypeVar("_T")
#: How a side counts ``amount`` on one series (a Prometheus child's ``inc``, an OpenTelemetry
#: counter's ``add`` with its attributes).
Count: TypeAlias = Callable[[float], object]

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
#: concurrency) is ``<head>_dyn_100/60`` there (:func:`flask_distlimit.declare.keys.key_parts`),
#: ``<head>_dyn_100/60_k2`` for a route's second ``key_func`` limit.
_DYNAMIC_RATE: Final = re.compile(r"(?<=_dyn)_c?\d+(?:/\d+)?(?=(?:_k\d+)?:[a-z_]+$)")

LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip

#: Every instrument, once: attribute, kind, Prometheus name and labels, OpenTelemetry name and
#: unit, description. A side without the instrument has ``None`` for its name (OpenTelemetry
#: counts shed requests in ``distlimit.requests``; Prometheus counts no requests, no slots). A
#: gauge is read when scraped: a custom collector on Prometheus, an observable gauge on
#: OpenTelemetry.
INSTRUMENTS: Final = (
    ("requests", "counter", None, (), "distlimit.requests", "{request}",
     "Requests the rate limiter decided, by result"),
    ("decisions", "counter", "distlimit_decisions", ("limit", "outcome"),
     "distlimit.decisions", "{decision}", "Rate-limit decisions by limit and outcome"),
    ("fallback_decisions", "counter", "distlimit_fallback_decisions", ("limit", "outcome"),
     "distlimit.fallback.decisions", "{decision}", "Decisions of the in-process local fallback"),
    ("shadow_denials", "counter", "distlimit_shadow_denials", ("limit",),
     "distlimit.shadow.refusals", "{request}",
     "Requests a shadow limit would have refused, by limit"),
    ("shed_requests", "counter", "distlimit_shed", ("priority", "reason"), None, "",
     "Requests shed with a 503, by priority and reason"),
    ("leased_decisions", "counter", "distlimit_leased_decisions", ("limit",),
     "distlimit.leased.decisions", "{request}",
     "Requests admitted in-process out of a quota lease"),
    ("unreadable_replies", "counter", "distlimit_unreadable_replies", (),
     "distlimit.storage.unreadable", "{reply}",
     "Storage replies the limiter could not read, answered by the failure policy"),
    ("side_call_failures", "counter", "distlimit_side_call_failures", (),
     "distlimit.side_call.failures", "{call}",
     "Calls beside requests (a slot's give-back, a refund, an after-response charge) "
     "that failed and were skipped"),
    ("settled_units", "counter", "distlimit_settled_units", ("limit", "unit"),
     "distlimit.settled.units", "{unit}",
     "Units requests really cost on limits settled after the response, by limit and unit"),
    ("slots", "up_down_counter", None, (), "distlimit.concurrency.slots", "{slot}",
     "Concurrency slots this process holds for requests in flight"),
    ("storage_latency", "histogram", "distlimit_storage_latency_seconds", (),
     "distlimit.storage.duration", "s", "Latency of rate-limit storage calls"),
    ("in_flight", "gauge", "distlimit_worker_in_flight", (), "distlimit.worker.in_flight",
     "{request}", "Requests in flight in this process"),
    ("lease_units", "gauge", "distlimit_lease_units", ("limit",), "distlimit.lease.units",
     "{unit}", "Units this process holds in quota leases, by limit"),
    ("breaker_state", "gauge", "distlimit_breaker_state", ("breaker",),
     "distlimit.breaker.state", "", "Circuit breaker state: 0 closed, 1 half-open, 2 open"),
)  # fmt: skip


def storage_outcome(exc: BaseException | None) -> str:
    """``ok``, ``timeout`` (the call or a connection timed out) or ``error`` for a storage
    call that raised ``exc`` (``None``: it answered)."""
    if exc is None:
        return "ok"
    seen: BaseException | None = exc
    for _ in range(5):  # the StorageError, then what redis-py (or the pool) raised
        if isinstance(seen, TimeoutError) or type(seen).__name__ == "TimeoutError":
            return "timeout"
        seen = getattr(seen, "__cause__", None)  # None past the last cause
    return "error"


def limit_label(key: str) -> str:
    """``ratelimit:{tag}:r_orders_100/60:gcra`` -> ``r_orders_100/60:gcra``; a dynamic limit's
    rate is dropped: ``ratelimit:{tag}:r_x_dyn_100/60:gcra`` -> ``r_x_dyn:gcra``."""
    _, sep, rest = key.partition("}:")
    if not sep:
        return "unknown"
    return _DYNAMIC_RATE.sub("", rest) if "_dyn_" in rest else rest


def _label_of(check: Check) -> str:
    """The ``limit`` label of ``check``: its bound limit's, worked out once; else its key's."""
    return cast(str, check.bound.label) if check.bound is not None else limit_label(check.key)


class Instruments:
    """The instruments of :data:`INSTRUMENTS` as one side (Prometheus, OpenTelemetry) made them,
    in :attr:`made` (only those its side has), and what every sink is told, written
    once: each side only says how it counts on one series (:meth:`_counter`), kept per series."""

    def __init__(self, made: dict[str, Any]) -> None:
        self.made = made
        self._lock = threading.Lock()
        self._counts: dict[tuple[str | None, ...], Count] = {}
        self._labels: set[str] = set()  # the limit label values given out
        #: each gauge's series: its label's value ("" for none) -> its value, or how to read it
        self._gauges: dict[str, dict[str, float | Callable[[], float]]] = {
            attribute: {} for attribute, kind, *_ in INSTRUMENTS if kind == "gauge"
        }

    def _counter(self, family: str, labels: dict[str, str]) -> Count:
        """How this side counts on ``family`` for ``labels`` (``limit`` bounded)."""
        raise NotImplementedError

    def _label(self, label: str) -> str:
        """``label``, or :data:`OTHER` past :data:`MAX_LIMIT_LABELS` distinct values."""
        with self._lock:  # rare: a series' first count (then kept by _count), a lease's top-up
            if label in self._labels or len(self._labels) < MAX_LIMIT_LABELS:
                self._labels.add(label)
                return label
        return OTHER

    def _count(self, family: str, limit: str | None, labels: dict[str, str]) -> Count:
        """The counter of one series, kept (up to :data:`_MAX_CHILDREN`) under the key
        ``(family, limit, *labels.values())``."""
        bounded = labels if limit is None else {"limit": self._label(limit), **labels}
        count = self._counter(family, bounded)
        if len(self._counts) < _MAX_CHILDREN:
            series = (family, limit, *labels.values())
            self._counts[series] = count
        return count

    def _readings(self, gauge: str) -> list[tuple[str, float]]:
        """Each series of ``gauge`` (its label's value) and its value now, as a side reads it."""
        with self._lock:
            series = list(self._gauges[gauge].items())
        return [(label, value() if callable(value) else value) for label, value in series]

    def worker_in_flight(self, value: int) -> None:
        self._gauges["in_flight"][""] = value

    def watch_lease_units(self, key: str, held: Callable[[str], float]) -> None:
        """Report ``held(label)`` as ``lease_units`` of the limit of ``key`` when read."""
        label = self._label(limit_label(key))
        if label != OTHER:
            with self._lock:
                self._gauges["lease_units"].setdefault(label, functools.partial(held, label))

    def breaker_changed(self, breaker: str, state: str) -> None:
        breakers = self._gauges["breaker_state"]
        with self._lock:
            if breaker in breakers or len(breakers) < MAX_BREAKER_LABELS:
                breakers[breaker] = BREAKER_STATE_VALUES.get(state, 2)

    def breaker_removed(self, breaker: str) -> None:
        """Drop the series of a breaker whose node left the topology."""
        with self._lock:
            self._gauges["breaker_state"].pop(breaker, None)

    def add(self, family: str, amount: float = 1, limit: str | None = None, **labels: str) -> None:
        """Count ``amount`` on the instrument ``family``, for the limit labelled ``limit``
        (:func:`limit_label`) and ``labels``."""
        count = self._counts.get((family, limit, *labels.values()))
        (count or self._count(family, limit, labels))(amount)

    def storage_call(self, seconds: float, outcome: str = "ok") -> None:
        """A storage call's latency; ``outcome`` (``ok``, ``timeout``, ``error``) is an
        OpenTelemetry attribute only."""
        self.add("storage_latency", seconds, outcome=outcome)

    def evaluated(
        self,
        checks: Sequence[Check],
        evaluation: Evaluation,
        *,
        seconds: float | None = None,
        fallback: bool = False,
    ) -> None:
        """A storage call's decisions on ``checks`` and, given, its ``seconds`` (as
        :meth:`storage_call`); ``fallback``: the local fallback's decisions. Counted in place,
        without a call per decision."""
        counts = self._counts
        if seconds is not None:
            count = counts.get(("storage_latency", None, "ok"))  # an answered call's series
            (count or self._count("storage_latency", None, {"outcome": "ok"}))(seconds)
        family = "fallback_decisions" if fallback else "decisions"
        for check, decision in zip(checks, evaluation.decisions, strict=False):
            bound = check.bound  # _label_of(check), without a call per decision
            label: str = bound.label if bound is not None else limit_label(check.key)
            outcome = "allowed" if decision.allowed else "denied"
            count = counts.get((family, label, outcome))
            (count or self._count(family, label, {"outcome": outcome}))(1)
            if decision.shadow_denied:
                self.add("shadow_denials", 1, label)

    def degraded(self, checks: Sequence[Check], evaluation: Evaluation | None) -> None:
        """``checks`` the storage did not decide; ``evaluation``, the local fallback's answer."""
        for check in checks:
            self.add("decisions", 1, _label_of(check), outcome="degraded")
        if evaluation is not None:
            self.evaluated(checks, evaluation, fallback=True)

    def slots_held(self, checks: Iterable[Check], change: int) -> None:
        """The concurrency slots of ``checks``, held for a request (``change`` 1) from before
        its storage call until given back or refused (-1)
        (:class:`~flask_distlimit.defences.concurrency.SlotRelease`)."""
        for check in checks:
            self.add("slots", change, _label_of(check))

    def leased(self, keys: Sequence[str]) -> None:
        """Limits (by storage key) a quota lease admitted a request on, in-process."""
        for key in keys:
            label = limit_label(key)
            self.add("decisions", 1, label, outcome="allowed")
            self.add("leased_decisions", 1, label)

    def settled(self, key: str, unit: str, units: int) -> None:
        """``units`` more that requests really cost on the limit of ``key``, settled after the
        response (their bytes, the ``settle`` callable's answer)."""
        self.add("settled_units", units, limit_label(key), unit=unit)

    def shed(self, priority: str, reason: str) -> None:
        """A request shed with a 503 (``reason``: ``worker`` or ``fleet``)."""
        priority = priority if priority in PRIORITIES else "default"
        reason = reason if reason in _REASONS else OTHER
        self.add("shed_requests", priority=priority, reason=reason)

    def unreadable(self) -> None:
        """A storage reply the limiter could not read (the failure policy answered)."""
        self.add("unreadable_replies")

    def side_call_failed(self) -> None:
        """A call beside a request's failed and was skipped (:meth:`Guard.side_failed
        <flask_distlimit.resilience.guard.Guard.side_failed>`)."""
        self.add("side_call_failures")


class Metrics(Instruments):
    """The Prometheus series of the guard, in ``registry`` (default: the global registry)."""

    def __init__(self, registry: Any = None) -> None:
        try:
            import prometheus_client as pc
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ConfigurationError(
                "Prometheus metrics need prometheus-client: "
                "pip install 'Flask-DistLimit[prometheus]'"
            ) from exc
        registry = pc.REGISTRY if registry is None else registry
        make = {"counter": pc.Counter, "histogram": pc.Histogram}
        made = {}
        for attribute, kind, name, labels, _, _, description in INSTRUMENTS:
            extra = {"buckets": LATENCY_BUCKETS} if kind == "histogram" else {}
            if name is not None and kind != "gauge":  # gauges: read when scraped (_Scraped)
                made[attribute] = make[kind](name, description, labels, registry=registry, **extra)
        super().__init__(made)
        registry.register(_Scraped(self))

    def _counter(self, family: str, labels: dict[str, str]) -> Count:
        instrument = self.made.get(family)
        if instrument is None:  # not a Prometheus series (the slots)
            return _uncounted
        if family == "storage_latency":  # its outcome is an OpenTelemetry attribute only
            return cast(Count, instrument.observe)
        return cast(Count, (instrument.labels(**labels) if labels else instrument).inc)


class _Scraped:
    """The gauges of :class:`Metrics`, read when Prometheus scrapes (a custom collector)."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import GaugeMetricFamily

        for attribute, kind, name, labels, _, _, description in INSTRUMENTS:
            if kind == "gauge" and name is not None:
                family = GaugeMetricFamily(name, description, labels=labels)
                for label, value in self._metrics._readings(attribute):
                    family.add_metric([label] if labels else [], value)
                yield family


def _uncounted(amount: float) -> None:
    """The count of an instrument a side does not have."""


#: What a guard (and the shedding, leases and deny-cache paths) tell a metrics sink.
SINK_METHODS: Final = tuple(sorted(n for n in vars(Instruments) if n[0] != "_" and n != "add"))


class Sinks:
    """Tells each of ``sinks`` (Prometheus's, OpenTelemetry's) what one sink is told."""

    def __init__(self, sinks: Sequence[Any]) -> None:
        for name in SINK_METHODS:
            setattr(self, name, functools.partial(_tell_all, [getattr(s, name) for s in sinks]))


def _tell_all(methods: list[Callable[..., None]], *args: Any, **kwargs: Any) -> None:
    for method in methods:
        method(*args, **kwargs)


class OnePer(Generic[_T]):
    """One object made per owner (a registry, a meter provider): instruments are registered
    once per owner, so every app of the process shares them."""

    def __init__(self, make: Callable[[Any], _T]) -> None:
        self._make = make
        self._made: dict[int, tuple[Any, _T]] = {}  # by id(owner): (owner, kept alive, made)
        self._lock = threading.Lock()

    def __call__(self, owner: Any = None) -> _T:
        with self._lock:
            if id(owner) not in self._made:
                self._made[id(owner)] = (owner, self._make(owner))
            return self._made[id(owner)][1]


#: The one :class:`Metrics` of a registry (``metrics_for()``: prometheus_client's global one).
metrics_for: Final = OnePer(Metrics)
