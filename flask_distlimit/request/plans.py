"""The plan cache: a route's limits, bound once per endpoint and method.

:class:`Plans` binds a route's declarations into a
:class:`~flask_distlimit.declare.route_limits.RoutePlan` the first time a request reaches it, and
a limit wrapper the plan did not reach the first time that wrapper runs. Static-file endpoints
are never limited. Every limit bound here is declared to the quota leases.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from flask import Flask, current_app

from flask_distlimit.core.algorithms import Algorithm
from flask_distlimit.declare.registry import LimitRegistry
from flask_distlimit.declare.route_limits import BoundLimit, RoutePlan, bind, build_plan, distinct
from flask_distlimit.declare.specs import LimitSpec
from flask_distlimit.resilience.leases import Leases


def is_static(endpoint: str) -> bool:
    """Flask's static-file endpoints: never limited."""
    return endpoint == "static" or endpoint.endswith(".static")


def _blueprints_of(app: Flask, endpoint: str) -> list[object]:
    """The blueprint objects ``endpoint`` is registered through, innermost first (the objects
    behind ``request.blueprints``, whatever names they were registered under)."""
    found: list[object] = []
    name = endpoint.rpartition(".")[0]
    while name:
        bp = app.blueprints.get(name)
        if bp is not None:
            found.append(bp)
        name = name.rpartition(".")[0]
    return found


@dataclass(slots=True, kw_only=True)
class Plans:
    """The bound limits of one app's routes and limit wrappers (see the module docstring)."""

    registry: LimitRegistry
    default_specs: tuple[LimitSpec, ...]  #: DISTLIMIT_DEFAULT_LIMITS
    leases: Leases  #: told every bound limit (flask_distlimit.resilience.leases)
    prefix: str
    algorithm: Algorithm  #: the app's default
    shadow: bool  #: every limit is a shadow limit (``DISTLIMIT_SHADOW = True``)
    #: the plans bound so far, by (endpoint, method)
    routes: dict[tuple[str | None, str], RoutePlan] = field(default_factory=dict, init=False)
    _carried: dict[tuple[object, str | None, str | None], tuple[BoundLimit, ...]] = field(
        default_factory=dict, init=False
    )
    #: the app's view functions as registered, by endpoint; None until the first request
    views: dict[str, object] | None = field(default=None, init=False)
    #: some bound limit has ``lease=`` (flask_distlimit.resilience.leases)
    leasing: bool = field(default=False, init=False)

    def original_view(self, endpoint: str) -> object | None:
        """The view function registered for ``endpoint``, before the gate wrapped it."""
        views = current_app.view_functions if self.views is None else self.views
        return views.get(endpoint)

    def plan(self, endpoint: str, method: str) -> RoutePlan:
        """The route's limits for ``endpoint`` and ``method``, bound once."""
        plan = self.routes.get((endpoint, method))
        if plan is not None:
            return plan
        if is_static(endpoint):
            plan = RoutePlan(exempt=True)
        else:
            plan = build_plan(
                self.registry,
                endpoint=endpoint,
                view=self.original_view(endpoint),
                blueprints=_blueprints_of(current_app, endpoint),
                method=method,
                # DISTLIMIT_DEFAULT_LIMITS, then limits declared on the app itself
                default_limits=(
                    *self.default_specs,
                    *self.registry.blueprints.get(current_app, ()),
                ),
                prefix=self.prefix,
                default_algorithm=self.algorithm,
                shadow=self.shadow,
            )
        self.leasing |= self.leases.declare(plan.limits)
        self.routes[(endpoint, method)] = plan
        return plan

    def carried(
        self, carrier: object, specs: Sequence[Any], endpoint: str | None, method: str | None
    ) -> tuple[BoundLimit, ...]:
        """The limits ``specs`` of the limit wrapper ``carrier``, bound once per endpoint and
        method."""
        bounds = self._carried.get((carrier, endpoint, method))
        if bounds is not None:
            return bounds
        label = endpoint or str(getattr(carrier, "__qualname__", "view"))
        bounds = self.bind_now(specs, label, method)
        self._carried[(carrier, endpoint, method)] = bounds
        self.leasing |= self.leases.declare(bounds)
        return bounds

    def bind_now(
        self, specs: Sequence[LimitSpec], label: str | None, method: str | None
    ) -> tuple[BoundLimit, ...]:
        """``specs`` bound for ``label`` (the endpoint) and ``method``, neither kept nor told to
        the leases (``with limiter.limit(...)``, whose spec is made anew by every request),
        numbered among the limits of the route's plan (a limit wrapper's in it, a block's after
        them)."""
        plan = self.routes.get((label or "", method or ""))
        return distinct(
            (
                b
                for spec in specs
                for b in bind(
                    spec,
                    prefix=self.prefix,
                    default_algorithm=self.algorithm,
                    label=label or "view",
                    method=method,
                    shadow=self.shadow,
                )
            ),
            self.prefix,
            () if plan is None else plan.order,
        )
