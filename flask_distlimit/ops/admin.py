"""Operator tools on one app's limiter: reset counters, list the limits an identity meets. Used by
``flask distlimit`` (:mod:`flask_distlimit.cli`) and ``limiter.reset()``; never on the request path.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from flask import current_app

from flask_distlimit.core.decision import Check
from flask_distlimit.declare.keys import IDENTITY_KINDS, client_pattern
from flask_distlimit.declare.route_limits import RoutePlan
from flask_distlimit.request.enforcement import AppLimiter
from flask_distlimit.request.plans import is_static
from flask_distlimit.storage.lease_records import records_key


class NamedCheck(NamedTuple):
    """One limit an identity meets (:func:`checks_for`): its name, as ``current_limits`` and
    ``flask distlimit`` show it, and its check."""

    name: str
    check: Check


def reset(state: AppLimiter) -> int:
    """Delete every count of the app (every client's keys, ``<prefix>:{<tag>}:...``, and the
    leases' records) and forget local denials; answer how many keys were deleted.

    Only the app's own keys: a prefix may hold ``:`` (``myapp:rl``), so another app's prefix may
    start with this one's (``myapp:rl:admin``) and ``<prefix>:*`` would take its keys too. Kept:
    the deployment's identity digest key (every running process holds it:
    :mod:`flask_distlimit.identity.digests`), the instance heartbeat (who is serving, not a count)
    and request tokens (``<prefix>:rq:{...}``: a reply kept a second for a retry; a give-back's id,
    kept for up to five minutes)."""
    records = state.lease_records_key()
    keys = [*state.storage.scan(f"{state.settings.key_prefix}:{{*"), records, records_key(records)]
    return delete_counts(state, keys, every=True)


def check_kind(identity: str) -> str:
    """The kind of an identity text (``"ip"``, ``"user"``, ``"jwt"``, ``"apikey"``, ``"func"``);
    a :class:`ValueError`, with the fix, for a text that names none."""
    kind = next((head[:-1] for head in IDENTITY_KINDS if identity.startswith(head)), None)
    if kind is None:
        raise ValueError(
            f"The identity {identity!r} names no kind of identity: start it with one of "
            f"{', '.join(IDENTITY_KINDS)} (what a limit's key_func returns is func:<value>, "
            f"e.g. 'func:{identity}')."
        )
    return kind


def identity_keys(state: AppLimiter, identity: str) -> list[str]:
    """Every stored key of one identity (e.g. ``"ip:203.0.113.9"``, ``"func:alice"``), found with
    ``SCAN``. Raises :class:`ValueError` for a text that names no kind of identity."""
    check_kind(identity)
    state.tags.require()
    return list(state.storage.scan(client_pattern(state.settings.key_prefix, identity, state.tags)))


def delete_counts(state: AppLimiter, keys: list[str], *, every: bool = False) -> int:
    """Delete these counts of clients, their leases in this process (``every``: the keys are
    all the app's, so every lease goes) and the local denials; answer how many keys existed."""
    if state.deny_cache is not None:
        state.deny_cache.clear()
    state.drop_leases(None if every else keys)  # units leased from the counts deleted below
    return state.storage.delete(keys) if keys else 0


def checks_for(state: AppLimiter, identity: str, cost: int = 0) -> list[NamedCheck]:
    """Every configured limit that can apply to ``identity``, named, as checks of ``cost``.

    ``identity`` is an identity text (``"ip:203.0.113.9"``, ``"user:42"``, or ``"func:<value>"``
    for what a limit's ``key_func`` returns: :mod:`flask_distlimit.declare.keys`). Cost 0 peeks
    without consuming: ``guard.evaluate(checks)`` then tells where the client stands. Includes the
    global limits, every tier's limits and the limits of every route (per method where
    ``per_method``); one entry per storage key.
    Needs an app context (it reads the app's URL map). Raises :class:`ValueError` for a text
    that names no kind of identity.
    """
    kind = check_kind(identity)
    state.tags.require()
    tag = state.tags.tag(identity)
    found: dict[str, NamedCheck] = {}
    # what counts this kind: a client address the global limits too, a key_func's value alone
    keyed_on = {"ip": ("ip", "identity"), "func": ("func",)}.get(kind, ("identity",))
    tiers = [b for bounds in state.tier_limits.values() for b in bounds]
    routes = [b for *_, plan in route_plans(state) for b in plan.limits]
    for b in (*state.global_limits, *state.meta_limits, *tiers, *routes):
        # a dynamic value's rates are known per request only; a limit of 0 stores nothing
        if b.dynamic is None and b.keyed_on in keyed_on and b.rate.amount:
            key = b.key(tag)
            check = Check(key, b.algorithm, b.rate.amount, b.rate.period, cost)
            found.setdefault(key, NamedCheck(b.name, check))
    return list(found.values())


def route_plans(
    state: AppLimiter, endpoint: str | None = None
) -> Iterator[tuple[str, str, str, RoutePlan]]:
    """``(endpoint, rule, method, plan)``: one URL rule's limits for one method, for every rule
    and method (HEAD and OPTIONS aside, static files skipped), by endpoint and rule; only
    ``endpoint``'s rules when given. Needs an app context."""
    rules = sorted(current_app.url_map.iter_rules(endpoint), key=lambda r: (r.endpoint, r.rule))
    for rule in rules:
        if is_static(rule.endpoint):
            continue
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
            yield rule.endpoint, rule.rule, method, state.enforcer.plan(rule.endpoint, method)
