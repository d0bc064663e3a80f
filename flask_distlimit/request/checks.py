"""Building a request's checks: one :class:`~flask_distlimit.core.decision.Check` per limit.

:meth:`Checks.decide` orders them as the storage sees them: the fleet's slot, the global limits
(under the client address), the tier limits, then route and shared limits (under the identity,
or the ``key_func``'s answer: ``None`` or ``""`` skips the limit). An option whose app code
raises is logged at ERROR and the limit applies as if it were not given (a ``key_func``: under
the identity; a ``cost``: the default; an ``exempt_when``: no exemption), since a client may make
it raise; an HTTP error it raises (or the identity loader does) is the answer, after the request
spent its global limits. A callable limit value that raises, with no ``fallback``, cannot be
evaluated: logged, then skipped as degraded under policy ``open``, else a 503; never dropped.
The checks go to :meth:`Decider.decide <flask_distlimit.request.decide.Decider.decide>`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Final, TypeVar

from flask import Request
from werkzeug.exceptions import HTTPException

from flask_distlimit._typing import KeyFunc
from flask_distlimit.core.algorithms import CONCURRENCY, MAX_LIMITS_PER_REQUEST
from flask_distlimit.core.decision import Check
from flask_distlimit.core.pacing import Pace, paced
from flask_distlimit.core.priorities import Priority
from flask_distlimit.declare.dynamic_limits import LOG_INTERVAL, LimitUnresolved, log_text
from flask_distlimit.declare.route_limits import BoundLimit, RoutePlan
from flask_distlimit.defences.concurrency import slot_check
from flask_distlimit.defences.fleet import Fleet
from flask_distlimit.identity import Identity, IdentityHooks, IdentityResolver
from flask_distlimit.request import deduction
from flask_distlimit.request.data import RequestData
from flask_distlimit.request.decide import Decider
from flask_distlimit.request.plans import Plans
from flask_distlimit.request.refuse import Refusals
from flask_distlimit.request.settings import LimiterSettings

log = logging.getLogger("flask_distlimit")

T = TypeVar("T")
#: A ``key_func`` that failed: its limit counts under the identity (never a key text).
_FAILED: Final[str | None] = ""


def _cost_value(b: BoundLimit, default: int) -> int:
    cost = b.spec.cost
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

    ``None`` when it answers no key (``None`` or ``""``): the limit is skipped for this request,
    as Flask-Limiter skips it (how a ``key_func`` opts a request out), never every keyless
    request in one shared bucket. A ``str`` or an ``int`` is a key; anything else raises
    ``TypeError``: the text of a model object holds its memory address (a fresh quota on every
    request) and bytes read ``"b'...'"``."""
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
        "str(current_user.id)), or None to skip the limit for this request."
    )


