"""The request path: every limit of a request decided in one storage call, after the app's hooks.

:class:`Enforcer` is one app's request path: it holds this subpackage's pieces and hands each
what it uses (a clock, the guard), never the app's whole state; docs/request-flow.md follows
the steps. A limit wrapper the plan did not reach, or ``with limiter.limit(...)``, decides in a
call of its own (:meth:`Enforcer.reached`, :meth:`Enforcer.entered`). After the response,
:meth:`Enforcer.after_request` settles reservations and adds the headers. :class:`AppLimiter`
names what the request path reads of :class:`flask_distlimit.state.LimiterState`, and
:class:`Declared` what the state reads of the :class:`~flask_distlimit.Limiter`.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any, Protocol

from flask import Flask, Request, current_app, has_request_context, request
from werkzeug.exceptions import HTTPException
from werkzeug.wrappers import Response as WerkzeugResponse

from flask_distlimit._typing import FailurePolicy, RequestFilter
from flask_distlimit.core.pacing import Pace
from flask_distlimit.core.priorities import PriorityRegistry
from flask_distlimit.core.problem import retry_after_seconds
from flask_distlimit.declare.dynamic_limits import ttl_us
from flask_distlimit.declare.registry import LimitRegistry
from flask_distlimit.declare.request_filters import filtered
from flask_distlimit.declare.route_limits import BoundLimit, RoutePlan, strictest
from flask_distlimit.declare.specs import LimitSpec
from flask_distlimit.declare.targets import carried_function
from flask_distlimit.defences.concurrency import SlotRelease
from flask_distlimit.defences.deny_cache import DenyCache
from flask_distlimit.defences.fleet import Fleet
from flask_distlimit.defences.lifecycle import Lifecycle
from flask_distlimit.defences.shedding import Shedding
from flask_distlimit.identity import IdentityHooks, IdentityResolver
from flask_distlimit.identity.digests import IdentityTags
from flask_distlimit.request import deduction, gate
from flask_distlimit.request.checks import Checks
from flask_distlimit.request.data import RequestData
from flask_distlimit.request.decide import Decider
from flask_distlimit.request.headers import rate_limit_headers
from flask_distlimit.request.plans import Plans
from flask_distlimit.request.refuse import BreachHook, Refusals
from flask_distlimit.request.settings import LimiterSettings
from flask_distlimit.resilience.guard import Guard
from flask_distlimit.resilience.leases import Leases
from flask_distlimit.storage.base import Storage

#: The route limits of a request counted after its response, against every request's only.
_NO_ROUTE = RoutePlan(exempt=False)


class Declared(Protocol):
    """What one app's limiter reads of the :class:`~flask_distlimit.Limiter` serving it: what
    is declared in code (limits and exemptions, priorities, identity hooks, request filters,
    the breach hook, the run-time switch), read as the app serves, so declared before or after
    ``init_app``."""

    registry: LimitRegistry
    priorities: PriorityRegistry
    hooks: IdentityHooks
    request_filters: list[RequestFilter]
    breach_hook: BreachHook | None
    enabled: bool


class AppLimiter(Protocol):
    """What the request path, ``limiter.current_limits`` and the operator tools use of one
    app's limiter state (:class:`flask_distlimit.state.LimiterState`)."""

    @property
    def limiter(self) -> Declared: ...
    @property
    def settings(self) -> LimiterSettings: ...

    guard: Guard
    resolver: IdentityResolver
    deny_cache: DenyCache | None
    default_specs: tuple[LimitSpec, ...]
    global_limits: tuple[BoundLimit, ...]
    meta_limits: tuple[BoundLimit, ...]
    tier_limits: dict[str, tuple[BoundLimit, ...]]
    identity_tag: Callable[[str], str]
    local_clock: Callable[[], int]  #: microseconds
    paces: dict[str, Pace]  #: the ERROR lines about each limit's callables (by name)
    clock: Callable[[], int] | None  #: the injected clock (None: the real ones)
    wall: Callable[[], float]  #: Unix seconds
    lifecycle: Lifecycle
    shedding: Shedding
    storage: Storage
    tags: IdentityTags

    @property
    def enforcer(self) -> Enforcer: ...

    def storage_now(self) -> int | None: ...
    def drop_leases(self, keys: Iterable[str] | None = None) -> None: ...
    def lease_records_key(self) -> str: ...


def _routed_method(req: Request) -> str | None:
    """The method a limit decided apart from the gate is bound for: ``None`` (every method in
    one counter) for a request no route matched, whose method the client may have made up."""
    return req.method if req.endpoint is not None else None


