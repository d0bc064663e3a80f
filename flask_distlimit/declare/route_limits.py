"""What declared limits become for one route: :class:`BoundLimit` values in a :class:`RoutePlan`.

:func:`build_plan` binds an endpoint and method's declarations once (rate, algorithm, limit id,
key parts, header strings), so a request only hashes its identity and formats keys. Which
limits apply: docs/limits.md, "Which limits a request meets"; the ids: docs/design-notes.md,
"Limit ids".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Final, Literal

from flask_distlimit import _typing
from flask_distlimit.core.algorithms import CONCURRENCY, Algorithm
from flask_distlimit.core.decision import Check
from flask_distlimit.core.limits import Rate
from flask_distlimit.declare.dynamic_limits import DynamicLimit
from flask_distlimit.declare.keys import key_parts
from flask_distlimit.declare.policy_items import concurrency_policy_item, policy_item, sf_string
from flask_distlimit.declare.registry import ExemptionScope, LimitRegistry
from flask_distlimit.declare.specs import LimitSpec
from flask_distlimit.declare.targets import is_carrier, view_objects
from flask_distlimit.errors import ConfigurationError
from flask_distlimit.telemetry.metrics import limit_label

KeyedOn = Literal["ip", "identity", "func"]

#: How strict each failure policy is, to pick one when several limits of a route set one.
_STRICTNESS: dict[_typing.FailurePolicy, int] = {"open": 0, "local": 1, "closed": 2}
#: Checks of cost 1 kept per bound limit, by identity tag (the same clients come back; a frozen
#: Check and its key cost ~0.7 us to build). Emptied when full: at most this many per limit.
_CHECKS_KEPT = 512


#: The options of a bound limit declared without any (the fleet's slots).
NO_OPTIONS: Final = LimitSpec(kind="global", rates=())


@dataclass(frozen=True, slots=True)
class BoundLimit:
    """One rate of one spec, bound to an app's settings and (for route limits) an endpoint."""

    name: str  #: policy name in headers, logs and ``violated-policies``, e.g. ``orders:100/minute``
    limit_id: str
    rate: Rate
    algorithm: Algorithm
    keyed_on: KeyedOn
    key_head: str  #: ``<prefix>:{``
    key_tail: str  #: ``}:<limit id>:<algorithm>``
    policy: str  #: the ``RateLimit-Policy`` item
    quoted: str  #: the name as a structured-field string
    #: the declared limit it is a rate of: its options (``key_func``, ``cost``, ``shadow``,
    #: ``lease``...) are read there, stated once
    spec: LimitSpec = NO_OPTIONS
    #: a callable or mapping value: the limits of a request come from ``dynamic.resolve``
    #: (this one is a placeholder, never checked itself)
    dynamic: DynamicLimit[BoundLimit] | None = None
    _unit_checks: dict[str, Check] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    #: the ``limit`` label of its metrics, as :func:`~flask_distlimit.telemetry.metrics.limit_label`
    #: reads it from any of its keys (worked out once, not per decision)
    label: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "label", limit_label(self.key_head + self.key_tail))

    @property
    def plain(self) -> bool:
        """A rate limit on the request's identity with nothing to call or resolve per request
        (no ``key_func``, cost function, ``exempt_when``, dynamic value, ``deduct_when`` or
        ``settle``),
        neither a concurrency limit nor a shadow one: the request path's common case."""
        spec = self.spec
        return (
            spec.key_func is None
            and spec.cost is None
            and spec.exempt_when is None
            and self.dynamic is None
            and spec.deduct_when is None
            and spec.settle is None
            and spec.unit == "requests"
            and not spec.shadow
            and self.algorithm != CONCURRENCY
        )

    @property
    def most_rates(self) -> int:
        """The most limits this one puts in a request (a dynamic value's largest known)."""
        return 1 if self.dynamic is None else self.dynamic.value.most_rates()

    @property
    def needs_identity(self) -> bool:
        """The request's identity is needed: for the key, or for a mapping's tier."""
        return self.spec.key_func is None or (
            self.dynamic is not None and self.dynamic.value.by_tier
        )

    def key(self, tag: str) -> str:
        """The storage key for an identity tag (the app's
        :attr:`~flask_distlimit.state.LimiterState.identity_tag` of an identity text, whose kind
        comes first: :mod:`flask_distlimit.declare.keys`)."""
        return self.key_head + tag + self.key_tail

    def check(self, tag: str, cost: int) -> Check:
        """The :class:`~flask_distlimit.core.decision.Check` of this limit for an identity tag
        (a cost of 1, the usual one, kept per tag)."""
        kept = self._unit_checks
        if cost == 1:
            found = kept.get(tag)
            if found is not None:
                return found
        check = Check(
            self.key(tag),
            self.algorithm,
            self.rate.amount,
            self.rate.period,
            cost,
            self.spec.shadow,
            bound=self,
        )
        if cost == 1:
            if len(kept) >= _CHECKS_KEPT:
                kept.clear()
            kept[tag] = check
        return check


