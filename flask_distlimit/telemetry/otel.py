"""OpenTelemetry metrics (the ``otel`` extra): the Prometheus series' twins, and one count per
request, through the OpenTelemetry API only.

Nothing to configure: when ``opentelemetry-api`` is importable, every app's limiter records into
the global ``MeterProvider`` (through the API's proxy, so a provider set after ``init_app``
is used from then on); :func:`instrument` passes another provider. Without the package nothing
is imported and nothing runs. Instruments (meter ``flask_distlimit``):

- ``distlimit.requests`` (counter, ``{request}``): one per request the limiter decided, with
  ``distlimit.result`` = ``admitted`` | ``refused`` (429) | ``unavailable`` (503 of the
  ``closed`` failure policy) | ``shed`` (503 of load shedding, with ``distlimit.shed.reason``
  ``worker`` | ``fleet`` and ``distlimit.priority``), ``distlimit.degraded`` (the storage was
  down and the failure policy answered) and ``distlimit.policy``: the declared name of the
  policy that decided it (the refused one; for an admitted request the one closest to denial,
  as the ``RateLimit`` header reports it), never a client's value; absent when none did;
- ``distlimit.decisions`` (counter, ``{decision}``): per limit of each storage call,
  ``distlimit.limit`` (the limit's id and algorithm: ``limit_label``) and ``distlimit.outcome``
  = ``allowed`` | ``denied`` | ``degraded``;
- ``distlimit.fallback.decisions`` (counter): the local fallback's, ``allowed`` | ``denied``;
- ``distlimit.leased.decisions`` (counter): admitted in-process out of a quota lease;
- ``distlimit.shadow.refusals`` (counter, ``{request}``): would-be refusals of shadow limits;
- ``distlimit.storage.duration`` (histogram, ``s``): each storage call, ``distlimit.outcome`` =
  ``ok`` | ``timeout`` | ``error``;
- ``distlimit.storage.unreadable`` (counter): replies the limiter could not read;
- ``distlimit.settled.units`` (counter, ``{unit}``): what requests really cost on limits settled
  after the response, per ``distlimit.limit`` and ``distlimit.unit`` (``requests`` |
  ``content-bytes``);
- ``distlimit.breaker.state`` (observable gauge): 0 closed, 1 half-open, 2 open, per
  ``distlimit.node`` (a breaker's name, as in the logs); a node that left the topology goes;
- ``distlimit.concurrency.slots`` (up-down counter, ``{slot}``): concurrency slots this process
  holds for requests in flight, per ``distlimit.limit`` (taken when the storage admits, given
  back with the request's other holdings, by its ledger: when the server has sent the body);
- ``distlimit.worker.in_flight`` (observable gauge, ``{request}``), ``distlimit.lease.units``
  (observable gauge, ``{unit}``, per ``distlimit.limit``).

How it is hooked: the guard's metrics sink (:mod:`flask_distlimit.telemetry.metrics`' interface)
becomes a fan-out to the Prometheus :class:`~flask_distlimit.telemetry.metrics.Metrics` (when set)
and these instruments, and ``after_request`` tells :meth:`OTelHook.request` each request's result.
The instruments of one provider are made once and shared by every app (as Prometheus series are).
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol, cast

import flask

from flask_distlimit.core.decision import Check, Evaluation
from flask_distlimit.telemetry.metrics import (
    BREAKER_STATE_VALUES,
    LATENCY_BUCKETS,
    Metrics,
    OnePer,
    limit_label,
)

if TYPE_CHECKING:
    from werkzeug.wrappers import Response

__all__ = ["OTelHook", "OTelMetrics", "available", "instrument", "storage_outcome"]

#: The methods the guard (and the shedding, leases and deny-cache paths) call on its metrics.
SINK_METHODS = (
    "breaker_changed",
    "breaker_removed",
    "degraded",
    "evaluated",
    "leased",
    "settled",
    "shadow_would_deny",
    "shed",
    "side_call_failed",
    "storage_call",
    "unreadable",
    "watch_lease_units",
    "worker_in_flight",
)


log = logging.getLogger("flask_distlimit")

_PROBLEM = "application/problem+json"


def available() -> bool:
    """Whether the OpenTelemetry API is installed (nothing is imported to tell)."""
    try:
        return importlib.util.find_spec("opentelemetry.metrics") is not None
    except (ImportError, ValueError):
        return False


def storage_outcome(exc: BaseException | None) -> str:
    """``ok``, ``timeout`` (the call or a connection timed out) or ``error`` for a storage
    call that raised ``exc`` (``None``: it answered)."""
    if exc is None:
        return "ok"
    seen: BaseException | None = exc
    for _ in range(5):  # the StorageError, then what redis-py (or the pool) raised
        if seen is None:
            break
        if isinstance(seen, TimeoutError) or type(seen).__name__ == "TimeoutError":
            return "timeout"
        seen = seen.__cause__
    return "error"


#: The instruments an :class:`OTelMetrics` records into: attribute, kind, name, unit, description.
_INSTRUMENTS: Final = (
    ("requests", "counter", "distlimit.requests", "{request}",
     "Requests the rate limiter decided, by result"),
    ("decisions", "counter", "distlimit.decisions", "{decision}",
     "Rate-limit decisions by limit and outcome"),
    ("fallback_decisions", "counter", "distlimit.fallback.decisions", "{decision}",
     "Decisions of the in-process local fallback"),
    ("leased_decisions", "counter", "distlimit.leased.decisions", "{request}",
     "Requests admitted in-process out of a quota lease"),
    ("shadow_refusals", "counter", "distlimit.shadow.refusals", "{request}",
     "Requests a shadow limit would have refused, by limit"),
    ("storage_duration", "histogram", "distlimit.storage.duration", "s",
     "Duration of rate-limit storage calls"),
    ("unreadable_replies", "counter", "distlimit.storage.unreadable", "{reply}",
     "Storage replies the limiter could not read (the policy answered)"),
    ("side_call_failures", "counter", "distlimit.side_call.failures", "{call}",
     "Calls beside a request's that failed and were skipped"),
    ("slots", "up_down_counter", "distlimit.concurrency.slots", "{slot}",
     "Concurrency slots this process holds for requests in flight"),
    ("settled_units", "counter", "distlimit.settled.units", "{unit}",
     "Units requests really cost on limits settled after the response, by limit and unit"),
)  # fmt: skip


class OTelMetrics:
    """The instruments of one ``MeterProvider`` (default: the global one); a metrics sink."""

    requests: Any
    decisions: Any
    fallback_decisions: Any
    leased_decisions: Any
    shadow_refusals: Any
    storage_duration: Any
    unreadable_replies: Any
    side_call_failures: Any
    slots: Any
    settled_units: Any

    def __init__(self, meter_provider: Any = None) -> None:
        from opentelemetry.metrics import Observation, get_meter_provider

        provider = meter_provider or get_meter_provider()
        meter = provider.get_meter("flask_distlimit")
        for attribute, kind, name, unit, description in _INSTRUMENTS:
            create = getattr(meter, f"create_{kind}")
            advisory = (
                {"explicit_bucket_boundaries_advisory": list(LATENCY_BUCKETS)}
                if kind == "histogram"
                else {}
            )
            setattr(self, attribute, create(name, unit=unit, description=description, **advisory))
        self._lock = threading.Lock()
        self._breakers: dict[str, int] = {}
        self._in_flight: int | None = None
        self._lease_units: dict[str, Callable[[str], float]] = {}
        observation = Observation
        self._observation = observation
        meter.create_observable_gauge(
            "distlimit.breaker.state", callbacks=[self._observe_breakers],
            description="Circuit breaker state per storage node: 0 closed, 1 half-open, 2 open",
        )  # fmt: skip
        meter.create_observable_gauge(
            "distlimit.worker.in_flight", callbacks=[self._observe_in_flight], unit="{request}",
            description="Requests in flight in this process (worker shedding on)",
        )  # fmt: skip
        meter.create_observable_gauge(
            "distlimit.lease.units", callbacks=[self._observe_lease_units], unit="{unit}",
            description="Units this process holds in quota leases, by limit",
        )  # fmt: skip

    # -- observable gauges -------------------------------------------------------------------

    def _observe_breakers(self, _options: Any) -> Iterable[Any]:
        with self._lock:
            states = list(self._breakers.items())
        return [self._observation(v, {"distlimit.node": n}) for n, v in states]

    def _observe_in_flight(self, _options: Any) -> Iterable[Any]:
        value = self._in_flight
        return [] if value is None else [self._observation(value)]

    def _observe_lease_units(self, _options: Any) -> Iterable[Any]:
        with self._lock:
            held = list(self._lease_units.items())
        return [self._observation(f(label), {"distlimit.limit": label}) for label, f in held]

    # -- the metrics sink (what flask_distlimit.telemetry.metrics.Metrics is told)
    # -------------------------

    def storage_call(self, seconds: float, outcome: str = "ok") -> None:
        self.storage_duration.record(seconds, {"distlimit.outcome": outcome})

    def _decided(self, fallback: bool, checks: Sequence[Check], evaluation: Evaluation) -> None:
        counter = self.fallback_decisions if fallback else self.decisions
        for check, decision in zip(checks, evaluation.decisions, strict=False):
            label = limit_label(check.key)
            outcome = "allowed" if decision.allowed else "denied"
            counter.add(1, {"distlimit.limit": label, "distlimit.outcome": outcome})
            if decision.shadow_denied:
                self.shadow_refusals.add(1, {"distlimit.limit": label})
        if evaluation.allowed:
            self.slots_taken(checks, 1)

    def evaluated(self, checks: Sequence[Check], evaluation: Evaluation) -> None:
        self._decided(False, checks, evaluation)

    def degraded(self, checks: Sequence[Check], evaluation: Evaluation | None) -> None:
        for check in checks:
            self.decisions.add(
                1, {"distlimit.limit": limit_label(check.key), "distlimit.outcome": "degraded"}
            )
        if evaluation is not None:
            self._decided(True, checks, evaluation)

    def slots_taken(self, checks: Iterable[Check], sign: int) -> None:
        """Count the concurrency slots of ``checks`` taken (``sign`` 1) or given back (-1)."""
        for check in checks:
            if check.token and not check.release and not check.shadow:
                self.slots.add(sign, {"distlimit.limit": limit_label(check.key)})

    def settled(self, key: str, unit: str, units: int) -> None:
        self.settled_units.add(units, {"distlimit.limit": limit_label(key), "distlimit.unit": unit})

    def shadow_would_deny(self, keys: Sequence[str]) -> None:
        for key in keys:
            self.shadow_refusals.add(1, {"distlimit.limit": limit_label(key)})

    def leased(self, keys: Sequence[str]) -> None:
        for key in keys:
            label = limit_label(key)
            self.decisions.add(1, {"distlimit.limit": label, "distlimit.outcome": "allowed"})
            self.leased_decisions.add(1, {"distlimit.limit": label})

    def watch_lease_units(self, key: str, held: Callable[[str], float]) -> None:
        with self._lock:
            self._lease_units.setdefault(limit_label(key), held)

    def shed(self, priority: str, reason: str) -> None:
        self.requests.add(
            1,
            {
                "distlimit.result": "shed",
                "distlimit.degraded": False,
                "distlimit.shed.reason": reason,
                "distlimit.priority": priority,
            },
        )

    def worker_in_flight(self, value: int) -> None:
        self._in_flight = value

    def unreadable(self) -> None:
        self.unreadable_replies.add(1)

    def side_call_failed(self) -> None:
        self.side_call_failures.add(1)

    def breaker_changed(self, breaker: str, state: str) -> None:
        with self._lock:
            self._breakers[breaker] = BREAKER_STATE_VALUES.get(state, 2)

    def breaker_removed(self, breaker: str) -> None:
        with self._lock:
            self._breakers.pop(breaker, None)


class _Fanout:
    """A metrics sink that tells each of ``sinks`` (Prometheus's and OpenTelemetry's)."""

    def __init__(self, *sinks: Any) -> None:
        self.sinks = sinks
        for name in SINK_METHODS:
            setattr(self, name, _tell_all([getattr(s, name) for s in sinks]))


def _tell_all(methods: list[Callable[..., None]]) -> Callable[..., None]:
    def tell(*args: Any) -> None:
        for m in methods:
            m(*args)

    return tell


class Guard(Protocol):
    """What the hook needs of a :class:`~flask_distlimit.resilience.guard.Guard` (its metrics
    sink)."""

    @property
    def metrics(self) -> Metrics | None: ...

    compose_metrics: Callable[[Metrics | None], Metrics | None] | None

    def use_metrics(self, metrics: Metrics | None) -> None: ...


class Ledgers(Protocol):
    """What the hook needs of the app's :class:`~flask_distlimit.defences.lifecycle.Lifecycle`:
    a request's ledger, which holds the slot gauge's give-back with the slots themselves."""

    def ledger(self, environ: Any) -> Any: ...


class _SlotsGiven:
    """A holding of the request's ledger: the slot gauge goes down when the slots are given
    back, whatever the response (a ``send_file`` one never reaches its ``close()``)."""

    __slots__ = ("_checks", "_instruments")

    def __init__(self, instruments: OTelMetrics, checks: list[Check]) -> None:
        self._instruments = instruments
        self._checks = checks

    def release(self) -> None:
        self._instruments.slots_taken(self._checks, -1)

    def renew(self) -> None:
        pass


class OTelHook:
    """One app's link to the instruments: keeps them in ``guard``'s metrics sink beside
    whatever Prometheus :class:`~flask_distlimit.telemetry.metrics.Metrics` the app sets (before or
    after: the guard composes what ``use_metrics`` is handed through :meth:`compose`), and
    counts each request in ``after_request``."""

    def __init__(self, guard: Guard, instruments: OTelMetrics, ledgers: Ledgers) -> None:
        self.guard = guard
        self.instruments = instruments
        self._ledgers = ledgers
        guard.compose_metrics = self.compose
        guard.use_metrics(_others(guard.metrics, instruments))

    def compose(self, metrics: Metrics | None) -> Metrics | None:
        """The sink to keep when ``metrics`` is set: it and the instruments."""
        others = _others(metrics, self.instruments)
        sink: Any = self.instruments if others is None else _Fanout(others, self.instruments)
        # The guard's attribute is typed with the Prometheus class; the fan-out and the
        # instruments answer every method it calls (SINK_METHODS; tests/telemetry/test_otel.py
        # checks).
        return cast(Metrics, sink)

    def detach(self) -> None:
        """Take the instruments out of the guard's sink (the Prometheus metrics stay)."""
        guard = self.guard
        if guard.compose_metrics == self.compose:
            guard.compose_metrics = None
        guard.use_metrics(_others(guard.metrics, self.instruments))

    def request(self, data: Any, response: Response) -> None:
        """Count one request the limiter decided (``data``: the enforcer's request data)."""
        if data.exempt or not (data.evaluated or data.report or data.denied or data.degraded):
            return  # exempt, or no limit applied: nothing was decided
        instruments = self.instruments
        if data.slots is not None:  # given back with the slots, by the request's ledger
            taken = [c for one in data.evaluated if _allowed(one) for c in one.checks]
            if taken:
                ledger = self._ledgers.ledger(flask.request.environ)
                ledger.take(_SlotsGiven(instruments, taken))
        status = response.status_code
        report = data.report
        policy: str | None = report.name if report is not None else None
        if status == 503 and not data.degraded and response.mimetype == _PROBLEM:
            # Shed (by the fleet, or by this worker, before any limit counted it); counted by
            # the sink's shed(), not twice.
            return
        if not data.denied:
            result = "admitted"
        elif status == 503 or (data.degraded and report is None and _refused(data) is None):
            result, policy = "unavailable", None  # (or the app's own answer to that 503)
        else:
            result = "refused"
            policy = _refused(data) or policy
        attributes: dict[str, str | bool] = {
            "distlimit.result": result,
            "distlimit.degraded": bool(data.degraded),
        }
        if policy is not None:
            attributes["distlimit.policy"] = policy
        instruments.requests.add(1, attributes)


