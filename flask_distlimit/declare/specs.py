"""The records of a declaration: its options as given (:class:`LimitOptions`) and the limit it
declares (:class:`LimitSpec`: its rates or per-request value, its options checked, its target).

A spec comes from a decorator, a ``DISTLIMIT_*`` limit key or a tier. It is frozen and known by
identity (``eq=False``): the same limit declared twice is two specs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from flask_distlimit._typing import (
    CostFunc,
    DeductWhen,
    ErrorMessage,
    ExemptWhen,
    FailurePolicy,
    KeyFunc,
    LimitBreachHook,
    LimitKind,
    ScopeFunc,
    Settle,
    Unit,
)
from flask_distlimit.core.algorithms import Algorithm
from flask_distlimit.core.limits import Rate
from flask_distlimit.declare.dynamic_limits import DynamicValue
from flask_distlimit.declare.lease_options import check_lease_algorithm
from flask_distlimit.engine.registry import check_rate

__all__ = ["LimitOptions", "LimitSpec"]


@dataclass(frozen=True, slots=True, eq=False)
class LimitSpec:
    """One declared limit (one or more rates) and its options."""

    kind: LimitKind
    rates: tuple[Rate, ...]
    algorithm: Algorithm | None = None
    key_func: KeyFunc | None = None
    cost: int | CostFunc | None = None  #: None: 1, or DISTLIMIT_CONDITIONAL_COST when conditional
    scope: str | ScopeFunc | None = None
    per_method: bool = False
    exempt_when: ExemptWhen | None = None
    on_failure: FailurePolicy | None = None
    tier: str | None = None  #: for kind "tier"
    declared_on: str = ""  #: what the limit was declared on, for messages
    #: a callable or mapping value (then ``rates`` is empty):
    #: :mod:`~flask_distlimit.declare.dynamic_limits`
    dynamic: DynamicValue | None = None
    deduct_when: DeductWhen | None = None  #: reserved before the view, given back if false
    settle: Settle | None = None  #: the real cost, settled after the response
    unit: Unit = "requests"  #: "content-bytes": the bytes of the body sent, settled after it
    methods: frozenset[str] | None = None  #: the HTTP methods it applies to (None: every one)
    override_defaults: bool = True  #: False: DISTLIMIT_DEFAULT_LIMITS apply beside it
    on_breach: LimitBreachHook | None = None  #: this limit's own breach hook
    error_message: ErrorMessage | None = None  #: the 429's detail when this limit refuses
    shadow: bool = False  #: counted, never refuses (:mod:`flask_distlimit.defences.shadow`)
    #: quota leasing (:mod:`flask_distlimit.resilience.leases`): False, True (sized from the
    #: traffic) or a fixed number of units
    lease: bool | int = False

    def __post_init__(self) -> None:
        if self.algorithm is not None:
            self.check_rates(self.algorithm)

    def check_rates(self, algorithm: Algorithm) -> None:
        """Raise ``ConfigurationError`` if ``algorithm`` cannot enforce one of the rates."""
        for rate in self.rates:
            check_rate(algorithm, rate)
        if self.lease is not False:
            check_lease_algorithm(algorithm, self.declared_on)
        if self.dynamic is not None:
            self.dynamic.check_algorithm(algorithm)

    @property
    def rate_count(self) -> int:
        """How many limits this spec puts in a request (at most, for a dynamic value)."""
        return self.dynamic.most_rates() if self.dynamic is not None else len(self.rates)

    @property
    def reads_request(self) -> bool:
        """Some option is app code called per request before the view (a callable value, a
        ``key_func``, a ``cost`` or ``exempt_when`` callable): it may read what a decorator
        above the limit sets (``g.api_key``)."""
        return bool(
            (self.dynamic is not None and self.dynamic.source is not None)
            or self.key_func is not None
            or callable(self.cost)
            or self.exempt_when is not None
        )

    def shown(self) -> str:
        """The value as written, for messages and listings."""
        if self.dynamic is not None:
            return self.dynamic.described
        return "; ".join(str(r) for r in self.rates)

    def with_kind(self, kind: LimitKind, *, per_method: bool | None = None) -> LimitSpec:
        """This spec as another kind (and maybe counted per method)."""
        return replace(
            self, kind=kind, per_method=self.per_method if per_method is None else per_method
        )


@dataclass(frozen=True, slots=True)
class LimitOptions:
    """The keyword options of ``limit`` and ``shared_limit`` as the caller gave them, unchecked
    (:func:`~flask_distlimit.declare.options.check_options` checks them). The fields are the
    methods' keyword parameters, with their defaults; :meth:`given` reads them from the
    method's arguments."""

    algorithm: str | None = None
    key_func: KeyFunc | None = None
    cost: int | CostFunc | None = None
    scope: str | ScopeFunc | None = None
    per_method: bool = False
    exempt_when: ExemptWhen | None = None
    on_failure: str | None = None
    fallback: str | None = None
    deduct_when: DeductWhen | None = None
    settle: Settle | None = None
    unit: str = "requests"
    methods: Iterable[str] | None = None
    override_defaults: bool = True
    on_breach: LimitBreachHook | None = None
    error_message: ErrorMessage | None = None
    shadow: bool = False
    lease: bool | int = False

    @classmethod
    def given(cls, arguments: Mapping[str, Any]) -> LimitOptions:
        """The options among a decorator method's arguments (its ``locals()`` on entry: ``self``,
        the limit value and one value per field). The method's signature types them for callers
        and mypy; this reads them without listing them again. A parameter that is not a field,
        or a field that is not a parameter, is a bug of this package: ``TypeError``."""
        unknown = arguments.keys() - _FIELDS - {"self", "value"}
        missing = _FIELDS - arguments.keys()
        if unknown or missing:
            raise TypeError(
                f"LimitOptions: parameters without a field {sorted(unknown)}, fields without a "
                f"parameter {sorted(missing)}"
            )
        return cls(**{name: arguments[name] for name in _FIELDS})


_FIELDS = frozenset(f.name for f in fields(LimitOptions))
