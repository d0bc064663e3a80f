"""Declared limits and what they become for one route.

A :class:`LimitSpec` is one declaration: a ``@limiter.limit`` or ``shared_limit`` on a view or a
blueprint, ``DISTLIMIT_DEFAULT_LIMITS``, ``DISTLIMIT_GLOBAL_LIMITS`` or a ``DISTLIMIT_TIERS``
entry. Declarations are stored in a :class:`LimitRegistry` on the ``Limiter`` (decorators run at
import time, before or after ``init_app``).

For one app, endpoint and method, :func:`build_plan` binds them once into a :class:`RoutePlan` of
:class:`BoundLimit` values: rate, algorithm, limit id, storage-key parts and header strings all
computed then, so a request only hashes its identity and formats keys.

Which limits apply to a request (documented in the user guide too):

1. ``DISTLIMIT_GLOBAL_LIMITS``, keyed on the client IP, on every non-exempt request;
2. the tier limits (``DISTLIMIT_TIERS``) of the request's identity, on every non-exempt request;
3. the route's own limits (``@limiter.limit`` / ``shared_limit`` on the view); if it has none,
   the limits of its innermost limited blueprint; if none either, ``DISTLIMIT_DEFAULT_LIMITS``.

Limit ids make the same declared limit hit the same key from every worker and replica:

- route, blueprint and default limits: ``r:<endpoint>[:<METHOD>]:<amount>/<period>``, one counter
  per route;
- a ``scope`` (``shared_limit`` or ``limit(..., scope=...)``): ``s:<scope>[:<METHOD>]:...``, one
  counter for every route that names the scope;
- global: ``g:<amount>/<period>``; tier: ``t:<tier>:<amount>/<period>``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from .algorithms import Algorithm, check_rate
from .decision import Check
from .guard import FailurePolicy
from .headers import policy_item, sf_string
from .keys import limit_key
from .limits import Rate

__all__ = [
    "EXEMPT",
    "BoundLimit",
    "CostFunc",
    "ExemptWhen",
    "KeyFunc",
    "LimitKind",
    "LimitRegistry",
    "LimitSpec",
    "RoutePlan",
    "bind",
    "build_plan",
    "view_name",
]

KeyFunc = Callable[[], str]
CostFunc = Callable[[], int]
ExemptWhen = Callable[[], bool]
LimitKind = Literal["route", "shared", "blueprint", "default", "global", "tier"]
KeyedOn = Literal["ip", "identity", "func"]

#: How strict each failure policy is, to pick one when several limits of a route set one.
_STRICTNESS: dict[FailurePolicy, int] = {"open": 0, "local": 1, "closed": 2}
#: Checks of cost 1 kept per bound limit, by identity tag (the same clients come back; a frozen
#: Check and its key cost ~0.7 us to build). Emptied when full: at most this many per limit.
_CHECKS_KEPT = 512


@dataclass(frozen=True, slots=True)
class LimitSpec:
    """One declared limit (one or more rates) and its options."""

    kind: LimitKind
    rates: tuple[Rate, ...]
    algorithm: Algorithm | None = None
    key_func: KeyFunc | None = None
    cost: int | CostFunc | None = None  #: None: 1, or DISTLIMIT_CONDITIONAL_COST when conditional
    scope: str | None = None
    per_method: bool = False
    exempt_when: ExemptWhen | None = None
    on_failure: FailurePolicy | None = None
    tier: str | None = None  #: for kind "tier"

    def __post_init__(self) -> None:
        if self.algorithm is not None:
            self.check_rates(self.algorithm)

    def check_rates(self, algorithm: Algorithm) -> None:
        """Raise ``ConfigurationError`` if ``algorithm`` cannot enforce one of the rates."""
        for rate in self.rates:
            check_rate(algorithm, rate)


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
    key_func: KeyFunc | None = None
    cost: int | CostFunc | None = None
    exempt_when: ExemptWhen | None = None
    _unit_checks: dict[str, Check] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def key(self, tag: str) -> str:
        """The storage key for an identity tag (:func:`flask_distlimit.keys.identity_tag`)."""
        return self.key_head + tag + self.key_tail

    def check(self, tag: str, cost: int) -> Check:
        """The :class:`~flask_distlimit.decision.Check` of this limit for an identity tag."""
        if cost != 1:
            return Check(self.key(tag), self.algorithm, self.rate.amount, self.rate.period, cost)
        kept = self._unit_checks
        found = kept.get(tag)
        if found is None:
            if len(kept) >= _CHECKS_KEPT:
                kept.clear()
            found = Check(self.key(tag), self.algorithm, self.rate.amount, self.rate.period, 1)
            kept[tag] = found
        return found


def bind(
    spec: LimitSpec,
    *,
    prefix: str,
    default_algorithm: Algorithm,
    label: str,
    method: str | None = None,
) -> list[BoundLimit]:
    """The bound limits of ``spec``; ``label`` is the endpoint (ignored when scoped)."""
    algorithm = spec.algorithm or default_algorithm
    keyed_on: KeyedOn = "identity"
    if spec.kind == "global":
        id_head, name_head, keyed_on = "g", "global", "ip"
    elif spec.kind == "tier":
        id_head, name_head = f"t:{spec.tier}", f"tier-{spec.tier}"
    else:
        if spec.scope is not None:
            id_head, name_head = f"s:{spec.scope}", spec.scope
        else:
            id_head, name_head = f"r:{label}", label
        if spec.per_method and method is not None:
            id_head += f":{method}"
            name_head += f":{method}"
        if spec.key_func is not None:
            keyed_on = "func"
    bound: list[BoundLimit] = []
    for rate in spec.rates:
        limit_id = f"{id_head}:{rate.amount}/{rate.period}"
        name = f"{name_head}:{rate}"
        # The key parts come from keys.limit_key itself, so keys stay in one format.
        full = limit_key(prefix, "", limit_id, algorithm)
        head = f"{prefix}:{{"
        tail = full[full.index("}", len(head)) :]
        bound.append(
            BoundLimit(
                name=name,
                limit_id=limit_id,
                rate=rate,
                algorithm=algorithm,
                keyed_on=keyed_on,
                key_head=head,
                key_tail=tail,
                policy=policy_item(name, rate.amount, rate.period),
                quoted=sf_string(name),
                key_func=spec.key_func,
                cost=spec.cost,
                exempt_when=spec.exempt_when,
            )
        )
    return bound


def view_name(view: object) -> str:
    """The name of a view function or class: ``<module>.<qualname>``."""
    module = getattr(view, "__module__", None) or "?"
    qualname = getattr(view, "__qualname__", None) or getattr(view, "__name__", None) or repr(view)
    return f"{module}.{qualname}"


def _hashable(obj: object) -> bool:
    try:
        hash(obj)
    except TypeError:
        return False
    return True


def _unwrapped(view: object) -> list[object]:
    """``view``, the functions it wraps (``functools.wraps``) and its view class, if any
    (hashable ones only: they are looked up by identity)."""
    found: list[object] = []
    current: object | None = view
    while current is not None and len(found) < 16 and not any(current is f for f in found):
        found.append(current)
        view_class = getattr(current, "view_class", None)
        if view_class is not None:
            found.append(view_class)
        current = getattr(current, "__wrapped__", None)
    return [f for f in found if _hashable(f)]


@dataclass
class LimitRegistry:
    """Every limit declared through one ``Limiter``: by view object (and its name), and by
    blueprint name.

    A view is found by identity first (itself, what it wraps through ``functools.wraps``, its
    view class), so views made by one factory keep their own limits; by name
    (``<module>.<qualname>``) only when none of those objects was declared, for wrappers that
    do not use ``functools.wraps``.
    """

    views: dict[object, list[LimitSpec]] = field(default_factory=dict)
    names: dict[str, list[LimitSpec]] = field(default_factory=dict)
    blueprints: dict[str, list[LimitSpec]] = field(default_factory=dict)
    exempt_views: set[object] = field(default_factory=set)
    exempt_names: set[str] = field(default_factory=set)
    exempt_blueprints: set[str] = field(default_factory=set)

    def add_view(self, view: object, spec: LimitSpec) -> None:
        if _hashable(view):
            self.views.setdefault(view, []).append(spec)
        self.names.setdefault(view_name(view), []).append(spec)

    def exempt_view(self, view: object) -> None:
        if _hashable(view):
            self.exempt_views.add(view)
        self.exempt_names.add(view_name(view))

    def add_blueprint(self, name: str, spec: LimitSpec) -> None:
        self.blueprints.setdefault(name, []).append(spec)

    def declared(self) -> list[LimitSpec]:
        """Every spec declared so far, on views and blueprints."""
        return [
            spec
            for table in (self.views, self.names, self.blueprints)
            for specs in table.values()
            for spec in specs
        ]

    def view_specs(self, view: object) -> tuple[bool, list[LimitSpec]]:
        """(exempt, declared specs) of a registered view function."""
        objects = _unwrapped(view)
        if any(o in self.exempt_views for o in objects):
            return True, []
        specs = [s for o in objects for s in self.views.get(o, ())]
        if specs:
            return False, specs
        names = [view_name(o) for o in objects]
        if any(n in self.exempt_names for n in names):
            return True, []
        return False, [s for n in names for s in self.names.get(n, ())]


@dataclass(frozen=True, slots=True)
class RoutePlan:
    """The route-layer limits of one endpoint and method (global and tier limits come apart)."""

    exempt: bool
    limits: tuple[BoundLimit, ...] = ()
    policy: FailurePolicy | None = None  #: the strictest ``on_failure`` of the limits, if any
    needs_identity: bool = False  #: some limit keys on the request's identity (no key_func)


EXEMPT = RoutePlan(exempt=True)


def _blueprint_matches(registered: str, dotted: str) -> bool:
    return dotted == registered or dotted.endswith("." + registered)


def build_plan(
    registry: LimitRegistry,
    *,
    endpoint: str | None,
    view: object | None,
    blueprints: Sequence[str],
    method: str,
    default_limits: Iterable[LimitSpec],
    prefix: str,
    default_algorithm: Algorithm,
) -> RoutePlan:
    """Bind the limits of one endpoint and method.

    ``blueprints`` are the request's blueprint names, innermost first (``request.blueprints``).
    ``endpoint`` None (no route matched: a 404 or 405) gets no route limits.
    """
    if endpoint is None:
        return RoutePlan(exempt=False)
    exempt, specs = registry.view_specs(view) if view is not None else (False, [])
    if exempt:
        return EXEMPT
    if any(
        _blueprint_matches(bp, dotted) for dotted in blueprints for bp in registry.exempt_blueprints
    ):
        return EXEMPT
    if not specs:
        for dotted in blueprints:  # innermost first
            for bp, bp_specs in registry.blueprints.items():
                if _blueprint_matches(bp, dotted):
                    specs.extend(bp_specs)
            if specs:
                break
    if not specs:
        specs = list(default_limits)
    bound: list[BoundLimit] = []
    seen: set[str] = set()
    policy: FailurePolicy | None = None
    for spec in specs:
        for b in bind(
            spec,
            prefix=prefix,
            default_algorithm=default_algorithm,
            label=endpoint,
            method=method,
        ):
            dedupe = f"{b.limit_id}|{b.algorithm}|{id(b.key_func)}"
            if dedupe not in seen:
                seen.add(dedupe)
                bound.append(b)
        if spec.on_failure is not None and (
            policy is None or _STRICTNESS[spec.on_failure] > _STRICTNESS[policy]
        ):
            policy = spec.on_failure
    return RoutePlan(
        exempt=False,
        limits=tuple(bound),
        policy=policy,
        needs_identity=any(b.key_func is None for b in bound),
    )