def _others(sink: Any, instruments: OTelMetrics) -> Metrics | None:
    """``sink`` without ``instruments`` (a fan-out's other sinks; None when nothing is left)."""
    if sink is instruments or sink is None:
        return None
    if isinstance(sink, _Fanout):
        rest = [s for s in sink.sinks if s is not instruments]
        if not rest:
            return None
        return cast(Metrics, rest[0] if len(rest) == 1 else _Fanout(*rest))
    return cast(Metrics, sink)


def _allowed(one: Any) -> bool:
    return all(d.allowed for d in one.decisions)


def _refused(data: Any) -> str | None:
    """The declared name of the first limit a storage call of the request refused."""
    for one in data.evaluated:
        for c, b, d in zip(one.checks, one.bounds, one.decisions, strict=True):
            if not d.allowed and not c.shadow:
                return str(b.name)
    return None


_instruments_for: Final = OnePer(OTelMetrics)


class _Instrumented(Protocol):
    """What :func:`instrument` needs of a :class:`~flask_distlimit.state.LimiterState`."""

    @property
    def guard(self) -> Guard: ...

    @property
    def lifecycle(self) -> Ledgers: ...

    otel: OTelHook | None


def instrument(state: _Instrumented, meter_provider: Any = None) -> OTelHook:
    """Record the metrics of ``state`` (``limiter.state(app)``) with ``meter_provider``
    (default: the global one), e.g. ``otel.instrument(limiter.state(app), meter_provider=mp)``;
    answers the hook, kept as ``state.otel``. The extension calls it with the global provider
    at ``init_app`` when the API is installed."""
    instruments = _instruments_for(meter_provider)
    previous = state.otel
    if previous is not None:
        if previous.instruments is instruments:
            return previous
        previous.detach()
    hook = OTelHook(state.guard, instruments, state.lifecycle)
    state.otel = hook
    return hook


def auto(state: _Instrumented) -> OTelHook | None:
    """The hook of the global provider when the OpenTelemetry API is installed, else None.

    An API too old for these instruments (or broken) never stops the app from starting: one
    WARNING says how to fix it, and the limiter runs without OpenTelemetry metrics."""
    if not available():
        return None
    try:
        return instrument(state)
    except (ImportError, AttributeError, TypeError) as exc:
        log.warning(
            "OpenTelemetry metrics are off: the installed opentelemetry-api cannot make the "
            "limiter's instruments (%s: %s). Install a recent one: pip install "
            "'Flask-DistLimit[otel]' (opentelemetry-api>=1.45), or uninstall it.",
            type(exc).__name__, exc,
        )  # fmt: skip
        return None
