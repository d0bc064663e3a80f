"""The request path: every limit of a request decided in one storage call, after the app's hooks.

1. On the app's first request, :meth:`Enforcer.finalize` wraps each view function of the app in
   a *gate* (once; Flask forbids new routes from then on, so the set is final), binds nothing
   yet, and logs one WARNING naming the declarations that match none of the app's endpoints.
   Flask has no hook between the last ``before_request`` function and the view, and an
   extension's ``before_request`` hook runs before every hook registered after ``init_app`` and
   before every blueprint's: wrapping the view is the one place that follows them all.
2. Flask calls the gate where it would call the view: after every ``before_request`` hook of the
   app and of the request's blueprints, in whatever order they were registered. So every
   ``key_func``, ``cost``, ``exempt_when`` and identity loader sees what those hooks set. The
   gate finds the route's plan (bound once per endpoint and method by
   :func:`~flask_distlimit.declare.route_limits.build_plan`), identifies the client, builds one
   :class:`~flask_distlimit.core.decision.Check` per limit (global, tier, route, shared), asks the
   deny cache, then makes ONE ``guard.evaluate`` call for all of them.
3. A denial raises :class:`~flask_distlimit.core.problem.RateLimitExceeded` (429), an outage under
   policy ``closed`` :class:`~flask_distlimit.core.problem.RateLimitUnavailable` (503): ordinary
   Flask error handling turns them into responses.
4. A limit wrapper the plan did not reach (behind a decorator that skips ``functools.wraps``)
   enforces its own limits when it runs, in a second call.
5. ``after_request``: a request whose view never ran (no route matched, or a hook answered
   first) is counted here against the limits of every request (global and tier); then the
   rate-limit headers of the limit closest to denial are added (and
   ``X-RateLimit-Degraded: true`` when the storage was down).
6. What a request takes (concurrency and fleet slots; a worker's place in flight, taken in
   ``before_request`` or the gate by :mod:`flask_distlimit.defences.shedding`) is kept by the
   request's ledger, which :mod:`flask_distlimit.defences.lifecycle` ends once, however the
   response ends; ``after_request`` tells it whether the response's body is complete.

What ``after_request`` needs is kept in the request's WSGI environ (under a key of this app's
limiter), not on ``g``: the environ lives exactly as long as the request, and an app context
shared by several requests cannot hand one request's numbers to the next.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import operator
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, NoReturn

from flask import Flask, Request, current_app, request
from werkzeug.exceptions import HTTPException
from werkzeug.wrappers import Response as WerkzeugResponse

from flask_distlimit._typing import FailurePolicy, KeyFunc
from flask_distlimit.core.algorithms import CONCURRENCY, MAX_LIMITS_PER_REQUEST, check_limit_count
from flask_distlimit.core.decision import Check, Decision, Evaluation
from flask_distlimit.core.limits import Rate
from flask_distlimit.core.problem import (
    ConcurrencyLimitExceeded,
    Overloaded,
    RateLimitExceeded,
    RateLimitUnavailable,
    retry_after_seconds,
)
from flask_distlimit.declare import refusal_options
from flask_distlimit.declare.dynamic_limits import ttl_us
from flask_distlimit.declare.request_filters import filtered
from flask_distlimit.declare.route_limits import (
    BoundLimit,
    RoutePlan,
    bind,
    build_plan,
    distinct,
    strictest,
)
from flask_distlimit.declare.targets import carried_function, describe
from flask_distlimit.defences.concurrency import SlotRelease, is_slot_key, slot_check
from flask_distlimit.defences.fleet import Fleet
from flask_distlimit.defences.shadow import ShadowLog
from flask_distlimit.identity import Identity
from flask_distlimit.request import deduction
from flask_distlimit.request.current_limits import Evaluated, breached_rates
from flask_distlimit.request.headers import Report, rate_limit_headers
from flask_distlimit.resilience.leases import Leases

if TYPE_CHECKING:
    from werkzeug.sansio.response import Response as SansIOResponse

    from flask_distlimit.state import LimiterState

__all__ = ["Breach", "BreachHook", "Enforcer", "is_static"]

log = logging.getLogger("flask_distlimit")

_KEY: Final = operator.attrgetter("key")
#: Set on a response the rate-limit headers were added to: whether ``Retry-After`` was too.
_HEADERS_ADDED: Final = "_distlimit_headers_added"
#: Every header name :meth:`Enforcer.after_request` adds but ``Retry-After``.
_OUR_HEADERS: Final = (
    "X-RateLimit-Limit",
    "X-RateLimit-Remaining",
    "X-RateLimit-Reset",
    "RateLimit-Policy",
    "RateLimit",
    "X-RateLimit-Degraded",
)


def _drop_our_headers(headers: Any, *, retry_after: bool) -> None:
    """Remove the headers an earlier pass of the same response object added."""
    for name in (*_OUR_HEADERS, "Retry-After") if retry_after else _OUR_HEADERS:
        headers.remove(name)


#: Clients and limits whose breach was logged, kept until their window ends (bounded).
_BREACHES_KEPT: Final = 10_000
#: Declarations named in the first request's WARNING, at most.
_UNMATCHED_SHOWN: Final = 20


def is_static(endpoint: str) -> bool:
    """Flask's static-file endpoints: never limited."""
    return endpoint == "static" or endpoint.endswith(".static")