def _call_scope(spec: LimitSpec, endpoint: str) -> str:
    """A ``scope`` callable's answer for ``endpoint``, or ``ConfigurationError``."""
    func = spec.scope
    assert callable(func)
    name = getattr(func, "__qualname__", func)
    try:
        scope = func(endpoint)
    except Exception as exc:
        raise ConfigurationError(
            f"The scope callable {name!r} of the limit on {spec.declared_on} raised "
            f"{type(exc).__name__}: {exc} for the endpoint {endpoint!r}. It is called with the "
            "endpoint when the route's limits are bound and must answer a non-empty string."
        ) from exc
    if not isinstance(scope, str) or not scope:
        raise ConfigurationError(
            f"The scope callable {name!r} of the limit on {spec.declared_on} answered "
            f"{scope!r} for the endpoint {endpoint!r}: it must answer a non-empty string."
        )
    return scope


def bind(
    spec: LimitSpec,
    *,
    prefix: str,
    default_algorithm: Algorithm,
    label: str,
    method: str | None = None,
    shadow: bool = False,
) -> list[BoundLimit]:
    """The bound limits of ``spec``; ``label`` is the endpoint (ignored when scoped);
    ``shadow`` makes them shadow limits whatever the spec says (``DISTLIMIT_SHADOW = True``)."""
    if shadow and not spec.shadow:
        spec = replace(spec, shadow=True)
    algorithm = spec.algorithm or default_algorithm
    keyed_on: KeyedOn = "identity"
    if spec.kind == "global":
        id_head, name_head, keyed_on = "g", "global", "ip"
    elif spec.kind == "tier":
        id_head, name_head = f"t:{spec.tier}", f"tier-{spec.tier}"
    elif spec.kind == "meta":  # DISTLIMIT_META_LIMITS: breaches counted per identity
        id_head, name_head = "m", "meta"
    else:
        if spec.scope is not None:
            scope = spec.scope if isinstance(spec.scope, str) else _call_scope(spec, label)
            id_head, name_head = f"s:{scope}", scope
        else:
            id_head, name_head = f"r:{label}", label
        if spec.per_method and method is not None:
            # Flask answers HEAD with the GET view: one counter for both, or it runs twice
            counted = "GET" if method == "HEAD" else method
            id_head += f":{counted}"
            name_head += f":{counted}"
        if spec.key_func is not None:
            keyed_on = "func"

    def bound(
        spec: LimitSpec,
        rate: Rate,
        name: str,
        limit_id: str,
        policy: str,
        dynamic: DynamicLimit[BoundLimit] | None = None,
    ) -> BoundLimit:
        head, tail = key_parts(prefix, limit_id, algorithm)  # so keys stay in one format
        return BoundLimit(
            name=name,
            limit_id=limit_id,
            rate=rate,
            algorithm=algorithm,
            keyed_on=keyed_on,
            key_head=head,
            key_tail=tail,
            policy=policy,
            quoted=sf_string(name),
            spec=spec,
            dynamic=dynamic,
        )

    def each_rate(spec: LimitSpec, id_head: str) -> tuple[BoundLimit, ...]:
        rates: list[BoundLimit] = []
        for rate in spec.rates:
            if algorithm == CONCURRENCY:  # not a rate: N in flight (defences.concurrency)
                name = f"{name_head}:{rate.amount} in flight"
                limit_id = f"{id_head}:c{rate.amount}"
                policy = concurrency_policy_item(name, rate.amount)
            else:
                name = f"{name_head}:{rate}"
                limit_id = f"{id_head}:{rate.amount}/{rate.period}"
                if spec.unit != "requests":  # its own counter and name beside a limit of requests
                    limit_id, name = f"{limit_id}:bytes", f"{name} {spec.unit}"
                policy = policy_item(name, rate.amount, rate.period, spec.unit)
            rates.append(bound(spec, rate, name, limit_id, policy))
        return tuple(rates)

    if spec.dynamic is None:
        return list(each_rate(spec, id_head))
    static = replace(spec, dynamic=None)
    resolver: DynamicLimit[BoundLimit] = DynamicLimit(
        spec.dynamic,
        lambda rates: each_rate(replace(static, rates=rates), id_head + ":dyn"),
        algorithm=algorithm,
        name=f"{name_head}:{spec.dynamic.described}",
    )
    # Rate(1, 1) is a placeholder: the request's rates come from the resolver
    return [bound(spec, Rate(1, 1), resolver.name, id_head + ":dyn", "", resolver)]


