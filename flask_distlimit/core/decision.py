"""What goes into a storage call (:class:`Check`) and what comes out (:class:`Evaluation`).

One call evaluates a request's checks atomically (all-or-nothing: if any is denied, nothing is
consumed anywhere) and answers one :class:`Decision` per check, in the same order. Times inside
the storage are integer microseconds; a :class:`Decision` exposes seconds.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

from flask_distlimit.core.algorithms import Algorithm
from flask_distlimit.frozen import slot_init

#: ``retry_after`` of a request that can never pass: its cost is larger than the limit.
NEVER = math.inf
_ALLOWED = operator.attrgetter("allowed")


@slot_init
@dataclass(frozen=True, slots=True)
class Check:
    """One limit to apply to one request.

    ``key`` is the storage key of this limit for this client, built by
    :func:`flask_distlimit.declare.keys.limit_key` (``<prefix>:{<tag>}:<limit id>:<algorithm>``).
    ``cost`` is how many units the request consumes; 0 is a peek that consumes nothing.
    ``shadow``: decided and counted as if enforced, but never denies the request
    (:mod:`flask_distlimit.defences.shadow`); its :class:`Decision` says whether it would have.
    """

    key: str
    algorithm: Algorithm
    limit: int
    period: int  # seconds
    cost: int = 1
    shadow: bool = False
    #: a concurrency slot's token (:mod:`flask_distlimit.defences.concurrency`), drawn per request;
    #: 0 for a rate limit
    token: int = 0
    #: give back the slot ``token`` took (the request ended) instead of taking one, or a rate
    #: limit's ``cost`` units (a reservation settled lower); never denies
    release: bool = False
    #: a meta limit (``DISTLIMIT_META_LIMITS``): counts one breach when another check of the
    #: call denies the request (or, in a refund, another slot group did), refuses it when
    #: exhausted, and is never charged otherwise
    meta: bool = False
    #: charge ``cost`` whatever is left, past the limit if need be (a reservation settled
    #: higher: the quota goes into debt); never denies
    debt: bool = False
    #: the declared limit it applies (a :class:`~flask_distlimit.declare.route_limits.BoundLimit`)
    #: on the request path, for its name, policy and headers; ``None`` elsewhere. Not compared.
    bound: Any = field(default=None, compare=False, repr=False)


@slot_init
@dataclass(frozen=True, slots=True)
class Decision:
    """The state of one limit after (or, when denied, instead of) consuming the request's cost.

    - ``allowed``: this limit alone would admit the request. In an :class:`Evaluation` that is
      denied overall, nothing was consumed, even for the checks whose ``allowed`` is true.
    - ``remaining``: whole units left now (after consumption when the evaluation was allowed).
    - ``reset_after``: seconds until the quota is whole again.
    - ``retry_after``: seconds until a request of this cost could pass; 0 when allowed;
      :data:`NEVER` (``math.inf``) when the cost exceeds the limit.
    - ``shadow_denied``: a shadow check that would have denied the request. Its ``allowed`` is
      true (a shadow limit never refuses), nothing was consumed on it, and ``remaining``,
      ``reset_after`` and ``retry_after`` are those of the refusal it would have been.
    """

    allowed: bool
    limit: int
    remaining: int
    reset_after: float
    retry_after: float
    shadow_denied: bool = False

    @property
    def impossible(self) -> bool:
        """True when the request's cost is larger than the limit: it can never pass."""
        return self.retry_after == NEVER


@slot_init
@dataclass(frozen=True, slots=True)
class Evaluation:
    """The answer of one storage call: one decision per check, in order."""

    decisions: tuple[Decision, ...]
    #: Keys that held data of the wrong type or shape; the storage replaced them with fresh state.
    repaired_keys: tuple[str, ...] = ()
    #: The storage's clock when it decided (us since the epoch: one node's, so the window a
    #: unit was taken in is known, :mod:`flask_distlimit.resilience.leases`); 0 when not known
    #: (answers of several nodes put together, the local fallback). Not compared.
    now_us: int = field(default=0, compare=False)

    @property
    def allowed(self) -> bool:
        return all(map(_ALLOWED, self.decisions))  # no generator frame on the request path

    def denied_indexes(self) -> list[int]:
        """Indexes of the checks that denied the request."""
        return [i for i, d in enumerate(self.decisions) if not d.allowed]