@dataclass(frozen=True, slots=True)
class Breach:
    """What the ``on_breach`` hook is told about a refused request (no raw identity)."""

    endpoint: str | None
    method: str
    path: str
    #: :func:`flask_distlimit.declare.keys.identity_tag` of the request's identity (when only
    #: global or ``key_func`` limits applied: the hash tag of the first denied limit's key)
    identity_digest: str
    tier: str | None
    violated_policies: tuple[str, ...]
    #: seconds, rounded up; None when the request can never pass (its cost exceeds the limit)
    retry_after: int | None
    from_cache: bool  #: answered by the local deny cache, without a storage call
    #: the first denied limit as declared: its count and its window (``Rate(5, 60)`` for
    #: ``5/minute``; for a concurrency limit, the slots and their lease)
    limit: Rate | None = None
    #: every denied limit's, in the order of ``violated_policies``
    limits: tuple[Rate, ...] = ()


BreachHook = Callable[[Breach], "SansIOResponse | None"]


class _RequestData:
    """This request's limiter data, kept in the request environ under ``environ_key``."""

    __slots__ = (
        "covered",
        "deferred",
        "degraded",
        "denied",
        "evaluated",
        "exempt",
        "report",
        "retry_after",
        "slots",
    )

    def __init__(self, covered: frozenset[object], *, exempt: bool = False) -> None:
        self.covered = covered  #: limit wrappers whose limits were decided with the route's
        self.exempt = exempt
        self.report: Report | None = None
        self.degraded = False
        self.denied = False
        self.retry_after: int | None = None
        #: the limits evaluated so far (``limiter.current_limits``)
        self.evaluated: list[Evaluated] = []
        #: ``deduct_when`` limits to charge after the response, by key
        self.deferred: dict[str, deduction.Deferred] = {}
        #: concurrency slots, held by the request's ledger (flask_distlimit.defences.lifecycle)
        self.slots: SlotRelease | None = None


class _Served:
    """The objects one app serves: declaring a limit on them from now on raises."""

    __slots__ = ("__weakref__", "app_name", "objects")

    def __init__(self, app_name: str, objects: set[object]) -> None:
        self.app_name = app_name
        self.objects = objects


def _cost_value(b: BoundLimit, default: int) -> int:
    cost = b.cost
    if cost is None:
        return default
    if isinstance(cost, int):
        return cost
    value = cost()
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(
            f"The cost function {getattr(cost, '__qualname__', cost)!r} of the rate limit "
            f"{b.name!r} returned {value!r}; it must return an int >= 0 (0 consumes nothing)."
        )
    return value


def _key_text(b: BoundLimit, key_func: KeyFunc) -> str | None:
    """``func:<value>``: what a ``key_func`` returns, in a key space of its own (never the
    bucket of an address, a user, a token or an API key; see :mod:`flask_distlimit.declare.keys`).

    ``None`` when it answers no key (``None`` or ``""``): the request is counted under its own
    identity, never every keyless request in one shared bucket. A ``str`` or an ``int`` is a
    key; anything else raises ``TypeError``: the text of a model object holds its memory address
    (a fresh quota on every request) and bytes read ``"b'...'"``."""
    value: object = key_func()
    if isinstance(value, str):
        return "func:" + value if value else None
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return f"func:{value}"
    raise TypeError(
        f"The key_func {getattr(key_func, '__qualname__', key_func)!r} of the rate limit "
        f"{b.name!r} returned a {type(value).__name__}; it must return a str or int (e.g. "
        "str(current_user.id)), or None to count the request under its own identity."
    )


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


def _report(b: BoundLimit, d: Decision, *, denied: bool, spent: bool = False) -> Report:
    """The headers' numbers of one decision (``spent``: a ``deduct_when`` peek that refuses:
    retry when the quota is whole again)."""
    reduced = d.limit != b.rate.amount  # the local fallback divides limits
    return Report(
        name=b.name,
        limit=d.limit,
        period=b.rate.period,
        remaining=d.remaining,
        reset_after=d.reset_after,
        retry_after=(d.reset_after if spent else d.retry_after) if denied else 0.0,
        policy=None if reduced else b.policy,
        quoted=b.quoted,
        algorithm=b.algorithm,
    )