def distinct(
    bound: Iterable[BoundLimit], prefix: str, order: Sequence[tuple[object, ...]] = ()
) -> tuple[BoundLimit, ...]:
    """``bound`` with a key space of its own for each limit of one rate and algorithm after
    the first (among the ``key_func`` limits, and among the others): the second and later of
    them get ``:k2``, ``:k3``... after their limit id, in the order of ``order`` (the
    :func:`signature` of every limit that may share their ids, whatever the method asking;
    default: ``bound``'s own). A shared limit's scope names its counter, whatever declares
    it (Flask-Limiter's): never a suffix.

    A ``key_func``'s answer is tagged ``func:<value>`` whatever the function, so without this a
    per-tenant and a per-user limit of ``2/minute`` on one route would count tenant ``x`` and
    user ``x`` together; two limits of one rate and other options (one of every request and a
    ``deduct_when`` one) would count on one key. Declaration order is the same in every
    process, so are the ids. A route's dynamic values are all bound under ``:dyn``: each after
    the first gets its suffix.
    """
    bound = list(bound)
    ranked = list(dict.fromkeys((*order, *map(signature, bound))))  # those order lacks: after
    out = []
    for b in bound:
        sig = signature(b)
        same = [s for s in ranked if s[:3] == sig[:3]]  # one key space
        n = 1 if b.spec.scope is not None else same.index(sig) + 1
        out.append(_kth(b, n, prefix) if n > 1 else b)
    return tuple(out)


def signature(b: BoundLimit) -> tuple[object, ...]:
    """What tells ``b`` apart: its key space (limit id, algorithm, whether a ``key_func`` keys
    it) and every option of its spec but where it was declared (a callable by identity)."""
    options = (getattr(b.spec, f.name) for f in fields(LimitSpec) if f.name != "declared_on")
    keyed = b.spec.key_func is None
    return (b.limit_id, b.algorithm, keyed, *(id(v) if callable(v) else v for v in options))


def _kth(b: BoundLimit, n: int, prefix: str) -> BoundLimit:
    """``b`` with ``:k<n>`` after its limit id and its name (a policy name names one counter): a
    dynamic value's, after each limit it resolves."""
    limit_id, name = f"{b.limit_id}:k{n}", f"{b.name}:k{n}"
    quoted = sf_string(name)
    policy = quoted + b.policy[len(b.quoted) :] if b.policy else ""
    head, tail = key_parts(prefix, limit_id, b.algorithm)
    dynamic = b.dynamic
    if dynamic is not None:
        make = dynamic.make
        dynamic = replace(
            dynamic, make=lambda rates: tuple(_kth(r, n, prefix) for r in make(rates))
        )
    return replace(b, name=name, quoted=quoted, policy=policy, limit_id=limit_id, key_head=head,
                   key_tail=tail, dynamic=dynamic)  # fmt: skip


def strictest(policies: Iterable[_typing.FailurePolicy | None]) -> _typing.FailurePolicy | None:
    """The strictest of the ``on_failure`` policies a route's limits set, if any."""
    return max((p for p in policies if p is not None), key=_STRICTNESS.__getitem__, default=None)


@dataclass(frozen=True, slots=True)
class RoutePlan:
    """The route-layer limits of one endpoint and method (global and tier limits come apart)."""

    exempt: bool
    limits: tuple[BoundLimit, ...] = ()
    #: the strictest ``on_failure`` of the limits, if any
    policy: _typing.FailurePolicy | None = None
    needs_identity: bool = False  #: some limit keys on the request's identity (no key_func)
    #: the objects (wrappers) whose limits this plan holds: they need not enforce them again
    covered: frozenset[object] = frozenset()
    #: every limit is a plain rate limit on the identity (see :attr:`BoundLimit.plain`)
    plain: bool = False
    #: limit wrappers below another decorator whose limits call app code: decided when the
    #: wrapper runs, with these specs (as prepared for the method), not with the route's
    inner: Mapping[object, tuple[LimitSpec, ...]] = field(default_factory=dict)
    #: the global and tier limits apply (not lifted by ``ExemptionScope.APPLICATION``)
    app_limits: bool = True
    #: the meta limits apply (not lifted by ``ExemptionScope.META``)
    meta_limits: bool = True
    #: the endpoint's limits that may share ids, as :func:`distinct` numbers them (its own,
    #: the limits wrappers and ``with`` blocks decided apart from the gate's call are numbered by)
    order: tuple[tuple[object, ...], ...] = ()


