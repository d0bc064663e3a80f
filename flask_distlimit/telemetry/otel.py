"""OpenTelemetry metrics (the ``otel`` extra): the instruments of the one table
(:data:`~.metrics.INSTRUMENTS`), and one count per request, through the OpenTelemetry API only.

When ``opentelemetry-api`` is importable, every app's limiter records into the global
``MeterProvider`` (through the API's proxy: a provider set later is used from then on);
:func:`instrument` passes another one. Without the package nothing is imported and nothing runs.
The instruments of one provider are made once and shared by every app; the guard tells them
beside the Prometheus metrics (:meth:`~flask_distlimit.resilience.guard.Guard.add_sink`), and
:func:`request`, called by the request's WSGI wrapper, counts each request's result once, however
its response was made (an app's ``after_request`` hook that raised too). The instruments and their
attributes: docs/failure-modes.md, "Observability".
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable, Iterable
from typing import Any, Final, Protocol

from flask_distlimit.core.problem import PROBLEM_MEDIA_TYPE
from flask_distlimit.telemetry.metrics import INSTRUMENTS, LATENCY_BUCKETS, Instruments, OnePer

log = logging.getLogger("flask_distlimit")


class OTelMetrics(Instruments):
    """The instruments of one ``MeterProvider`` (default: the global one); a metrics sink."""

    def __init__(self, meter_provider: Any = None) -> None:
        from opentelemetry.metrics import Observation, get_meter_provider

        self.meter = meter = (meter_provider or get_meter_provider()).get_meter("flask_distlimit")
        self._observation = Observation
        super().__init__({})  # the gauges' state first: a callback may run at once
        for attribute, kind, _, _, name, unit, description in INSTRUMENTS:
            advisory: dict[str, Any] = {"unit": unit, "description": description}
            if kind == "histogram":
                advisory["explicit_bucket_boundaries_advisory"] = list(LATENCY_BUCKETS)
            if kind == "gauge":
                kind = "observable_gauge"
                advisory["callbacks"] = [functools.partial(self._observe, attribute)]
            if name is not None:  # shed requests: counted among the requests (_counter)
                self.made[attribute] = getattr(meter, f"create_{kind}")(name, **advisory)

    def _observe(self, gauge: str, _options: Any) -> Iterable[Any]:
        """The observable gauge ``gauge``, read (the breaker's label is ``distlimit.node``)."""
        name = "distlimit.node" if gauge == "breaker_state" else "distlimit.limit"
        return [self._observation(v, {name: n} if n else {}) for n, v in self._readings(gauge)]

    def _counter(self, family: str, labels: dict[str, str]) -> Callable[[float], object]:
        attributes: dict[str, str | bool] = {f"distlimit.{k}": v for k, v in labels.items()}
        if family == "shed_requests":  # a request, counted by its result (INSTRUMENTS)
            family = "requests"
            attributes.update({"distlimit.result": "shed", "distlimit.degraded": False})
            attributes["distlimit.shed.reason"] = attributes.pop("distlimit.reason")
        instrument = self.made[family]
        count = instrument.record if family == "storage_latency" else instrument.add
        return functools.partial(count, attributes=attributes)


class Guard(Protocol):
    """What the hook needs of a :class:`~flask_distlimit.resilience.guard.Guard` (its metrics
    sink)."""

    def add_sink(self, sink: Any) -> None: ...

    def remove_sink(self, sink: Any) -> None: ...


class OTelHook:
    """One app's link to the instruments: keeps them in ``guard``'s metrics sinks beside
    whatever Prometheus :class:`~flask_distlimit.telemetry.metrics.Metrics` the app sets, from
    when a provider reads them (a request ending finds out: :meth:`wake`) until :meth:`detach`."""

    def __init__(self, guard: Guard, instruments: OTelMetrics) -> None:
        self.guard = guard
        self.instruments = instruments
        self.told: bool | None = False  # whether the guard tells them (None: detached)
        self.wake()

    def wake(self) -> bool:
        """Whether the instruments are told, after adding them to the guard's sinks if a
        provider reads them now: not while the API's proxy meter has none behind it (its
        ``_real_meter``; any other meter lacks it), which drops every count at a cost to each
        request as high as the rest of the telemetry's."""
        if self.told is False and getattr(self.instruments.meter, "_real_meter", 1) is not None:
            self.guard.add_sink(self.instruments)
            self.told = True
        return bool(self.told)

    def detach(self) -> None:
        """Take the instruments out of the guard's sinks for good (the Prometheus metrics
        stay), and count no more requests."""
        self.guard.remove_sink(self.instruments)
        self.told = None


def request(state: _Instrumented, environ: dict[str, Any], raised: bool) -> None:
    """Count the request whose response the app has just made, once (called by the request's
    WSGI wrapper, bound to ``state``): by the response ``after_request`` kept on its data, or a
    server error when the app raised, or answered without our ``after_request`` seeing it (an
    app's hook that raised)."""
    hook = state.otel
    if hook is None or not (hook.told or hook.wake()):
        return
    data = environ.get(state.enforcer.environ_key)
    if data is None or data.exempt:
        return  # no limit applied, or exempt: nothing was decided
    if not (data.evaluated or data.report or data.denied or data.degraded):
        return
    response: Any = None if raised else data.response
    status = 500 if response is None else response.status_code
    if status == 503 and not data.degraded and response.mimetype == PROBLEM_MEDIA_TYPE:
        # Shed (by the fleet, or by this worker, before any limit counted it); counted by
        # the sink's shed(), not twice.
        return
    result = "admitted"
    policy: str | None = None if data.report is None else data.report.name
    if data.denied:
        refused = _refused(data)
        if status == 503 or (data.degraded and data.report is None and refused is None):
            result, policy = "unavailable", None  # (or the app's own answer to that 503)
        else:
            result, policy = "refused", refused or policy
    attributes: dict[str, str | bool] = {
        "distlimit.result": result,
        "distlimit.degraded": bool(data.degraded),
    }
    if policy is not None:
        attributes["distlimit.policy"] = policy
    try:
        hook.instruments.made["requests"].add(1, attributes)
    except Exception:  # never a 500, nor a body the WSGI wrapper does not get to hand on
        log.exception("OpenTelemetry failed to count a request; it is not counted.")


def _refused(data: Any) -> str | None:
    """The declared name of the first limit a storage call of the request refused."""
    for one in data.evaluated:
        for c, d in zip(one.checks, one.decisions, strict=True):
            if not d.allowed and not c.shadow:
                return str(c.bound.name)
    return None


_instruments_for: Final = OnePer(OTelMetrics)


class _Instrumented(Protocol):
    """What :func:`instrument` needs of a :class:`~flask_distlimit.state.LimiterState`."""

    @property
    def guard(self) -> Guard: ...

    @property
    def enforcer(self) -> Any: ...  #: its ``environ_key``: where a request's data is kept

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
    state.otel = hook = OTelHook(state.guard, instruments)
    return hook


def auto(state: _Instrumented) -> OTelHook | None:
    """The hook of the global provider when the OpenTelemetry API is installed, else None.

    An API too old for these instruments (or broken) never stops the app from starting: one
    WARNING says how to fix it, and the limiter runs without OpenTelemetry metrics."""
    try:  # whether the API is installed, importing nothing to tell
        if importlib.util.find_spec("opentelemetry.metrics") is None:
            return None
    except (ImportError, ValueError):  # its parent package is absent (or broken)
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
