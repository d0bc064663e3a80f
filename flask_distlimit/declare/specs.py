"""The record of a declared limit (:class:`LimitSpec`: its rates or per-request value, its
options checked, its target), the one object its options live in from the decorator to the check.

A spec comes from a decorator, a ``DISTLIMIT_*`` limit key or a tier. It is frozen and known by
identity (``eq=False``): the same limit declared twice is two specs.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def applies_to(self, method: str) -> bool:
        """Whether the limit applies to requests of this HTTP method (``methods=``)."""
        return self.methods is None or method in self.methods
