"""Worker-utilization load shedding: a process sheds its least important traffic when its request
threads are nearly all busy, before any limit is counted and without a storage call.

A request of priority p gets a 503 :class:`~flask_distlimit.core.problem.Overloaded` when
``(in flight + 1) / DISTLIMIT_WORKER_THREADS > DISTLIMIT_WORKER_SHED_AT[p]``; it stays in flight
until its ledger ends (:mod:`flask_distlimit.defences.lifecycle`) or its lease passes. Exempt
and filtered requests are never shed nor counted (docs/defences.md, "Worker utilization").
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Final

from flask import current_app, request
from werkzeug.exceptions import HTTPException

from flask_distlimit.core.pacing import Pace
from flask_distlimit.core.priorities import (
    PRIORITIES,
    Priority,
    PriorityRegistry,
    validate_priority,
)
from flask_distlimit.core.problem import Overloaded
from flask_distlimit.declare.dynamic_limits import log_text
from flask_distlimit.errors import ConfigurationError

if TYPE_CHECKING:
    from flask_distlimit.defences.lifecycle import Lifecycle
    from flask_distlimit.telemetry.metrics import Metrics

log = logging.getLogger("flask_distlimit")

#: Utilization above which each priority is shed (no entry: never shed).
DEFAULT_SHED_AT: Final[dict[Priority, float]] = {"sheddable": 0.5, "default": 0.75}
#: The share of ``DISTLIMIT_FLEET_CAPACITY`` each priority may use
#: (:mod:`flask_distlimit.defences.fleet`).
DEFAULT_SHARES: Final[dict[Priority, float]] = {"critical": 1.0, "default": 0.8, "sheddable": 0.6}


def _fractions(
    key: str, value: object, what: str, *, every_priority: bool = False
) -> dict[Priority, float]:
    """A priority -> fraction table: each in (0, 1], a less important priority never above a
    more important one; with ``every_priority``, each priority named."""
    if not isinstance(value, Mapping):
        raise ConfigurationError(
            f"{key}={value!r} is not valid: use a dict of priority -> {what}, e.g. "
            "{'sheddable': 0.5, 'default': 0.75}."
        )
    out: dict[Priority, float] = {}
    for name, share in value.items():
        priority = validate_priority(name, f"a key of {key}")
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ConfigurationError(
                f"{key}[{name!r}]={share!r} is not valid: use a number > 0 and <= 1 ({what})."
            )
        out[priority] = float(share)
    missing = [p for p in PRIORITIES if p not in out] if every_priority else []
    if missing:
        raise ConfigurationError(
            f"{key} has no share for {', '.join(missing)}: give every priority one, e.g. "
            "{'critical': 1.0, 'default': 0.8, 'sheddable': 0.6}."
        )
    ordered = [out.get(p, 2.0) for p in PRIORITIES]  # critical first; none: never shed
    if any(a < b for a, b in itertools.pairwise(ordered)):
        raise ConfigurationError(
            f"{key}={out!r}: a less important priority must not get more than a more "
            "important one (critical >= default >= sheddable)."
        )
    return out


def parse_shed_at(key: str, value: object) -> dict[Priority, float]:
    """``DISTLIMIT_WORKER_SHED_AT``: a less important priority must not be shed later than a
    more important one."""
    return _fractions(key, value, "the utilization above which it is shed")


def parse_shares(key: str, value: object) -> dict[Priority, float]:
    """``DISTLIMIT_FLEET_SHARES``: every priority needs a share; less important, no larger."""
    return _fractions(
        key, value, "the share of the fleet's capacity it may use", every_priority=True
    )


class WorkerLoad:
    """This process's requests in flight against its threads (see the module docstring).

    Each request admitted holds a *place* until its ledger ends
    (:mod:`flask_distlimit.defences.lifecycle`), with a deadline (``hold_us`` after it was taken or
    last renewed): a place whose deadline has passed (a thread killed mid-request, a bug that lost
    the end) is dropped before a request would be shed, never held for ever."""

    def __init__(
        self,
        threads: int,
        shed_at: Mapping[Priority, float],
        metrics: Callable[[], Metrics | None],
        *,
        clock: Callable[[], int],
        hold_us: int,
    ) -> None:
        self.threads = threads
        #: the most requests in flight (this one included) a priority is admitted up to
        self._room: dict[Priority, float] = {
            p: shed_at[p] * threads if p in shed_at else float("inf") for p in PRIORITIES
        }
        self._metrics = metrics
        self._clock = clock
        self._hold = hold_us
        self.after_fork()

    @property
    def in_flight(self) -> int:
        return len(self._places)

    def enter(self, priority: Priority) -> Place | None:
        """Count a request in (its place), or answer None (shed it: not counted)."""
        now = self._clock()
        places = self._places
        with self._lock:
            room = self._room[priority]
            if len(places) + 1 > room:
                for gone in [p for p, deadline in places.items() if deadline <= now]:
                    del places[gone]
            place: Place | None = None
            if len(places) + 1 <= room:
                place = Place(self)
                places[place] = now + self._hold
            in_flight = len(places)
        metrics = self._metrics()
        if metrics is not None:
            metrics.worker_in_flight(in_flight)
            if place is None:
                metrics.shed(priority, "worker")
        return place

    def leave(self, place: Place) -> None:
        with self._lock:
            self._places.pop(place, None)
            in_flight = len(self._places)
        metrics = self._metrics()
        if metrics is not None:
            metrics.worker_in_flight(in_flight)

    def renew(self, place: Place) -> None:
        deadline = self._clock() + self._hold
        with self._lock:
            if place in self._places:
                self._places[place] = deadline

    def health(self) -> dict[str, object]:
        """This process's load, for the health report: in flight, threads, utilization."""
        return {
            "in_flight": self.in_flight,
            "threads": self.threads,
            "utilization": round(self.in_flight / self.threads, 4),
        }

    def after_fork(self) -> None:
        """None in flight: when made, and in a forked child (it serves its own requests)."""
        self._lock = threading.Lock()
        #: place -> its deadline (us, ``clock``)
        self._places: dict[Place, int] = {}


