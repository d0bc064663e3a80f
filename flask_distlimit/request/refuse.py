"""Refusing a request: the 429 and 503 problem details, the ``on_breach`` hooks, the breach log.

A denial raises a 429, an outage under ``closed`` or a fleet over a priority's share a 503
(:mod:`flask_distlimit.core.problem`); Flask's error handling makes the response. Before a 429
the ``on_breach`` hooks are told a :class:`Breach` (one that raises is logged, never a 500). A
refusal is logged at INFO at most once per client and limit per window, never once per request.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NoReturn

from flask import request
from werkzeug.wrappers import Response as WerkzeugResponse

from flask_distlimit.core.algorithms import CONCURRENCY
from flask_distlimit.core.decision import Check
from flask_distlimit.core.limits import Rate
from flask_distlimit.core.pacing import OncePerWindow, Pace, paced
from flask_distlimit.core.priorities import Priority
from flask_distlimit.core.problem import (
    ConcurrencyLimitExceeded,
    Overloaded,
    RateLimitExceeded,
    RateLimitUnavailable,
    retry_after_seconds,
)
from flask_distlimit.declare import refusal_options
from flask_distlimit.declare.dynamic_limits import log_text
from flask_distlimit.declare.keys import key_tag
from flask_distlimit.declare.route_limits import BoundLimit
from flask_distlimit.identity import Identity
from flask_distlimit.request.data import RequestData
from flask_distlimit.request.headers import Report
from flask_distlimit.resilience.guard import Guard
from flask_distlimit.storage.pool import cooperative

if TYPE_CHECKING:
    from werkzeug.sansio.response import Response as SansIOResponse

log = logging.getLogger("flask_distlimit")


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


@dataclass(slots=True, kw_only=True)
class Refusals:
    """How one app's limiter refuses requests (see the module docstring)."""

    guard: Guard
    local_clock: Callable[[], int]  #: microseconds
    identity_tag: Callable[[str], str]
    breach_hook: Callable[[], BreachHook | None]  #: the app's ``on_breach``, asked each time
    priority: Callable[[], Priority]  #: the request's (flask_distlimit.defences.shedding)
    fleet_key: str | None
    lease: int  #: a concurrency slot's, seconds
    retry_unavailable: int  #: ``Retry-After`` of a 503 under policy ``closed``
    #: the clients and limits whose breach was logged, until their window ends (local clock)
    logged: OncePerWindow = field(default_factory=OncePerWindow, init=False)
    #: the pace of the ERROR lines about each route's breach hooks raising (local clock)
    paces: dict[str, Pace] = field(default_factory=dict, init=False)

    def refuse(
        self,
        denied: Sequence[Check],
        binding: Report,
        identity: Identity | None,
        data: RequestData,
        *,
        from_cache: bool,
        degraded: bool = False,
    ) -> NoReturn:
        """Log, call the breach hook and raise the 429 for the denied checks ``denied``;
        ``binding``: the report of the one that makes the client wait longest (its
        ``Retry-After``, and the headers' numbers)."""
        data.unwritten()  # a refused call wrote nothing: never charged after the response
        keys = [c.key for c in denied]
        concurrency = all(c.token for c in denied)  # every one a slot (defences.concurrency)
        if concurrency and self.fleet_key is not None and self.fleet_key in keys:
            self.shed(data)
        # Not finite: the cost exceeds a limit the local fallback divided; it cannot pass now.
        retry = (
            retry_after_seconds(binding.retry_after) if math.isfinite(binding.retry_after) else None
        )
        # the rate-limit headers describe rates, never slots in flight
        data.report = None if concurrency else binding
        data.denied, data.retry_after = True, retry
        data.degraded = data.degraded or degraded
        digest = self.identity_tag(identity.value) if identity is not None else key_tag(keys[0])
        tier = identity.tier if identity is not None else None
        # one INFO line per client and limit per window at most, never one per request
        fresh = self.logged.due(denied, self.local_clock())
        if fresh:
            log.info(
                "Rate limit exceeded: %s; identity %s, tier %s, %s %s; retry in %s s "
                "(logged once per client and limit per window)",
                ", ".join(f"{c.bound.name} (client {key_tag(c.key)})" for c in fresh),
                digest,
                log_text(tier) if tier else "-",  # a claim's or a hook's text, maybe a client's
                log_text(request.method),  # any word a server took (not gunicorn: tokens)
                request.endpoint,
                retry,
            )
        bounds = [c.bound for c in denied]
        self._raise(bounds, retry, digest, tier, from_cache=from_cache, concurrency=concurrency)

    def shed(self, data: RequestData) -> NoReturn:
        """The fleet is over this request's priority's share: 503
        (flask_distlimit.defences.fleet)."""
        priority = self.priority()
        data.report, data.denied, data.retry_after = None, True, 1
        metrics = self.guard.metrics
        if metrics is not None:
            metrics.shed(priority, "fleet")
        raise Overloaded(priority=priority, reason="fleet", instance=request.path)

    def unavailable(self, data: RequestData, *, busy: bool, unresolved: bool = False) -> NoReturn:
        """The storage did not decide and the failure policy is ``closed``: 503. ``unresolved``:
        a limit of the route could not be evaluated (its app code raised) and the route's
        policy is not ``open``."""
        data.degraded = data.denied = True
        data.unwritten()  # this call's reservations: never taken, or not known to be
        data.retry_after = 1 if busy else self.retry_unavailable  # busy: load, not an outage
        raise RateLimitUnavailable(
            retry_after=data.retry_after, instance=request.path, busy=busy, unresolved=unresolved
        )

    def unaffordable(self, check: Check, identity: Identity | None, data: RequestData) -> NoReturn:
        """Refuse a request that costs more than the limit of ``check`` allows in a whole
        window: it can never pass, so no ``Retry-After`` promises that it will. Its INFO line
        is logged once per client and limit per window at most, as breaches are."""
        b: BoundLimit = check.bound
        data.report, data.denied, data.retry_after = None, True, None
        digest = self.identity_tag(identity.value) if identity is not None else key_tag(check.key)
        if self.logged.due((check,), self.local_clock()):
            log.info(
                "Rate limit %s refused a request costing %d (more than %d in a whole window) "
                "from client %s, %s %s (logged once per client and limit per window)",
                b.name, check.cost, check.limit, digest, request.method, request.endpoint,
            )  # fmt: skip
        detail = (
            f"This request costs {check.cost} units, more than the limit {b.name} allows in a "
            f"whole window ({check.limit} per {b.rate.period} s): it can never be admitted. "
            + ("Send it in smaller parts." if check.limit else "The limit admits no request.")
        )
        tier = identity.tier if identity is not None else None
        self._raise((b,), None, digest, tier, from_cache=False, detail=detail)

    def _raise(
        self,
        denied: Sequence[BoundLimit],
        retry: int | None,
        digest: str,
        tier: str | None,
        *,
        from_cache: bool,
        detail: str | None = None,
        concurrency: bool = False,
    ) -> NoReturn:
        """Tell the ``on_breach`` hooks, then raise the 429 (the response of the last hook that
        answered one, if any). A hook that raises is logged and the 429 is sent all the same."""
        if cooperative():  # gevent, eventlet: those waiting for a reply or a timer go first (a
            time.sleep(0)  # flood of 429s from memory); docs/deployment.md, "gevent and eventlet"
        response: SansIOResponse | None = None
        names = tuple(b.name for b in denied)
        hooks = refusal_options.breach_hooks(denied, self.breach_hook())
        message = refusal_options.error_message(denied)
        detail = message or detail
        # e.description as Flask-Limiter's: the error_message, else "1 per 1 day"
        said = message or (None if concurrency else denied[0].rate.in_words())
        # each denied limit's count and window; a concurrency limit's slots and their lease
        rates = tuple(
            Rate(b.rate.amount, self.lease) if b.algorithm == CONCURRENCY else b.rate
            for b in denied
        )
        breach = Breach(
            endpoint=request.endpoint,
            method=request.method,
            path=request.path,
            identity_digest=digest,
            tier=tier,
            violated_policies=names,
            retry_after=retry,
            from_cache=from_cache,
            limit=rates[0],
            limits=rates,
        )
        if hooks:
            for hook in hooks:
                try:
                    answer = hook(breach)
                except Exception:  # the app's code: the refusal stands, never a 500
                    if paced(self.paces, str(request.endpoint), self.local_clock(), 60e6):
                        log.exception(
                            "The on_breach hook %s raised while refusing %s %s; the 429 is "
                            "sent without it. (Logged at most once a minute per route.)",
                            getattr(hook, "__qualname__", hook), log_text(request.method),
                            request.endpoint,
                        )  # fmt: skip
                    continue
                if isinstance(answer, WerkzeugResponse):
                    response = answer
        problem = ConcurrencyLimitExceeded if concurrency else RateLimitExceeded
        exc = problem(
            retry_after=retry,
            violated_policies=names,
            instance=request.path,
            detail=detail,
            description=said,
        )
        exc.response = response  # None: the problem+json 429
        exc.limit = breach  # Flask-Limiter's e.limit: e.limit.limit is the rate that refused
        raise exc
