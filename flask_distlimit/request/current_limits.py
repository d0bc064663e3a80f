"""The request's limits in hand: ``limiter.current_limits``, ``limiter.current_limit`` and
``limiter.clear(name)`` (docs/limits.md, "The request's limits in hand").

``current_limits`` lists the limits the request's storage calls evaluated so far, in order
(none outside a request); ``current_limit`` is the one the rate-limit headers describe.
``clear(name)`` deletes the current identity's keys of those named ``name`` and answers how
many; an unknown name raises :class:`ValueError`, and clearing a counter keyed on an address
warns (:class:`~flask_distlimit.errors.ClearedAddressWarning`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flask import has_request_context, request

from flask_distlimit.core.limits import Rate
from flask_distlimit.declare.keys import key_tag
from flask_distlimit.errors import ClearedAddressWarning, StorageError
from flask_distlimit.request.headers import Evaluated

if TYPE_CHECKING:
    from flask_distlimit.core.decision import Check, Decision
    from flask_distlimit.request.enforcement import AppLimiter


@dataclass(frozen=True, slots=True)
class RequestLimit:
    """One limit of the current request, as ``limiter.current_limits`` lists it."""

    name: str
    limit: int  #: the count in effect (divided among the instances under the local fallback)
    remaining: int
    reset_after: float  #: seconds until the quota is whole again
    reset_at: float  #: the same, as epoch seconds
    denied: bool
    #: the window of ``limit``, in seconds (60 for ``5/minute``; a concurrency limit's lease)
    period: int = 0
    #: what ``limit`` and ``remaining`` count: ``"requests"`` (units of cost), or
    #: ``"content-bytes"``
    unit: str = "requests"

    @property
    def rate(self) -> Rate | None:
        """``limit`` per ``period`` as a :class:`~flask_distlimit.Rate` (None when the period
        is not known)."""
        if self.period < 1:
            return None
        return Rate(self.limit, self.period)


def _evaluated(state: AppLimiter) -> list[tuple[Check, Decision, float]]:
    """Each limit the current request's storage calls evaluated: its check, its decision and
    the wall clock (seconds) when it was decided."""
    data = request.environ.get(state.enforcer.environ_key) if has_request_context() else None
    batches: list[Evaluated] = [] if data is None else data.evaluated
    return [(c, d, e.wall) for e in batches for c, d in zip(e.checks, e.decisions, strict=True)]


def current_limits(state: AppLimiter) -> list[RequestLimit]:
    """The limits the current request's storage calls evaluated (see the module docstring)."""
    return [
        RequestLimit(
            name=c.bound.name,
            limit=d.limit,
            remaining=d.remaining,
            reset_after=d.reset_after,
            reset_at=wall + d.reset_after,
            denied=not d.allowed,
            period=c.period,
            unit=c.bound.spec.unit,
        )
        for c, d, wall in _evaluated(state)
    ]


def current_limit(state: AppLimiter) -> RequestLimit | None:
    """The limit the rate-limit headers describe: the one that refused the request, else the
    one closest to refusing it (None: none yet)."""
    data = request.environ.get(state.enforcer.environ_key) if has_request_context() else None
    r = None if data is None else data.report
    if data is None or r is None:  # no numbers told (a slot, a request that can never pass)
        return next((one for one in current_limits(state)[::-1] if one.denied), None)
    for one in reversed(current_limits(state)):
        if one.name == r.name and one.remaining == r.remaining:
            return one
    wall = state.wall() + r.reset_after  # a refusal of the deny cache: no storage call
    return RequestLimit(r.name, r.limit, r.remaining, r.reset_after, wall, data.denied, r.period)


def _matches(name: str, wanted: str) -> bool:
    return name == wanted or name.rpartition(":")[0] == wanted


def _known_names(state: AppLimiter) -> set[str]:
    """The names (with and without the rate) of every limit the current request can meet."""
    endpoint = request.endpoint
    bounds = [*state.global_limits, *(b for t in state.tier_limits.values() for b in t)]
    if endpoint is not None:
        bounds += state.enforcer.plan(endpoint, request.method).limits
    bounds += [c.bound for c, _, _ in _evaluated(state)]
    return {n for b in bounds for n in (b.name, b.name.rpartition(":")[0])}


def clear(state: AppLimiter, name: str) -> int:
    """Delete the current identity's counters of the evaluated limits named ``name``."""
    if not has_request_context():
        raise RuntimeError(
            "limiter.clear(name) clears the current request's identity: call it inside a "
            "request (a view). To reset a client from outside, use "
            "'flask distlimit reset <identity> --limit <name>'."
        )
    found = [c for c, _, _ in _evaluated(state) if _matches(c.bound.name, name)]
    if not found:
        # Nothing of that name was counted for this request (limits disabled or switched off,
        # the storage down under policy open, an exempt_when that skipped it): nothing to
        # clear. A name that no limit of this request has is a mistake in the app: say so.
        known = _known_names(state)
        if not state.settings.enabled or not state.limiter.enabled or name in known:
            return 0
        names = sorted(n for n in known if n)
        raise ValueError(
            f"No limit of this request is named {name!r} (its limits: "
            f"{', '.join(names) or 'none'}). Pass a name from limiter.current_limits, with or "
            "without its rate."
        )
    keys = sorted({c.key for c in found})
    _warn_if_address(state, name, keys)
    deferred = request.environ[state.enforcer.environ_key].deferred  # it holds ``found``
    for key in keys:
        deferred.pop(key, None)
        if state.deny_cache is not None:
            state.deny_cache.forget(key)
    state.drop_leases(keys)  # units leased from the counts deleted below
    try:
        return state.storage.delete(keys)
    except StorageError as exc:  # an outage since the request's check: never its 500
        state.guard.side_failed(f"limiter.clear({name!r})", exc)
        return 0


def _warn_if_address(state: AppLimiter, name: str, keys: Sequence[str]) -> None:
    """Warn when a key to clear is the client address's: its tag is that of the request's
    address, as its own identity (``ip:<address>``) or as a ``key_func`` value (``func:<address>``,
    e.g. ``lambda: request.remote_addr``)."""
    address = state.resolver.client_ip(request.environ)  # "ip:<address>"
    bare = address.removeprefix("ip:")
    tags = {state.identity_tag(address), state.identity_tag(f"func:{bare}")}
    if request.remote_addr:
        tags.add(state.identity_tag(f"func:{request.remote_addr}"))
    if any(key_tag(key) in tags for key in keys):
        warnings.warn(
            f"limiter.clear({name!r}) deletes a counter keyed on the client's address: whoever "
            "succeeds from that address resets it for everyone behind it (an attacker with an "
            "account of their own could try, log in, and try again without end). Key the limit "
            "you clear on the authenticated account (key_func=...), and keep an address limit "
            "that is never cleared (docs/limits.md, 'Counting only some responses').",
            ClearedAddressWarning,
            stacklevel=3,
        )