class Enforcer:
    """The request path of one app's limiter (see the module docstring)."""

    def __init__(self, state: AppLimiter) -> None:
        self._state = state
        settings = state.settings
        self._lock = threading.Lock()
        self._served: object | None = None  # what the app serves, once finalized
        #: fleet-usage shedding (flask_distlimit.defences.fleet), counted with every request's
        #: limits
        self.fleet = (
            Fleet(
                settings.key_prefix,
                settings.fleet_capacity,
                settings.fleet_shares,
                settings.concurrency_lease,
            )
            if settings.fleet_capacity
            else None
        )
        #: some limit applies to every request (global, tier or the fleet's capacity)
        self._every_request = bool(state.global_limits or state.tier_limits or self.fleet)
        self._charge_preflights = settings.charge_preflights
        self._filters = state.limiter.request_filters
        self._worker_shedding = state.shedding.load is not None
        #: quota leases (flask_distlimit.resilience.leases)
        self.leases = Leases(state.guard, state.local_clock, state.storage_now)
        self._planner = Plans(
            registry=state.limiter.registry,
            default_specs=state.default_specs,
            leases=self.leases,
            prefix=settings.key_prefix,
            algorithm=settings.algorithm,
            shadow=settings.shadow is True,
        )
        self._plans = self._planner.routes  # the gate's first look, without a call
        refusals = Refusals(
            guard=state.guard,
            local_clock=state.local_clock,
            identity_tag=state.identity_tag,
            breach_hook=lambda: state.limiter.breach_hook,  # set later by @limiter.on_breach
            priority=state.shedding.priority,
            fleet_key=self.fleet.key if self.fleet is not None else None,
            lease=settings.concurrency_lease,
            retry_unavailable=retry_after_seconds(settings.breaker_reset_timeout),
        )
        decider = Decider(
            guard=state.guard,
            leases=self.leases,
            plans=self._planner,
            refusals=refusals,
            lifecycle=state.lifecycle,
            deny_cache=state.deny_cache,
            clock=state.clock,
            wall=state.wall,
            new_slots=lambda: SlotRelease(state),
        )
        self._checks = Checks(
            plans=self._planner,
            decider=decider,
            refusals=refusals,
            resolver=state.resolver,
            hooks=state.limiter.hooks,
            identity_tag=state.identity_tag,
            local_clock=state.local_clock,
            global_limits=state.global_limits,
            meta_limits=state.meta_limits,
            tier_limits=state.tier_limits,
            fleet=self.fleet,
            priority=state.shedding.priority,
            settings=settings,
            dynamic_ttl_us=ttl_us(settings.dynamic_limit_ttl),
        )
        self._header_mode = settings.headers
        self._headers_key = state.lifecycle.headers_key
        #: The request environ key of this limiter's per-request data (one per app's limiter:
        #: a WSGI app may hand its environ to another app with a limiter of its own).
        self.environ_key = f"flask_distlimit.request.{id(self):x}"

    # -- the first request -----------------------------------------------------------------------

    def before_request(self) -> None:
        """Finalize on the app's first request; shed the request when this process is too busy
        and its priority is known before the app's hooks
        (:mod:`flask_distlimit.defences.shedding`)."""
        if self._planner.views is None:
            self.finalize(current_app._get_current_object())  # type: ignore[attr-defined]
        if not self._state.limiter.enabled:  # switched off at run time: nothing is limited
            request.environ[self.environ_key] = RequestData(exempt=True)
            return
        shedding = self._state.shedding
        if shedding.load is None:
            return
        req: Request = request._get_current_object()  # type: ignore[attr-defined]
        endpoint = req.endpoint
        view: object | None = None
        if endpoint is not None:
            view = self._planner.original_view(endpoint)
            plan = self._plans.get((endpoint, req.method)) or self.plan(endpoint, req.method)
            if plan.exempt:  # exempt (static files too): never counted, never shed
                return
        # A request filter or the priority resolver may read what the app's hooks set: then
        # the gate decides, after them.
        if not self._filters and shedding.known_before_hooks(view):
            shedding.admit()

    def finalize(self, app: Flask) -> None:
        """Wrap every view function of ``app`` in a gate, close declarations on what it serves,
        and warn about declarations that match none of its endpoints. Runs once."""
        with self._lock:
            if self._planner.views is not None:
                return
            state = self._state
            every_request = (
                len(state.global_limits)
                + len(state.meta_limits)
                + max((len(t) for t in state.tier_limits.values()), default=0)
                + (self.fleet is not None)  # the fleet's slot rides the same call
            )
            self._served = gate.finalize(app, self._planner, every_request, self.gate)

    # -- plans (flask_distlimit.request.plans) -------------------------------------------------

    def plan(self, endpoint: str, method: str) -> RoutePlan:
        """The route's limits for ``endpoint`` and ``method``, bound once."""
        return self._planner.plan(endpoint, method)

    # -- the request path ----------------------------------------------------------------------

    def gate(self, endpoint: str, view: Any) -> Callable[..., Any]:
        """``view`` in its gate: decide every limit of the request in one storage call (raise on
        a refusal), then call the view, or the function it wraps when it is this limiter's
        limit wrapper and the plan decided its limits (the wrapper would only check that)."""
        inner = carried_function(view, self._state.limiter)
        plans = self._plans

        @functools.wraps(view)
        def gate(*args: Any, **kwargs: Any) -> Any:
            req: Request = request._get_current_object()  # type: ignore[attr-defined]
            plan = plans.get((endpoint, req.method)) or self.plan(endpoint, req.method)
            data: RequestData | None = req.environ.get(self.environ_key)
            if data is not None:  # a hook's limit opened it, and counted every request's limits
                exempt = data.exempt
                if not exempt:
                    self._state.shedding.admit()
                    self._checks.decide(req, data, plan, every_request=False)
            else:
                exempt = plan.exempt
                asked = False  # the request filters
                if self._worker_shedding and not exempt:
                    asked = True
                    exempt = bool(self._filters and filtered(self._filters))
                    if not exempt:  # after every hook, unless it was decided before them
                        self._state.shedding.admit()
                # no limit of every request, no route limit, exemption or limit wrapper
                if not (self._every_request or plan.limits or plan.exempt or plan.covered):
                    return view(*args, **kwargs)  # nothing to count, nothing to tell a wrapper
                if not (exempt or asked) and self._filters:
                    exempt = filtered(self._filters)
                data = RequestData(plan.covered, exempt=exempt, meta_limits=plan.meta_limits)
                req.environ[self.environ_key] = data
                if not exempt:
                    self._checks.decide(req, data, plan, every_request=True)
            if inner is not None and (exempt or view in plan.covered):
                return inner(*args, **kwargs)
            return view(*args, **kwargs)

        if not inspect.iscoroutinefunction(view):
            return gate

        @functools.wraps(view)
        async def async_gate(*args: Any, **kwargs: Any) -> Any:
            return await gate(*args, **kwargs)  # the view's coroutine, made after the decision

        return async_gate

    def reached(self, carrier: object, specs: Sequence[LimitSpec]) -> None:
        """A limit wrapper runs: enforce its limits unless the request's plan already did (a
        wrapper the plan left to run, :attr:`RoutePlan.inner`, with the route's policy)."""
        req: Request = request._get_current_object()  # type: ignore[attr-defined]
        own = self._own_data(req)
        if own is None or carrier in own[0].covered:
            return
        route = self._plans.get((req.endpoint, req.method))
        if route is not None and carrier in route.inner:
            specs, policy = route.inner[carrier], route.policy
        else:
            policy = strictest(spec.on_failure for spec in specs)
        bounds = self._planner.carried(carrier, specs, req.endpoint, _routed_method(req))
        self._decide_own(req, own, bounds, policy)

    def entered(self, spec: LimitSpec) -> None:
        """``with limiter.limit(...)`` in a view: decide that limit now, in a call of its own."""
        req: Request = request._get_current_object()  # type: ignore[attr-defined]
        own = self._own_data(req)
        if own is not None and spec.applies_to(req.method):
            bounds = self._planner.bind_now((spec,), req.endpoint, _routed_method(req))
            self._decide_own(req, own, bounds, spec.on_failure)

    def _own_data(self, req: Request) -> tuple[RequestData, RoutePlan | None] | None:
        """The request's data for limits decided apart from the gate's call, with the route's
        plan when the gate has not run (a ``before_request`` hook runs the limit: its call
        decides the limits of every request too, and the gate then does not again); None when
        the request is exempt (its route, or a request filter)."""
        environ = req.environ
        data: RequestData | None = environ.get(self.environ_key)
        if data is not None:
            return None if data.exempt else (data, None)
        endpoint = req.endpoint
        route = _NO_ROUTE  # a 404 or 405: no plan kept per method (a client may make one up)
        if endpoint is not None:
            route = self.plan(endpoint, req.method)
        exempt = route.exempt or bool(self._filters and filtered(self._filters))
        data = RequestData(route.covered, exempt=exempt, meta_limits=route.meta_limits)
        environ[self.environ_key] = data
        return None if exempt else (data, route)

    def _decide_own(
        self,
        req: Request,
        own: tuple[RequestData, RoutePlan | None],
        bounds: tuple[BoundLimit, ...],
        policy: FailurePolicy | None,
    ) -> None:
        data, route = own
        plan = RoutePlan(
            exempt=False,
            limits=bounds,
            policy=policy,
            needs_identity=any(b.needs_identity for b in bounds),
            app_limits=route is not None and route.app_limits,
        )
        self._checks.decide(req, data, plan, every_request=route is not None)

    # -- after the view ------------------------------------------------------------------------

    def after_request(self, response: WerkzeugResponse) -> WerkzeugResponse:
        """Count a request whose view never ran; settle its ``deduct_when`` reservations
        (:mod:`.deduction`); add the headers of the limit closest to denial (:mod:`.headers`;
        ``Retry-After`` on a 429/503 the app replaced without one); keep the response for the
        OpenTelemetry count.
        A response object that passes twice has our headers replaced, never doubled."""
        req: Request = request._get_current_object()  # type: ignore[attr-defined]
        if type(response.response) is not list and not response.direct_passthrough:
            # a stream (not a file): what a limit decided in its body takes is held until sent
            self._state.lifecycle.ledger(req.environ)
        data: RequestData | None = req.environ.get(self.environ_key)
        if data is None:
            response, data = self._view_never_ran(req, response)
            if data is None:
                return response
        if data.deferred:  # deduct_when reservations: settled now, as the response says
            self._settle(req, response, data)
        ours = []
        if (data.report is not None or data.evaluated) and self._header_mode != "none":
            ours = rate_limit_headers(
                self._header_mode, data.report, self._state.wall(), denied=data.denied,
                applied=data.evaluated,
            )  # fmt: skip
        if data.degraded:
            ours.append(("X-RateLimit-Degraded", "true"))
        if (
            data.retry_after is not None
            and response.status_code in (429, 503)
            and "Retry-After" not in response.headers
        ):
            ours.append(("Retry-After", str(data.retry_after)))
        # Sent as the response starts (lifecycle), not set on the response object, which a view
        # may return again; a response that passes here again (an error in a later hook) has
        # these replaced. Made by hand, outside the WSGI wrapper: onto the response.
        added = req.environ.get(self._headers_key)
        if added is None:
            response.headers.extend(ours)
        else:
            added[:] = ours
        data.response = response  # counted once the app made it (telemetry.otel.request)
        return response

    def forget_headers(self, sender: object, **extra: object) -> None:
        """An exception reached Flask's handler (``got_request_exception``): the headers left
        for the response it replaces go (``after_request`` leaves the error's own, if it runs)."""
        if has_request_context():  # the signal may be sent by the app's own code, anywhere
            request.environ.get(self._headers_key, []).clear()

    def _settle(self, req: Request, response: WerkzeugResponse, data: RequestData) -> None:
        """Settle the request's reservations; report each limit's count after its settlement,
        not the reservation's."""
        hold = self._state.lifecycle.ledger(req.environ).take
        for report in deduction.charge(self._state, data.deferred, response, hold):
            now = data.report
            if now is None or now.name == report.name or report.remaining < now.remaining:
                data.report = report

    def _view_never_ran(
        self, req: Request, response: WerkzeugResponse
    ) -> tuple[WerkzeugResponse, RequestData | None]:
        """No route matched, a ``before_request`` hook answered first, or Flask answered an
        ``OPTIONS`` itself: count the request against the global and tier limits (and the
        route's blueprint and default limits when a hook answered; all the route's for an
        ``OPTIONS`` under ``DISTLIMIT_CHARGE_PREFLIGHTS``). An exempt route's request is not
        counted."""
        endpoint = req.endpoint
        charge_route = self._charge_preflights and req.method == "OPTIONS" and endpoint
        answered = endpoint is not None and req.method != "OPTIONS"  # by a before_request hook
        if not (self._every_request or charge_route or answered):
            return response, None
        if answered and not self._every_request:  # a route without limits ran its view (planned)
            known = self._plans.get((endpoint, req.method))
            if known is not None and not known.limits:
                return response, None
        if self._worker_shedding and self._state.shedding.shed_here(req.environ):
            return response, None  # shed before the app's hooks: charged to no limit
        if not self._state.limiter.enabled or (self._filters and filtered(self._filters)):
            return response, None
        app: Flask = current_app._get_current_object()  # type: ignore[attr-defined]
        if self._planner.views is None:  # a hook before ours answered the app's first request
            self.finalize(app)
        plan = _NO_ROUTE  # no route matched
        if endpoint is not None:
            plan = self.plan(endpoint, req.method)
            if answered:  # its blueprint's and the default limits count it, as Flask-Limiter's
                kept = tuple(b for b in plan.limits if b.spec.kind in ("blueprint", "default"))
                plan = replace(plan, limits=kept, inner={})
            if plan.exempt or not (plan.app_limits or charge_route or plan.limits):
                return response, None  # exempt, or lifted by an ExemptionScope
        req.environ[self.environ_key] = data = RequestData(meta_limits=plan.meta_limits)
        # no route matched, or Flask answered an OPTIONS: every request's limits, no fleet slot
        route = plan if charge_route or answered else _NO_ROUTE
        try:
            self._checks.decide(req, data, route, every_request=True, fleet=bool(charge_route))
        except HTTPException as exc:  # the refusal, through the app's own error handlers
            response = app.make_response(app.handle_http_exception(exc))
        return response, data
