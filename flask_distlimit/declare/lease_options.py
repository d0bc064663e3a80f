"""``lease=`` on a declaration: which algorithms and values a quota lease accepts (start-up
errors); the leases themselves are :mod:`flask_distlimit.resilience.leases`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from flask_distlimit.core.algorithms import Algorithm
from flask_distlimit.engine.registry import REGISTRY
from flask_distlimit.errors import ConfigurationError

if TYPE_CHECKING:
    from flask_distlimit.core.limits import Rate

#: The algorithms a lease is defined for. Not the sliding window log: it stores the time of use of
#: every unit, and a leased unit's time of use is unknown when it is taken.
LEASABLE: Final[frozenset[Algorithm]] = frozenset(n for n, e in REGISTRY.items() if e.leasable)
#: ``lease=True`` caps a lease at the limit divided by this.
AUTO_CAP_DIVISOR: Final = 20


def check_lease_algorithm(algorithm: Algorithm, where: str) -> None:
    """Raise ``ConfigurationError`` if ``algorithm`` cannot be leased."""
    if algorithm not in LEASABLE:
        *names, last = (n for n in REGISTRY if n in LEASABLE)  # in the registry's order
        raise ConfigurationError(
            f"lease= on the limit on {where or 'a view'} with the algorithm {algorithm!r}: a "
            f"lease is defined for {', '.join(names)} and {last}. "
            "The sliding window log stores the time each unit is used, and a leased unit's time "
            "of use is not known when it is taken. Use another algorithm, or drop lease=."
        )


def check_lease(
    lease: object,
    rates: Sequence[Rate],
    what: str,
    *,
    dynamic: bool,
    deduct_when: bool,
    shadow: bool,
) -> None:
    """Validate ``lease=`` of a declaration (start-up errors, never request-time ones); its
    algorithm is checked by :class:`~flask_distlimit.declare.specs.LimitSpec`."""
    if lease is False:
        return
    if lease is not True and (not isinstance(lease, int) or lease < 1):
        raise ConfigurationError(
            f"{what}: lease={lease!r}: use True (sized from the traffic), False, or a number of "
            "units >= 1, e.g. lease=10."
        )
    for option, present in (
        ("a callable or mapping value", dynamic),
        ("deduct_when=, settle= or unit=", deduct_when),
        ("shadow=True", shadow),
    ):
        if present:
            raise ConfigurationError(
                f"{what}: lease= cannot be combined with {option} (a lease spends units taken "
                "in advance; use lease= on a plain, enforced limit)."
            )
    if isinstance(lease, int) and lease is not True:  # a number of units, checked above
        for rate in rates:
            if lease > rate.amount:
                raise ConfigurationError(
                    f"{what}: lease={lease} is more than the limit {rate}: a lease is a part of "
                    f"the limit; use at most {rate.amount} units, or lease=True (sized from the "
                    f"traffic, up to {auto_cap(rate.amount)})."
                )


def auto_cap(limit: int) -> int:
    """The largest lease ``lease=True`` takes of ``limit``."""
    return max(1, limit // AUTO_CAP_DIVISOR)