class Enforcer:
    """The request path of one app's limiter (see the module docstring)."""

    def __init__(self, state: LimiterState) -> None:
        self.state = state
        self.registry = state.limiter.registry
        settings = state.settings
        self._prefix = settings.key_prefix
        self._algorithm = settings.algorithm
        self._headers = settings.headers
        self._conditional_cost = settings.conditional_cost
        self._retry_unavailable = retry_after_seconds(settings.breaker_reset_timeout)
        self._lock = threading.Lock()
        #: the app's view functions as registered, by endpoint; None until the first request
        self._views: dict[str, object] | None = None
        self._served: _Served | None = None
        self._plans: dict[tuple[str | None, str], RoutePlan] = {}
        self._carried: dict[tuple[object, str | None, str], tuple[BoundLimit, ...]] = {}
        self._breaches: dict[str, int] = {}
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
        #: the global and tier limits hold no shadow limit, and no fleet slot rides along
        self._every_plain = self.fleet is None and not any(
            b.shadow
            for b in (*state.global_limits, *(b for t in state.tier_limits.values() for b in t))
        )
        self._charge_preflights = settings.charge_preflights
        self._dynamic_ttl = ttl_us(settings.dynamic_limit_ttl)
        self._filters = state.limiter.request_filters
        self._worker_shedding = state.shedding.load is not None
        self._ledger_key = state.lifecycle.key
        self._shadow_all = settings.shadow is True
        self._shadow_log = ShadowLog(state.local_clock)
        self._lease = settings.concurrency_lease
        #: quota leases (flask_distlimit.resilience.leases); ``_leasing``: some bound limit has
        #: ``lease=``
        self.leases = Leases(state.guard, state.local_clock, state.storage_now)
        self._leasing = False
        #: The request environ key of this limiter's per-request data (one per app's limiter:
        #: a WSGI app may hand its environ to another app with a limiter of its own).
        self.environ_key = f"flask_distlimit.request.{id(self):x}"

    # -- the first request -----------------------------------------------------------------------

    def before_request(self) -> None:
        """Finalize on the app's first request; shed the request when this process is too busy
        and its priority is known before the app's hooks
        (:mod:`flask_distlimit.defences.shedding`)."""
        if self._views is None:
            self.finalize(current_app._get_current_object())  # type: ignore[attr-defined]
        shedding = self.state.shedding
        if shedding.load is None:
            return
        req: Request = request._get_current_object()  # type: ignore[attr-defined]
        endpoint = req.endpoint
        view: object | None = None
        if endpoint is not None:
            view = self.original_view(endpoint)
            plan = self._plans.get((endpoint, req.method)) or self.plan(endpoint, req.method, view)
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
            if self._views is not None:
                return
            views: dict[str, object] = dict(app.view_functions)
            methods: dict[str, set[str]] = {}
            for rule in app.url_map.iter_rules():
                methods.setdefault(rule.endpoint, set()).update(rule.methods or ())
            served: set[object] = set(app.blueprints.values())
            state = self.state
            every_request = (
                len(state.global_limits)
                + max((len(t) for t in state.tier_limits.values()), default=0)
                + (self.fleet is not None)  # the fleet's slot rides the same call
            )
            routed = [(e, v) for e, v in views.items() if not is_static(e)]
            for endpoint, view in routed:
                for method in sorted(methods.get(endpoint, {""})):
                    every, one = self.registry.attached(view, method)
                    served.update(every, one)
                    # Bound now: a route that would carry too many limits fails here, loudly.
                    route = self.plan(endpoint, method, view).limits
                    check_limit_count(
                        every_request + sum(b.most_rates for b in route),
                        f"The global, tier and route limits of {endpoint!r} ({method})",
                    )
            for endpoint, view in routed:
                app.view_functions[endpoint] = self._gate(endpoint, view)
            self._served = _Served(app.name, served)
            self.registry.watch(self._served)
            self._warn_unmatched(app, served)
            self._views = views

    def _warn_unmatched(self, app: Flask, served: set[object]) -> None:
        registry = self.registry
        unmatched = [
            f"limit {spec.shown()} on {spec.declared_on}"
            for target, specs in (*registry.views.items(), *registry.blueprints.items())
            if target not in served
            for spec in specs[:1]
        ] + [
            f"exemption of {describe(target)}"
            for target in (*registry.exempt_views, *registry.exempt_blueprints)
            if target not in served
        ]
        if not unmatched:
            return
        shown = sorted(set(unmatched))
        more = len(shown) - _UNMATCHED_SHOWN
        log.warning(
            "%d rate-limit declaration(s) match no endpoint of the app %r: %s%s. A limit on a "
            "view the app does not serve never applies; one behind a decorator without "
            "functools.wraps is enforced only when that view runs, in a storage call of its own; "
            "an exemption there is not applied. Register the view, or use functools.wraps in "
            "your decorators.",
            len(shown), app.name, "; ".join(shown[:_UNMATCHED_SHOWN]),
            f" and {more} more" if more > 0 else "",
        )  # fmt: skip

    def _gate(self, endpoint: str, view: Any) -> Callable[..., Any]:
        enforce = self.enforce
        # A view that is this limiter's limit wrapper: when the plan decided its limits, the
        # function it wraps is called directly (the wrapper would only check that).
        inner = carried_function(view, self.state.limiter)
        if inspect.iscoroutinefunction(view):

            @functools.wraps(view)
            async def async_gate(*args: Any, **kwargs: Any) -> Any:
                data = enforce(endpoint, view)
                if inner is not None and data is not None and (data.exempt or view in data.covered):
                    return await inner(*args, **kwargs)
                return await view(*args, **kwargs)

            return async_gate

        @functools.wraps(view)
        def gate(*args: Any, **kwargs: Any) -> Any:
            data = enforce(endpoint, view)
            if inner is not None and data is not None and (data.exempt or view in data.covered):
                return inner(*args, **kwargs)
            return view(*args, **kwargs)

        return gate

    # -- plans ---------------------------------------------------------------------------------

    def original_view(self, endpoint: str) -> object | None:
        """The view function registered for ``endpoint``, before the gate wrapped it."""
        views = self._views
        if views is not None:
            return views.get(endpoint)
        return current_app.view_functions.get(endpoint)

    def plan(self, endpoint: str | None, method: str, view: object | None) -> RoutePlan:
        """The route's limits for ``endpoint`` and ``method``, bound once."""
        plan = self._plans.get((endpoint, method))
        if plan is not None:
            return plan
        state = self.state
        if endpoint is not None and is_static(endpoint):
            plan = RoutePlan(exempt=True)
        else:
            plan = build_plan(
                self.registry,
                endpoint=endpoint,
                view=view,
                blueprints=_blueprints_of(current_app, endpoint) if endpoint else (),
                method=method,
                default_limits=state.default_specs,
                prefix=self._prefix,
                default_algorithm=self._algorithm,
                shadow=self._shadow_all,
            )
        if self.leases.declare(plan.limits):
            self._leasing = True
        self._plans[(endpoint, method)] = plan
        return plan

    # -- the request path ----------------------------------------------------------------------

    def enforce(self, endpoint: str, view: object) -> _RequestData | None:
        """The gate's work: decide every limit of the request in one storage call; raise on a
        refusal. Answers the request's data (None when nothing applies to the route)."""
        req: Request = request._get_current_object()  # type: ignore[attr-defined]
        plan = self._plans.get((endpoint, req.method)) or self.plan(endpoint, req.method, view)
        exempt = plan.exempt
        asked = False  # the request filters
        if self._worker_shedding and not exempt:
            asked = True
            exempt = bool(self._filters and filtered(self._filters))
            if not exempt:  # after every hook, unless it was decided before them
                self.state.shedding.admit()
        if plan.idle and not self._every_request:
            return None  # nothing to count, nothing a wrapper could need to know
        if not (exempt or asked) and self._filters:
            exempt = filtered(self._filters)
        data = _RequestData(plan.covered, exempt=exempt)
        req.environ[self.environ_key] = data
        if not exempt:
            self._evaluate(
                req, data, plan.limits, plan.needs_identity, plan.policy, True, plain=plan.plain
            )
        return data

    def reached(self, carrier: object, specs: Sequence[Any]) -> None:
        """A limit wrapper runs: enforce its limits unless the request's plan already did."""
        req: Request = request._get_current_object()  # type: ignore[attr-defined]
        environ = req.environ
        data: _RequestData | None = environ.get(self.environ_key)
        if data is not None and (data.exempt or carrier in data.covered):
            return
        every_request = data is None  # called outside the gate: do the gate's work too
        if data is None:
            if self._filters and filtered(self._filters):
                environ[self.environ_key] = _RequestData(frozenset(), exempt=True)
                return
            data = _RequestData(frozenset())
            environ[self.environ_key] = data
        endpoint, method = req.endpoint, req.method
        bounds = self._carried.get((carrier, endpoint, method))
        if bounds is None:
            label = endpoint or str(getattr(carrier, "__qualname__", "view"))
            bounds = distinct(
                (
                    b
                    for spec in specs
                    for b in bind(
                        spec,
                        prefix=self._prefix,
                        default_algorithm=self._algorithm,
                        label=label,
                        method=method,
                        shadow=self._shadow_all,
                    )
                ),
                self._prefix,
            )
            self._carried[(carrier, endpoint, method)] = bounds
            if self.leases.declare(bounds):
                self._leasing = True
        policy = strictest(spec.on_failure for spec in specs)
        needs_identity = any(b.needs_identity for b in bounds)
        self._evaluate(req, data, bounds, needs_identity, policy, every_request)

    def _evaluate(
        self,
        req: Request,
        data: _RequestData,
        route_limits: Sequence[BoundLimit],
        needs_identity: bool,
        policy: FailurePolicy | None,
        every_request: bool,
        fleet: bool = True,
        *,
        plain: bool = False,
    ) -> None:
        """One storage call for ``route_limits`` (and the global and tier limits when
        ``every_request``). ``plain``: every route limit is :attr:`BoundLimit.plain`."""
        state = self.state
        environ = req.environ
        method = req.method
        # A conditional GET or HEAD may cost less on route limits (DISTLIMIT_CONDITIONAL_COST);
        # the global and tier limits always cost at least 1.
        default_cost = (
            self._conditional_cost
            if (method == "GET" or method == "HEAD")
            and ("HTTP_IF_NONE_MATCH" in environ or "HTTP_IF_MODIFIED_SINCE" in environ)
            else 1
        )
        every_cost = default_cost or 1
        tiers = every_request
        if (
            method == "OPTIONS"
            and not self._charge_preflights
            and "HTTP_ACCESS_CONTROL_REQUEST_METHOD" in environ
            and not self._view_answers_options(req)
        ):
            # A CORS preflight: the browser's, not the client's request; global limits only.
            route_limits, needs_identity, tiers = (), False, False
        checks: list[Check] = []
        bounds: list[BoundLimit] = []
        identity: Identity | None = None
        if every_request and fleet and self.fleet is not None:
            priority = state.shedding.priority()
            checks.append(self.fleet.check(priority))
            bounds.append(self.fleet.bound(priority))
        if every_request and state.global_limits:
            tag = state.identity_tag(state.resolver.client_ip(environ))
            for b in state.global_limits:
                checks.append(b.check(tag, every_cost))
                bounds.append(b)
        itag = ""
        # DISTLIMIT_CONDITIONAL_COST=0: the request claims to revalidate, but only a 304 proves
        # it; route limits peek now and charge the whole cost after a response that is not 304.
        revalidation = default_cost == 0 and bool(route_limits)
        if revalidation:
            plain = False
        if (tiers and state.tier_limits) or needs_identity:
            identity = state.resolver.identify(req, state.hooks)
            itag = state.identity_tag(identity.value)
            if tiers:
                for b in state.tier_limits.get(identity.tier, ()):
                    checks.append(b.check(itag, every_cost))
                    bounds.append(b)
        if plain:  # the common case: no option of a limit to call or resolve
            for b in route_limits:
                checks.append(b.check(itag, default_cost))
            bounds += route_limits
            route_limits = ()
        fixed = len(route_limits)  # route limits not yet added (a room for dynamic values)
        for b in route_limits:
            fixed -= 1
            if b.exempt_when is not None and b.exempt_when():
                continue
            tag = itag
            if b.key_func is not None:
                text = _key_text(b, b.key_func)
                if text is not None:
                    tag = state.identity_tag(text)
                elif identity is None:  # no key: counted under the request's identity
                    identity = state.resolver.identify(req, state.hooks)
                    tag = itag = state.identity_tag(identity.value)
            if b.algorithm == CONCURRENCY:  # a slot, not a cost (defences.concurrency)
                checks.append(slot_check(b, tag, self._lease))
                bounds.append(b)
                continue
            cost = default_cost if b.cost is None else _cost_value(b, default_cost)
            unproved = revalidation and b.cost is None  # free only if the answer is a 304
            if b.dynamic is None and b.deduct_when is None and not unproved:  # the common case
                checks.append(b.check(tag, cost))
                bounds.append(b)
                continue
            resolved: Sequence[BoundLimit] = (b,)
            if b.dynamic is not None:  # a callable or mapping value: this request's rates
                room = MAX_LIMITS_PER_REQUEST - len(checks) - fixed
                tier = identity.tier if identity is not None else None
                resolved = b.dynamic.resolve(
                    tag, tier, state.local_clock(), self._dynamic_ttl, room
                )
            for r in resolved:
                if r.deduct_when is not None or unproved:  # a peek now, charged after
                    check = r.check(tag, 1 if unproved else cost)
                    data.deferred[check.key] = deduction.Deferred(check, r, unproved, policy)
                    checks.append(r.check(tag, 0))
                else:
                    checks.append(r.check(tag, cost))
                bounds.append(r)
        if not checks:
            return
        for c, b in zip(checks, bounds, strict=True):
            if c.cost > c.limit:
                self._refuse_unaffordable(c, b, identity, data, checks, bounds, policy)
        if len(checks) > 1 and len(set(map(_KEY, checks))) != len(checks):
            checks, bounds = _dedupe(checks, bounds)
        # no slot and no shadow limit among the checks: their scans are skipped
        simple = plain and (not every_request or self._every_plain)
        self._decide(checks, bounds, identity, policy, data, simple=simple)

    def _view_answers_options(self, req: Request) -> bool:
        """Does the route's own view answer ``OPTIONS`` (its methods list it: ``methods=[...,
        "OPTIONS"]``, a ``MethodView`` with ``options``)? Then an ``OPTIONS`` with
        ``Access-Control-Request-Method`` runs the view like any request, and is limited like
        one. Not when Flask answers it (``provide_automatic_options``), nor when a decorator
        asked Flask for ``OPTIONS`` to answer preflights itself (``required_methods``, as
        flask-cors's ``cross_origin`` does): the view never runs for those."""
        rule = req.url_rule
        if rule is None or getattr(rule, "provide_automatic_options", False):
            return False
        endpoint = req.endpoint
        view = self.original_view(endpoint) if endpoint is not None else None
        return "OPTIONS" not in getattr(view, "required_methods", ())

    def _decide(
        self,
        checks: list[Check],
        bounds: list[BoundLimit],
        identity: Identity | None,
        policy: FailurePolicy | None,
        data: _RequestData,
        *,
        simple: bool = False,
    ) -> None:
        state = self.state
        cache = state.deny_cache
        if cache is not None and len(cache):
            now = state.local_clock()
            for c, b in zip(checks, bounds, strict=True):
                denial = cache.lookup(c.key, c.cost, now)
                if denial is not None:
                    wait = denial.retry_after(now)
                    metrics = state.guard.metrics
                    if metrics is not None:  # count the refusal as if the storage had made it
                        metrics.evaluated(
                            [c], Evaluation((Decision(False, denial.limit, 0, wait, wait),))
                        )
                    report = Report(
                        name=denial.name,
                        limit=denial.limit,
                        period=denial.period,
                        remaining=0,
                        reset_after=denial.reset_after(now),
                        retry_after=wait,
                        policy=b.policy,
                        quoted=b.quoted,
                        algorithm=b.algorithm,
                    )
                    self._refuse(
                        [report], [c.key], identity, data, from_cache=True, denied_bounds=[b]
                    )
        if self._leasing and len(checks) == 1 and bounds[0].lease:  # resilience.leases
            leased = self.leases.spend_one(checks[0])
            # the usual leased request: no storage call
            if leased is not None:
                self._leased(checks, bounds, leased, data)
                return
        slots = [] if simple else [c for c in checks if c.token]
        if slots:  # given back when the response ends, whatever happens from here
            if data.slots is None:
                data.slots = SlotRelease(state)
                # given back when the response ends, however (flask_distlimit.defences.lifecycle)
                state.lifecycle.ledger(request.environ).take(data.slots)
            data.slots.add(slots)
        if self._leasing and any(b.lease for b in bounds):  # flask_distlimit.resilience.leases
            started = state.local_clock()
            outcome = self.leases.evaluate(
                checks, bounds, policy=policy, now_us=state.storage_now()
            )
        else:
            started = state.local_clock()
            outcome = state.guard.evaluate(checks, policy=policy, now_us=state.storage_now())
            if self._leasing:  # after a storage call: leased units left unspent go back
                self.leases.housekeeping()
        if slots and data.slots is not None:
            if outcome.degraded and outcome.evaluation is not None:
                data.slots.degraded()  # held by the local fallback
            elif outcome.evaluation is not None and not outcome.evaluation.allowed:
                data.slots.discard(slots)  # refused: the storage took none
        if outcome.unavailable:
            data.degraded = data.denied = True
            data.retry_after = 1 if outcome.busy else self._retry_unavailable  # busy: load
            raise RateLimitUnavailable(
                retry_after=data.retry_after, instance=request.path, busy=outcome.busy
            )
        evaluation = outcome.evaluation
        if evaluation is None:  # storage down, policy "open"
            data.degraded = True
            return
        decisions = evaluation.decisions
        spent = deduction.spent(checks, decisions, data.deferred) if data.deferred else []
        # kept as they are; limiter.current_limits reads them only when asked
        data.evaluated.append(Evaluated(checks, bounds, decisions, spent, state.wall()))
        if spent and evaluation.allowed:  # a deduct_when limit whose quota is already spent
            self._refuse(
                [_report(bounds[i], decisions[i], denied=True, spent=True) for i in spent],
                [checks[i].key for i in spent],
                identity,
                data,
                from_cache=False,
                degraded=outcome.degraded,
                denied_bounds=[bounds[i] for i in spent],
            )
        shadow_spent = (
            deduction.spent(checks, decisions, data.deferred, shadow=True) if data.deferred else []
        )
        if shadow_spent:
            # Would have refused here, before the view: counted now, like every shadow limit's
            # would-be refusal, and not charged after the response (the refusal it stands for
            # would have charged nothing, and the charge would count it a second time).
            keys = [checks[i].key for i in shadow_spent]
            for key in keys:
                data.deferred.pop(key, None)
            if state.guard.metrics is not None:
                state.guard.metrics.shadow_would_deny(keys)
        if not simple and (shadow_spent or any(d.shadow_denied for d in decisions)):
            self._shadow_log.would_deny(
                [
                    (c.key, b.name, b.rate.period)
                    for i, (c, b, d) in enumerate(zip(checks, bounds, decisions, strict=True))
                    if d.shadow_denied or i in shadow_spent
                ],
                request.method,
                request.endpoint,
            )
        if not evaluation.allowed:
            finished = state.local_clock()
            denied_reports: list[Report] = []
            denied_keys: list[str] = []
            denied_bounds: list[BoundLimit] = []
            for c, b, d in zip(checks, bounds, decisions, strict=True):
                if d.allowed:
                    continue
                denied_reports.append(_report(b, d, denied=True))
                denied_keys.append(c.key)
                denied_bounds.append(b)
                if cache is not None and not outcome.degraded and not c.token:
                    cache.record(
                        c.key,
                        cost=c.cost,
                        retry_after=d.retry_after,
                        started_us=started,
                        finished_us=finished,
                        limit=d.limit,
                        period=b.rate.period,
                        name=b.name,
                        reset_after=d.reset_after,
                    )
            self._refuse(
                denied_reports,
                denied_keys,
                identity,
                data,
                from_cache=False,
                degraded=outcome.degraded,
                denied_bounds=denied_bounds,
            )
        # allowed: report the limit with the fewest units left (ties: the latest reset); never
        # a shadow limit (clients would slow down for a limit that is not enforced)
        best = 0
        if not simple and any(c.shadow or c.token for c in checks):
            best = next((i for i, c in enumerate(checks) if not (c.shadow or c.token)), -1)
            if best < 0:
                data.degraded = data.degraded or outcome.degraded
                return
        if len(decisions) > 1:
            best_d = decisions[best]
            for i in range(best + 1, len(decisions)):
                d = decisions[i]
                if checks[i].shadow or checks[i].token:
                    continue
                if d.remaining < best_d.remaining or (
                    d.remaining == best_d.remaining and d.reset_after > best_d.reset_after
                ):
                    best, best_d = i, d
        report = _report(bounds[best], decisions[best], denied=False)
        if data.report is None or report.remaining < data.report.remaining:
            data.report = report
        data.degraded = data.degraded or outcome.degraded

    def _leased(
        self, checks: list[Check], bounds: list[BoundLimit], d: Decision, data: _RequestData
    ) -> None:
        """A request whose one limit its lease admitted: what :meth:`_decide` keeps of an
        allowed decision (no slot, shadow or ``deduct_when`` limit can be leased)."""
        data.evaluated.append(Evaluated(checks, bounds, (d,), (), self.state.wall()))
        report = _report(bounds[0], d, denied=False)
        if data.report is None or report.remaining < data.report.remaining:
            data.report = report

    def _refuse(
        self,
        reports: list[Report],
        keys: list[str],
        identity: Identity | None,
        data: _RequestData,
        *,
        from_cache: bool,
        degraded: bool = False,
        denied_bounds: Sequence[BoundLimit] = (),
    ) -> None:
        """Log, call the breach hook and raise the 429 for the denied limits ``reports``
        (stored under ``keys``)."""
        data.deferred.clear()  # a refused request is never charged after its response
        concurrency = all(map(is_slot_key, keys))
        if concurrency and self.fleet is not None and self.fleet.key in keys:
            self._shed(data)
        binding = max(reports, key=lambda r: r.retry_after)
        # Not finite: the cost exceeds a limit the local fallback divided; it cannot pass now.
        retry = (
            retry_after_seconds(binding.retry_after) if math.isfinite(binding.retry_after) else None
        )
        data.report, data.denied, data.retry_after = binding, True, retry
        data.degraded = data.degraded or degraded
        names = tuple(r.name for r in reports)
        # The digest of who was counted: the key's hash tag, never the identity in clear.
        tags = [key[key.index("{") + 1 : key.index("}")] for key in keys]
        digest = self.state.identity_tag(identity.value) if identity is not None else tags[0]
        endpoint = request.endpoint
        tier = identity.tier if identity is not None else None
        self._log_breach(reports, keys, tags, digest, tier, endpoint, retry)
        if concurrency:  # the rate-limit headers describe rates, never slots in flight
            data.report = None
        self._raise(
            names,
            retry,
            digest,
            tier,
            from_cache=from_cache,
            denied=denied_bounds,
            concurrency=concurrency,
        )

    def _shed(self, data: _RequestData) -> NoReturn:
        """The fleet is over this request's priority's share: 503
        (flask_distlimit.defences.fleet)."""
        priority = self.state.shedding.priority()
        data.report, data.denied, data.retry_after = None, True, 1
        metrics = self.state.guard.metrics
        if metrics is not None:
            metrics.shed(priority, "fleet")
        raise Overloaded(priority=priority, reason="fleet", instance=request.path)

    def _refuse_unaffordable(
        self,
        check: Check,
        b: BoundLimit,
        identity: Identity | None,
        data: _RequestData,
        checks: Sequence[Check],
        bounds: Sequence[BoundLimit],
        policy: FailurePolicy | None,
    ) -> None:
        """Refuse a request that costs more than the limit ``b`` allows in a whole window: it
        can never pass, so no ``Retry-After`` promises that it will. It still counts against
        the request's global and tier limits among ``checks`` (decided first, in one storage
        call: one of them may refuse it instead), as every refused request that reaches no
        view does, so such requests cannot flood past them; its INFO line is logged once per
        client and limit per window at most, as breaches are."""
        data.deferred.clear()  # a refused request is never charged after its response
        every = [
            (c, e)
            for c, e in zip(checks, bounds, strict=True)
            if e.limit_id.startswith(("g:", "t:")) and c.cost <= c.limit
        ]
        if every:  # raises the 429 (or 503) of a global or tier limit that refuses
            self._decide([c for c, _ in every], [e for _, e in every], identity, policy, data)
        data.report, data.denied, data.retry_after = None, True, None
        names = (b.name,)
        tag = check.key[check.key.index("{") + 1 : check.key.index("}")]
        digest = self.state.identity_tag(identity.value) if identity is not None else tag
        now = self.state.local_clock()
        if self._breaches.get(check.key, 0) <= now:
            self._logged(((check.key, b.rate.period),), now)
            log.info(
                "Rate limit %s refused a request costing %d (more than %d in a whole window) "
                "from client %s, %s %s (logged once per client and limit per window)",
                b.name, check.cost, check.limit, digest, request.method, request.endpoint,
            )  # fmt: skip
        detail = (
            f"This request costs {check.cost} units, more than the limit {b.name} allows in a "
            f"whole window ({check.limit} per {b.rate.period} s): it can never be admitted. "
            "Send it in smaller parts."
        )
        tier = identity.tier if identity is not None else None
        self._raise(names, None, digest, tier, from_cache=False, detail=detail, denied=(b,))

    def _raise(
        self,
        names: tuple[str, ...],
        retry: int | None,
        digest: str,
        tier: str | None,
        *,
        from_cache: bool,
        detail: str | None = None,
        denied: Sequence[BoundLimit] = (),
        concurrency: bool = False,
    ) -> NoReturn:
        """Tell the ``on_breach`` hook, then raise the 429 (the hook's response, if any)."""
        response: SansIOResponse | None = None
        hook = refusal_options.breach_hook(denied, self.state.limiter.breach_hook)
        if denied:
            detail = refusal_options.error_message(denied) or detail
        if hook is not None:
            rates = breached_rates(denied, self._lease)
            response = hook(
                Breach(
                    endpoint=request.endpoint,
                    method=request.method,
                    path=request.path,
                    identity_digest=digest,
                    tier=tier,
                    violated_policies=names,
                    retry_after=retry,
                    from_cache=from_cache,
                    limit=rates[0] if rates else None,
                    limits=rates,
                )
            )
        problem = ConcurrencyLimitExceeded if concurrency else RateLimitExceeded
        exc = problem(
            retry_after=retry, violated_policies=names, instance=request.path, detail=detail
        )
        if isinstance(response, WerkzeugResponse):
            exc.response = response
        raise exc

    def _log_breach(
        self,
        reports: list[Report],
        keys: list[str],
        tags: list[str],
        digest: str,
        tier: str | None,
        endpoint: str | None,
        retry: int | None,
    ) -> None:
        """One INFO line per client and limit per window at most, never one per request."""
        now = self.state.local_clock()
        logged = self._breaches
        fresh = [
            (r, t) for r, k, t in zip(reports, keys, tags, strict=True) if logged.get(k, 0) <= now
        ]
        if not fresh:
            return
        self._logged(((k, r.period) for r, k in zip(reports, keys, strict=True)), now)
        log.info(
            "Rate limit exceeded: %s; identity %s, tier %s, %s %s; retry in %s s "
            "(logged once per client and limit per window)",
            ", ".join(f"{r.name} (client {t})" for r, t in fresh),
            digest,
            tier or "-",
            request.method,
            endpoint,
            retry,
        )

    def _logged(self, marks: Iterable[tuple[str, float]], now: int) -> None:
        """Note that the limits under these keys (with their periods, seconds) were logged at
        ``now``: not again within their window. At most ``_BREACHES_KEPT`` keys are kept."""
        logged = self._breaches
        if len(logged) >= _BREACHES_KEPT:
            for k in [k for k, until in logged.items() if until <= now]:
                del logged[k]
            if len(logged) >= _BREACHES_KEPT:
                logged.clear()
        for k, period in marks:
            logged[k] = now + int(period * 1_000_000)

    # -- after the view ------------------------------------------------------------------------

    def after_request(self, response: WerkzeugResponse) -> WerkzeugResponse:
        """Count a request whose view never ran; add the rate-limit headers (and
        ``Retry-After`` on a 429/503 the app replaced)."""
        req: Request = request._get_current_object()  # type: ignore[attr-defined]
        response = self._after_request(req, response)
        environ = req.environ
        if environ.get(self._ledger_key):  # the request holds something: when does it end?
            self.state.lifecycle.response_made(environ, response)
        return response

    def _after_request(self, req: Request, response: WerkzeugResponse) -> WerkzeugResponse:
        data: _RequestData | None = req.environ.get(self.environ_key)
        if data is None:
            response, data = self._view_never_ran(response)
            if data is None:
                return response
        if data.deferred:  # deduct_when limits: charged now, if the response says so
            for later, charged in deduction.charge(self.state, data.deferred, response):
                if later.check.shadow:  # never reported (clients would slow down for it)
                    continue
                report = _report(later.bound, charged, denied=False)
                if data.report is None or report.remaining < data.report.remaining:
                    data.report = report  # the count after the charge, not the peek's
        headers = response.headers
        marks = response.__dict__
        if _HEADERS_ADDED in marks:
            # A response object that passed here before (a view returns one object every time,
            # or a cached copy): ours from then go, or they would be sent twice, stale first.
            _drop_our_headers(headers, retry_after=marks[_HEADERS_ADDED])
        if (data.report is not None or data.evaluated) and self._headers != "none":
            # The names are ours alone: appended (werkzeug checks each value), no scan for an
            # existing one, one call for all of them.
            headers[len(headers) :] = rate_limit_headers(
                self._headers, data.report, self.state.wall(), denied=data.denied,
                applied=data.evaluated,
            )  # fmt: skip
        if data.degraded:
            headers["X-RateLimit-Degraded"] = "true"
        marks[_HEADERS_ADDED] = False  # True: Retry-After is ours too
        if (
            data.retry_after is not None
            and response.status_code in (429, 503)
            and "Retry-After" not in headers
        ):
            headers["Retry-After"] = str(data.retry_after)
            marks[_HEADERS_ADDED] = True
        if self.state.otel is not None:  # OpenTelemetry's count of requests (telemetry.otel)
            self.state.otel.request(data, response)
        return response

    def _view_never_ran(
        self, response: WerkzeugResponse
    ) -> tuple[WerkzeugResponse, _RequestData | None]:
        """No route matched, a ``before_request`` hook answered first, or Flask answered an
        ``OPTIONS`` itself: count the request against the global and tier limits (and, for an
        ``OPTIONS`` under ``DISTLIMIT_CHARGE_PREFLIGHTS``, the route's). An exempt route's
        request is not counted."""
        req: Request = request._get_current_object()  # type: ignore[attr-defined]
        endpoint = req.endpoint
        charge_route = self._charge_preflights and req.method == "OPTIONS" and endpoint
        if not (self._every_request or charge_route):
            return response, None
        if self._worker_shedding and self.state.shedding.shed_here(req.environ):
            return response, None  # shed before the app's hooks: charged to no limit
        if self._filters and filtered(self._filters):
            return response, None
        app: Flask = current_app._get_current_object()  # type: ignore[attr-defined]
        if self._views is None:  # a hook before ours answered the app's first request
            self.finalize(app)
        plan: RoutePlan | None = None
        if endpoint is not None:
            plan = self.plan(endpoint, req.method, self.original_view(endpoint))
            if plan.exempt:
                return response, None
        data = _RequestData(frozenset())
        req.environ[self.environ_key] = data
        try:
            if charge_route and plan is not None:
                self._evaluate(req, data, plan.limits, plan.needs_identity, plan.policy, True)
            else:
                self._evaluate(req, data, (), False, None, True, fleet=False)
        except HTTPException as exc:  # the refusal, through the app's own error handlers
            response = app.make_response(app.handle_http_exception(exc))
        return response, data


def _dedupe(checks: list[Check], bounds: list[BoundLimit]) -> tuple[list[Check], list[BoundLimit]]:
    seen: set[str] = set()
    kept_checks: list[Check] = []
    kept_bounds: list[BoundLimit] = []
    for c, b in zip(checks, bounds, strict=True):
        if c.key not in seen:
            seen.add(c.key)
            kept_checks.append(c)
            kept_bounds.append(b)
    return kept_checks, kept_bounds