class Place:
    """One request's place among its process's requests in flight: a holding of its ledger."""

    __slots__ = ("_load",)

    def __init__(self, load: WorkerLoad) -> None:
        self._load = load

    def release(self) -> None:
        self._load.leave(self)

    def renew(self) -> None:
        self._load.renew(self)


class Shedding:
    """One app's shedding hooks: the request's priority, and this process's load."""

    def __init__(
        self, priorities: PriorityRegistry, load: WorkerLoad | None, lifecycle: Lifecycle
    ) -> None:
        self.priorities = priorities
        self.load = load
        self._lifecycle = lifecycle
        self._key = f"flask_distlimit.priority.{id(self):x}"
        self._admitted = f"flask_distlimit.admitted.{id(self):x}"
        self._pace = Pace(60.0)  #: the ERROR lines of a failing resolver (monotonic seconds)

    def priority(self) -> Priority:
        """The current request's priority (computed once per request)."""
        environ = request.environ
        found: Priority | None = environ.get(self._key)
        if found is None:
            endpoint = request.endpoint
            view = current_app.view_functions.get(endpoint) if endpoint is not None else None
            try:
                found = self.priorities.of_request(view)
            except HTTPException:  # the app's own answer (an abort(401))
                raise
            except Exception as exc:  # the app's code: never a 500
                found = "default"
                if self._pace.due(time.monotonic()) is not None:
                    log.error(
                        "The priority resolver failed (%s: %s); the request is of priority "
                        "default. (Logged at most once a minute.)",
                        type(exc).__name__, log_text(exc),
                    )  # fmt: skip
            environ[self._key] = found
        return found

    def shed_here(self, environ: dict[str, object]) -> bool:
        """Whether this process shed the request of ``environ`` (:meth:`admit`): its 503 is
        charged to no limit, the global ones included."""
        return environ.get(self._admitted) is False

    def known_before_hooks(self, view: object | None) -> bool:
        """Whether the request's priority can be known before the app's ``before_request``
        hooks run (it cannot when the Limiter-wide resolver decides it: the resolver may read
        what the hooks set, e.g. the authenticated user)."""
        return self.priorities.resolver is None or self.priorities.of_view(view) is not None

    def admit(self) -> None:
        """Count the current request into this process's load, or shed it (503
        :class:`~flask_distlimit.core.problem.Overloaded`); once per request, a no-op when worker
        shedding is off. The caller has checked that the request is not exempt."""
        load = self.load
        if load is None:
            return
        environ = request.environ
        if self._admitted in environ:
            return
        environ[self._admitted] = True
        priority = self.priority()
        place = load.enter(priority)
        if place is None:
            environ[self._admitted] = False  # shed: charged to no limit (shed_here)
            raise Overloaded(priority=priority, instance=request.path, reason="worker")
        # counted out when the response ends, however it ends (flask_distlimit.defences.lifecycle)
        self._lifecycle.ledger(environ).take(place)