def build_plan(
    registry: LimitRegistry,
    *,
    endpoint: str,
    view: object | None,
    blueprints: Sequence[object],
    method: str,
    default_limits: Iterable[LimitSpec],
    prefix: str,
    default_algorithm: Algorithm,
    shadow: bool = False,
) -> RoutePlan:
    """Bind the limits of one endpoint and method.

    ``view`` is the app's view function for the endpoint (as registered, before the extension
    wrapped it); ``blueprints`` the blueprint objects the endpoint is registered through,
    innermost first.
    """
    every, one = registry.attached(view, method)  # none for no view
    found = [*every, *one]
    covered = frozenset(o for o in found if o in registry.views)  # limit wrappers among them
    if any(o in registry.exempt_views for o in found) or any(
        bp in registry.exempt_blueprints for bp in blueprints
    ):
        return RoutePlan(exempt=True, covered=covered)
    scope, inherited = _scope(registry, found, blueprints)
    if scope & ExemptionScope.DEFAULT:
        default_limits = ()
    # A limit wrapper below another decorator, with an option that calls app code per request,
    # is decided where it runs, after that decorator (which may set what the code reads), as
    # Flask-Limiter decides it: its limits are the plan's ``inner``, not decided by the gate.
    chain = {id(o) for part in view_objects(view, method) for o in part}
    specs: list[LimitSpec] = []
    mine: list[LimitSpec] = []  # the endpoint's own, of every method
    inner: dict[object, list[LimitSpec]] = {}
    seen_specs: set[int] = set()
    for objects, per_method in ((every, False), (one, True)):
        for o in objects:
            declared = registry.views.get(o, ())
            nested = o is not view and id(o) in chain and is_carrier(o)
            into = (
                inner.setdefault(o, [])
                if nested and any(s.reads_request for s in declared)
                else specs
            )
            for spec in declared:
                if id(spec) not in seen_specs:
                    seen_specs.add(id(spec))
                    mine.append(replace(spec, per_method=True) if per_method else spec)
                    if spec.applies_to(method):
                        into.append(mine[-1])
    # methods=[...]: a limit applies to those methods only; a route none of whose limits
    # applies to this method falls back to its blueprint's, then to the defaults.
    # override_defaults=False on every limit found so far: the next layer's limits (the
    # innermost limited blueprint's, its limited parents' outwards, then the defaults) apply
    # beside them, as in Flask-Limiter.
    inner_specs = {o: tuple(ss) for o, ss in inner.items()}
    inner_all = [s for ss in inner.values() for s in ss]
    # the layers: each blueprint's limits (innermost first), then the defaults
    for layer in (*(registry.blueprints.get(bp, ()) for bp in inherited), default_limits):
        if any(spec.override_defaults for spec in (*specs, *inner_all)):
            break
        specs += [s for s in layer if s.applies_to(method)]

    def bound_all(specs: Iterable[LimitSpec]) -> Iterable[BoundLimit]:
        for spec in specs:
            yield from bind(
                spec,
                prefix=prefix,
                default_algorithm=default_algorithm,
                label=endpoint,
                method=method,
                shadow=shadow,
            )

    # a repeat of a limit (its rate and every option the same) counts once; another limit of
    # that rate with other options (a deduct_when one beside one of every request) apart
    firsts: dict[tuple[object, ...], BoundLimit] = {}
    for b in bound_all(specs):
        firsts.setdefault(signature(b), b)
    bound = list(firsts.values())
    # Its rank among every limit of the endpoint that may share its ids, for every method, so
    # that a limit keeps one key beside a methods=[...] filter of its rate.
    layers = [s for bp in inherited for s in registry.blueprints.get(bp, ())]
    order = tuple(signature(b) for b in bound_all((*mine, *layers, *default_limits)))
    limits = distinct(bound, prefix, order)
    return RoutePlan(
        exempt=False,
        limits=limits,
        policy=strictest(spec.on_failure for spec in (*specs, *inner_all)),
        needs_identity=any(b.needs_identity for b in bound),
        covered=covered - inner_specs.keys(),
        plain=all(b.plain for b in limits),
        inner=inner_specs,
        app_limits=not scope & ExemptionScope.APPLICATION,
        meta_limits=not scope & ExemptionScope.META,
        order=order,
    )


def _scope(
    registry: LimitRegistry, found: Sequence[object], blueprints: Sequence[object]
) -> tuple[ExemptionScope, Sequence[object]]:
    """The partial exemptions that reach a route (its view's, its blueprint's, and those of
    outer blueprints marked ``DESCENDENTS``), and the blueprints whose limits it inherits."""
    none = ExemptionScope.NONE
    scope = none
    for o in found:
        scope |= registry.scopes.get(o, none)
    inherited = () if scope & ExemptionScope.ANCESTORS else blueprints
    for i, bp in enumerate(blueprints):
        flags = registry.scopes.get(bp, none)
        if i == 0:
            if flags & ExemptionScope.ANCESTORS:
                inherited = inherited[:1]
            scope |= flags
        elif flags & ExemptionScope.DESCENDENTS:
            scope |= flags & ~ExemptionScope.ANCESTORS
    return scope, inherited