@dataclass(slots=True, kw_only=True)
class Checks:
    """Builds the checks of one app's requests (see the module docstring)."""

    plans: Plans
    decider: Decider
    refusals: Refusals  #: the 503 of a limit that cannot be evaluated
    resolver: IdentityResolver
    hooks: IdentityHooks
    identity_tag: Callable[[str], str]
    local_clock: Callable[[], int]  #: microseconds (a dynamic limit's cached values)
    global_limits: tuple[BoundLimit, ...]
    #: DISTLIMIT_META_LIMITS: ride every call that has a check, under the request's identity
    meta_limits: tuple[BoundLimit, ...]
    tier_limits: dict[str, tuple[BoundLimit, ...]]
    fleet: Fleet | None
    priority: Callable[[], Priority]  #: the request's (flask_distlimit.defences.shedding)
    settings: LimiterSettings
    dynamic_ttl_us: int
    #: the pace of the ERROR lines about each limit's app code failing (local clock), by name
    paces: dict[str, Pace] = field(default_factory=dict, init=False)
    #: the global and tier limits hold no shadow limit, and no fleet slot rides along
    every_plain: bool = field(init=False)

    def __post_init__(self) -> None:
        every = (*self.global_limits, *(b for t in self.tier_limits.values() for b in t))
        self.every_plain = self.fleet is None and not any(b.spec.shadow for b in every)

    def decide(
        self,
        req: Request,
        data: RequestData,
        plan: RoutePlan,
        *,
        every_request: bool,
        fleet: bool = True,
    ) -> None:
        """Decide the checks of ``plan``'s limits (and the global and tier limits when
        ``every_request``; the fleet's slot too when ``fleet``) in one storage call, when there
        are any; raise on a refusal. The ``deduct_when`` reservations are noted in
        ``data.deferred``."""
        route_limits: Sequence[BoundLimit] = plan.limits
        needs_identity, plain = plan.needs_identity, plan.plain
        environ = req.environ
        method = req.method
        # A conditional GET or HEAD may cost less on route limits (DISTLIMIT_CONDITIONAL_COST);
        # the global and tier limits always cost at least 1.
        default_cost = (
            self.settings.conditional_cost
            if (method == "GET" or method == "HEAD")
            and ("HTTP_IF_NONE_MATCH" in environ or "HTTP_IF_MODIFIED_SINCE" in environ)
            else 1
        )
        every_cost = default_cost or 1
        app_wide = every_request and plan.app_limits  # else ExemptionScope.APPLICATION
        tiers = app_wide
        if (
            method == "OPTIONS"
            and not self.settings.charge_preflights
            and "HTTP_ACCESS_CONTROL_REQUEST_METHOD" in environ
            and not self._view_answers_options(req)
        ):
            # A CORS preflight: the browser's, not the client's request; global limits only.
            route_limits, needs_identity, tiers = (), False, False
        checks: list[Check] = []
        if every_request and fleet and self.fleet is not None:
            checks.append(self.fleet.check(self.priority()))
        if app_wide and self.global_limits:  # first: spent even when the app's code answers
            address = data.client_ip
            if address is None:
                address = data.client_ip = self.resolver.client_ip(environ)
            tag = self.identity_tag(address)
            for b in self.global_limits:
                if b.dynamic is None:  # the common case: no tuple to make per request
                    checks.append(b.check(tag, every_cost))
                    continue
                # room for the route's limits, then the largest tier's and the meta limits
                after = max(map(len, self.tier_limits.values()), default=0) + len(self.meta_limits)
                room = MAX_LIMITS_PER_REQUEST - len(checks) - len(route_limits) - after
                for r in self._resolved(b, tag, None, room, plan, data):  # a callable's answer
                    checks.append(r.check(tag, every_cost))
        every = len(checks)  # the limits of every request
        identity: Identity | None = None
        itag = ""  # the identity's tag
        try:
            if (tiers and self.tier_limits) or needs_identity or self.meta_limits:
                identity = self.resolver.identify(req, self.hooks, data.client_ip)
                itag = self.identity_tag(identity.value)
                if identity.kind == "ip":  # an anonymous client: its identity is its address
                    data.client_ip = identity.value
            # DISTLIMIT_CONDITIONAL_COST=0: the request claims to revalidate, but only a 304
            # proves it; route limits reserve the cost now and give it back after a 304.
            revalidation = default_cost == 0 and bool(route_limits)
            if revalidation:
                plain = False
            if identity is not None and tiers:
                for b in self.tier_limits.get(identity.tier, ()):
                    checks.append(b.check(itag, every_cost))
            if plain:  # the common case: no option of a limit to call or resolve
                for b in route_limits:
                    checks.append(b.check(itag, default_cost))
                route_limits = ()
            fixed = len(route_limits)  # route limits not yet added (a room for dynamic values)
            for b in route_limits:
                fixed -= 1
                tag = itag
                spec = b.spec
                if spec.exempt_when and self._ask(b, "exempt_when", spec.exempt_when, None):
                    continue
                # Flask-Limiter's order: with deduct_when, a callable cost is called after the
                # response (it may read what the view sets); 1 is reserved meanwhile.
                cost_after = (
                    spec.deduct_when is not None and spec.settle is None and callable(spec.cost)
                )
                cost = 1 if cost_after else default_cost
                if spec.key_func is not None:
                    text = self._ask(b, "key_func", partial(_key_text, b, spec.key_func), _FAILED)
                    if text is None:  # no key: this request is not counted by this limit
                        continue
                    if not text and identity is None:  # it failed: counted under the identity
                        identity = self.resolver.identify(req, self.hooks, data.client_ip)
                        itag = self.identity_tag(identity.value)
                    tag = self.identity_tag(text) if text else itag
                if not cost_after and spec.cost is not None and b.algorithm != CONCURRENCY:
                    cost = self._ask(b, "cost", partial(_cost_value, b, default_cost), cost)
                if b.algorithm == CONCURRENCY:  # a slot, not a cost (defences.concurrency)
                    checks.append(slot_check(b, tag, self.settings.concurrency_lease))
                    continue
                unproved = revalidation and spec.cost is None  # free only if the answer is a 304
                # the common case
                if b.dynamic is None and not deduction.reserved(b, unproved=unproved):
                    checks.append(b.check(tag, cost))
                    continue
                # at least its first rate: a route's own limit never gives way to the others
                room = max(1, MAX_LIMITS_PER_REQUEST - len(checks) - fixed - len(self.meta_limits))
                tier = identity.tier if identity is not None else None
                for r in self._resolved(b, tag, tier, room, plan, data):  # a dynamic value's rates
                    check = r.check(tag, 1 if unproved else cost)
                    if deduction.reserved(r, unproved=unproved):  # reserved now, settled after
                        data.deferred[check.key] = deduction.Deferred(
                            check=check,
                            free_if_not_modified=unproved,
                            policy=plan.policy,
                            cost_after=cost_after,
                        )
                    checks.append(check)
        except HTTPException:  # the app's own answer (its identity loader's 401, a key_func's
            del checks[every:]  # 400): the request still spends the limits of every request
            data.unwritten()
            if checks:
                self.decider.decide(checks, None, plan.policy, data)
            raise
        if not checks:
            return
        simple = plain and (not every_request or self.every_plain)
        if self.meta_limits and data.meta_limits:  # the identity was resolved for them
            # After the others: a breach of any of them is counted in the same script call.
            checks += [
                Check(b.key(itag), b.algorithm, b.rate.amount, b.rate.period, meta=True, bound=b)
                for b in self.meta_limits
            ]
            simple = False
        self.decider.decide(checks, identity, plan.policy, data, simple=simple)

    def _resolved(
        self,
        b: BoundLimit,
        tag: str,
        tier: str | None,
        room: int,
        plan: RoutePlan,
        data: RequestData,
    ) -> Sequence[BoundLimit]:
        """``b``, or this request's limits of its callable or mapping value (none when it cannot
        be resolved: logged by the dynamic limit; then under the failure policy ``open`` the
        request is marked degraded (``X-RateLimit-Degraded``), under ``closed`` or ``local`` (no
        rate to enforce in-process) it is a 503)."""
        if b.dynamic is None:
            return (b,)
        try:
            return b.dynamic.resolve(tag, tier, self.local_clock(), self.dynamic_ttl_us, room)
        except LimitUnresolved:
            if (plan.policy or self.settings.failure_policy) != "open":
                self.refusals.unavailable(data, busy=False, unresolved=True)
            data.degraded = True
            return ()

    def _ask(self, b: BoundLimit, option: str, call: Callable[[], T], failed: T) -> T:
        """``call()``, ``option`` of ``b`` (the app's code); ``failed`` when it raises (or
        answers what is not a key or a cost), logged at ERROR at most once a minute per limit:
        the limit applies as if the option were not given, since a client may make it raise.
        An HTTP error it raises (``request.form["user"]``'s 400) is the answer."""
        try:
            return call()
        except HTTPException:
            raise
        except Exception as exc:
            if paced(self.paces, b.name, self.local_clock(), LOG_INTERVAL * 1_000_000):
                log.error(
                    "The rate limit %s: its %s raised %s: %s. The limit applies, as if that "
                    "option were not given. (Logged at most once a minute per limit.)",
                    b.name, option, type(exc).__name__, log_text(exc), exc_info=exc,
                )  # fmt: skip
            return failed

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
        view = self.plans.original_view(endpoint) if endpoint is not None else None
        return "OPTIONS" not in getattr(view, "required_methods", ())
