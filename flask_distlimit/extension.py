"""The Flask extension: :class:`Limiter` and the per-app :class:`LimiterState`.

::

    limiter = Limiter()            # or Limiter(app)
    limiter.init_app(app)          # reads DISTLIMIT_*, state in app.extensions["distlimit"]

    @app.get("/orders")
    @limiter.limit("100/minute")
    def orders(): ...

The ``Limiter`` holds only what is declared in code (limits, exemptions, hooks) and may serve
several apps. Everything an app configures lives in its :class:`LimiterState`: settings, storage,
guard, identity resolver, deny cache and the route plans bound from the declarations.

A request's path (see :mod:`flask_distlimit.route_limits` for which limits apply):

1. ``before_request`` finds the route's plan (bound once per endpoint and method), identifies the
   client, builds one :class:`~flask_distlimit.decision.Check` per limit, asks the deny cache,
   then makes ONE ``guard.evaluate`` call for all of them;
2. a denial raises :class:`~flask_distlimit.problem.RateLimitExceeded` (429), an outage under
   policy ``closed`` :class:`~flask_distlimit.problem.RateLimitUnavailable` (503);
3. ``after_request`` adds the rate-limit headers of the limit closest to denial (and
   ``X-RateLimit-Degraded: true`` when the storage was down).

What ``after_request`` needs is kept in the request's WSGI environ (under a key of this app's
limiter), not on ``g``: the environ lives exactly as long as the request, so nothing has to be
dropped at teardown (one hook less per request), and an app context shared by several requests
(e.g. a test's ``with app.app_context():``) cannot hand one request's numbers to the next.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeVar, overload

from flask import Blueprint, Flask, Request, current_app, request
from werkzeug.wrappers import Response as WerkzeugResponse

from .algorithms import validate_algorithm
from .config import Settings
from .decision import Check, Decision, Evaluation
from .deny_cache import DenyCache, monotonic_us
from .errors import ConfigurationError
from .guard import FailurePolicy, Guard, validate_policy
from .headers import Report, rate_limit_headers
from .identity import Identity, IdentityHooks, IdentityResolver, IdentitySettings
from .keys import client_pattern, identity_tag
from .limits import parse_rates
from .problem import RateLimitExceeded, RateLimitUnavailable, retry_after_seconds
from .route_limits import (
    EXEMPT,
    BoundLimit,
    CostFunc,
    ExemptWhen,
    KeyFunc,
    LimitKind,
    LimitRegistry,
    LimitSpec,
    RoutePlan,
    bind,
    build_plan,
)
from .storage.base import Storage
from .storage.urls import from_url

if TYPE_CHECKING:
    from werkzeug.sansio.response import Response as SansIOResponse

__all__ = ["EXTENSION_KEY", "Breach", "Limiter", "LimiterState"]

log = logging.getLogger("flask_distlimit")

#: The key of the per-app state in ``app.extensions``.
EXTENSION_KEY: Final = "distlimit"

F = TypeVar("F", bound=Callable[..., object])
Decorated = TypeVar("Decorated")

_states: weakref.WeakSet[LimiterState] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for state in list(_states):
        state.after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclass(frozen=True, slots=True)
class Breach:
    """What the ``on_breach`` hook is told about a refused request (no raw identity)."""

    endpoint: str | None
    method: str
    path: str
    #: :func:`flask_distlimit.keys.identity_tag` of the request's identity (when only global or
    #: ``key_func`` limits applied: the hash tag of the first denied limit's key)
    identity_digest: str
    tier: str | None
    violated_policies: tuple[str, ...]
    retry_after: int  #: seconds, rounded up
    from_cache: bool  #: answered by the local deny cache, without a storage call


BreachHook = Callable[[Breach], "SansIOResponse | None"]


class _RequestData:
    """What ``after_request`` needs, kept in the request environ under ``environ_key``."""

    __slots__ = ("degraded", "denied", "report", "retry_after")

    def __init__(
        self,
        report: Report | None,
        *,
        degraded: bool = False,
        denied: bool = False,
        retry_after: int | None = None,
    ) -> None:
        self.report = report
        self.degraded = degraded
        self.denied = denied
        self.retry_after = retry_after


def _cost_value(cost: int | CostFunc | None, default: int) -> int:
    if cost is None:
        return default
    if isinstance(cost, int):
        return cost
    value = cost()
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(
            f"The cost function {cost!r} of a rate limit returned {value!r}; it must return an "
            "int >= 0 (0 consumes nothing)."
        )
    return value


def _key_text(key_func: KeyFunc) -> str:
    value = key_func()
    return value if isinstance(value, str) else str(value)


class LimiterState:
    """Everything one app's limiter needs: ``app.extensions["distlimit"]``.

    Attributes: ``settings``, ``identity_settings``, ``storage``, ``guard``, ``resolver``,
    ``hooks`` (shared with the ``Limiter``), ``deny_cache`` (``None`` when disabled),
    ``global_limits`` and ``tier_limits`` (bound).
    """

    def __init__(
        self,
        *,
        limiter: Limiter,
        settings: Settings,
        identity_settings: IdentitySettings,
        storage: Storage,
        guard: Guard,
        resolver: IdentityResolver,
        deny_cache: DenyCache | None,
        clock: Callable[[], int] | None,
    ) -> None:
        self.limiter = limiter
        self.settings = settings
        self.identity_settings = identity_settings
        self.storage = storage
        self.guard = guard
        self.resolver = resolver
        self.hooks = limiter.hooks
        self.registry = limiter.registry
        self.deny_cache = deny_cache
        self._storage_clock = clock
        self._local_clock: Callable[[], int] = clock or monotonic_us
        self._wall: Callable[[], float] = (lambda: clock() / 1_000_000) if clock else time.time
        prefix, algorithm = settings.key_prefix, settings.algorithm
        self._default_specs = (
            (LimitSpec("default", settings.default_limits),) if settings.default_limits else ()
        )
        # Limits that take the app's default algorithm are checked against it now, at start-up
        # (those declared with an algorithm of their own were checked when declared).
        for spec in (
            *self._default_specs,
            LimitSpec("global", settings.global_limits),
            *(LimitSpec("tier", r, tier=t) for t, r in identity_settings.tiers.items()),
            *self.registry.declared(),
        ):
            if spec.algorithm is None:
                spec.check_rates(algorithm)
        self.global_limits: tuple[BoundLimit, ...] = tuple(
            bind(
                LimitSpec("global", settings.global_limits),
                prefix=prefix,
                default_algorithm=algorithm,
                label="global",
            )
        )
        self.tier_limits: dict[str, tuple[BoundLimit, ...]] = {
            tier: tuple(
                bind(
                    LimitSpec("tier", rates, tier=tier),
                    prefix=prefix,
                    default_algorithm=algorithm,
                    label=tier,
                )
            )
            for tier, rates in identity_settings.tiers.items()
            if rates
        }
        self._plans: dict[tuple[str | None, str], RoutePlan] = {}
        self._headers = settings.headers
        self._conditional_cost = settings.conditional_cost
        self._retry_unavailable = retry_after_seconds(settings.breaker_reset_timeout)
        #: The request environ key of this limiter's per-request data (one per app's limiter:
        #: a WSGI app may hand its environ to another app with a limiter of its own).
        self.environ_key = f"flask_distlimit.request.{id(self):x}"
        _states.add(self)

    # -- plans ---------------------------------------------------------------------------------

    def _plan(self, endpoint: str | None, method: str) -> RoutePlan:
        if endpoint is not None and (endpoint == "static" or endpoint.endswith(".static")):
            plan = EXEMPT
        else:
            view = current_app.view_functions.get(endpoint) if endpoint is not None else None
            plan = build_plan(
                self.registry,
                endpoint=endpoint,
                view=view,
                blueprints=request.blueprints,
                method=method,
                default_limits=self._default_specs,
                prefix=self.settings.key_prefix,
                default_algorithm=self.settings.algorithm,
            )
        self._plans[(endpoint, method)] = plan
        return plan

    # -- the request path ----------------------------------------------------------------------

    def before_request(self) -> None:
        """Evaluate every limit of the request in one storage call; raise on a refusal."""
        req: Request = request._get_current_object()  # type: ignore[attr-defined]
        endpoint = req.endpoint
        # No route matched (404/405): any method text may come, and none matters to the plan.
        method = req.method if endpoint is not None else ""
        plan = self._plans.get((endpoint, method)) or self._plan(endpoint, method)
        if plan.exempt:
            return
        environ = req.environ
        default_cost = (
            self._conditional_cost
            if "HTTP_IF_NONE_MATCH" in environ or "HTTP_IF_MODIFIED_SINCE" in environ
            else 1
        )
        checks: list[Check] = []
        bounds: list[BoundLimit] = []
        identity: Identity | None = None
        if self.global_limits:
            tag = identity_tag(self.resolver.client_ip(environ))
            for b in self.global_limits:
                checks.append(b.check(tag, default_cost))
                bounds.append(b)
        itag = ""
        if self.tier_limits or plan.needs_identity:
            identity = self.resolver.identify(req, self.hooks)
            itag = identity_tag(identity.value)
            for b in self.tier_limits.get(identity.tier, ()):
                checks.append(b.check(itag, default_cost))
                bounds.append(b)
        for b in plan.limits:
            if b.exempt_when is not None and b.exempt_when():
                continue
            tag = itag if b.key_func is None else identity_tag(_key_text(b.key_func))
            cost = default_cost if b.cost is None else _cost_value(b.cost, default_cost)
            checks.append(b.check(tag, cost))
            bounds.append(b)
        if not checks:
            return
        if len(checks) > 1 and len({c.key for c in checks}) != len(checks):
            checks, bounds = self._dedupe(checks, bounds)
        self._decide(checks, bounds, identity, plan.policy, environ)

    @staticmethod
    def _dedupe(
        checks: list[Check], bounds: list[BoundLimit]
    ) -> tuple[list[Check], list[BoundLimit]]:
        seen: set[str] = set()
        kept_checks: list[Check] = []
        kept_bounds: list[BoundLimit] = []
        for c, b in zip(checks, bounds, strict=True):
            if c.key not in seen:
                seen.add(c.key)
                kept_checks.append(c)
                kept_bounds.append(b)
        return kept_checks, kept_bounds

    def _decide(
        self,
        checks: list[Check],
        bounds: list[BoundLimit],
        identity: Identity | None,
        policy: FailurePolicy | None,
        environ: dict[str, Any],
    ) -> None:
        cache = self.deny_cache
        if cache is not None and len(cache):
            now = self._local_clock()
            for c, b in zip(checks, bounds, strict=True):
                denial = cache.lookup(c.key, c.cost, now)
                if denial is not None:
                    wait = denial.retry_after(now)
                    metrics = self.guard.metrics
                    if metrics is not None:  # count the refusal as if the storage had made it
                        metrics.evaluated(
                            [c], Evaluation((Decision(False, denial.limit, 0, wait, wait),))
                        )
                    report = Report(
                        name=denial.name,
                        limit=denial.limit,
                        period=denial.period,
                        remaining=0,
                        reset_after=wait,
                        retry_after=wait,
                        policy=b.policy,
                        quoted=b.quoted,
                    )
                    self._refuse([report], [c.key], identity, environ, from_cache=True)
        started = self._local_clock()
        storage_now = self._storage_clock() if self._storage_clock is not None else None
        outcome = self.guard.evaluate(checks, policy=policy, now_us=storage_now)
        if outcome.unavailable:
            environ[self.environ_key] = _RequestData(
                None, degraded=True, denied=True, retry_after=self._retry_unavailable
            )
            raise RateLimitUnavailable(retry_after=self._retry_unavailable, instance=request.path)
        evaluation = outcome.evaluation
        if evaluation is None:  # storage down, policy "open"
            environ[self.environ_key] = _RequestData(None, degraded=True)
            return
        decisions = evaluation.decisions
        if not evaluation.allowed:
            finished = self._local_clock()
            denied_reports: list[Report] = []
            denied_keys: list[str] = []
            for c, b, d in zip(checks, bounds, decisions, strict=True):
                if d.allowed:
                    continue
                denied_reports.append(_report(b, d, denied=True))
                denied_keys.append(c.key)
                if cache is not None and not outcome.degraded:
                    cache.record(
                        c.key,
                        cost=c.cost,
                        retry_after=d.retry_after,
                        started_us=started,
                        finished_us=finished,
                        limit=d.limit,
                        period=b.rate.period,
                        name=b.name,
                    )
            self._refuse(
                denied_reports,
                denied_keys,
                identity,
                environ,
                from_cache=False,
                degraded=outcome.degraded,
            )
        # allowed: report the limit with the fewest units left (ties: the latest reset)
        best = 0
        if len(decisions) > 1:
            best_d = decisions[0]
            for i in range(1, len(decisions)):
                d = decisions[i]
                if d.remaining < best_d.remaining or (
                    d.remaining == best_d.remaining and d.reset_after > best_d.reset_after
                ):
                    best, best_d = i, d
        environ[self.environ_key] = _RequestData(
            _report(bounds[best], decisions[best], denied=False), degraded=outcome.degraded
        )

    def _refuse(
        self,
        reports: list[Report],
        keys: list[str],
        identity: Identity | None,
        environ: dict[str, Any],
        *,
        from_cache: bool,
        degraded: bool = False,
    ) -> None:
        """Log, call the breach hook and raise the 429 for the denied limits ``reports``
        (stored under ``keys``)."""
        binding = max(reports, key=lambda r: r.retry_after)
        retry = retry_after_seconds(binding.retry_after)
        environ[self.environ_key] = _RequestData(
            binding, degraded=degraded, denied=True, retry_after=retry
        )
        names = tuple(r.name for r in reports)
        # The digest of who was counted: the key's hash tag, never the identity in clear.
        tags = [key[key.index("{") + 1 : key.index("}")] for key in keys]
        digest = identity_tag(identity.value) if identity is not None else tags[0]
        endpoint = request.endpoint
        tier = identity.tier if identity is not None else None
        if from_cache:
            log.debug("Rate limit %s refused client %s locally (deny cache)", names[0], tags[0])
        else:
            log.warning(
                "Rate limit exceeded: %s; identity %s, tier %s, %s %s; retry in %d s",
                ", ".join(f"{n} (client {t})" for n, t in zip(names, tags, strict=True)),
                digest,
                tier or "-",
                request.method,
                endpoint,
                retry,
            )
        response: SansIOResponse | None = None
        hook = self.limiter._on_breach
        if hook is not None:
            response = hook(
                Breach(
                    endpoint=endpoint,
                    method=request.method,
                    path=request.path,
                    identity_digest=digest,
                    tier=tier,
                    violated_policies=names,
                    retry_after=retry,
                    from_cache=from_cache,
                )
            )
        exc = RateLimitExceeded(retry_after=retry, violated_policies=names, instance=request.path)
        if isinstance(response, WerkzeugResponse):
            exc.response = response
        raise exc

    def after_request(self, response: WerkzeugResponse) -> WerkzeugResponse:
        """Add the rate-limit headers (and ``Retry-After`` on a 429/503 the app replaced)."""
        data: _RequestData | None = request.environ.get(self.environ_key)
        if data is None:
            return response
        headers = response.headers
        if data.report is not None and self._headers != "none":
            add = headers.add  # the names are ours alone: no scan for an existing value
            for name, value in rate_limit_headers(
                self._headers, data.report, self._wall(), denied=data.denied
            ):
                add(name, value)
        if data.degraded:
            headers["X-RateLimit-Degraded"] = "true"
        if (
            data.retry_after is not None
            and response.status_code in (429, 503)
            and "Retry-After" not in headers
        ):
            headers["Retry-After"] = str(data.retry_after)
        return response

    # -- tools ---------------------------------------------------------------------------------

    def health(self) -> dict[str, object]:
        """The guard's health report (storage latency, breaker state, scripts, instances)."""
        return self.guard.health()

    def reset(self) -> int:
        """Delete every key under this app's prefix and forget local denials; answer how many
        keys were deleted. For tests and operators, not the request path."""
        if self.deny_cache is not None:
            self.deny_cache.clear()
        keys = list(self.storage.scan(f"{self.settings.key_prefix}:*"))
        return self.storage.delete(keys) if keys else 0

    def reset_identity(self, identity: str) -> int:
        """Delete every key of one identity (e.g. ``"ip:203.0.113.9"``); answer how many."""
        if self.deny_cache is not None:
            self.deny_cache.clear()
        keys = list(self.storage.scan(client_pattern(self.settings.key_prefix, identity)))
        return self.storage.delete(keys) if keys else 0

    def checks_for(self, identity: str, cost: int = 0) -> list[tuple[str, Check]]:
        """Every configured limit that can apply to ``identity``, named, as checks of ``cost``.

        ``identity`` is an identity text (``"ip:203.0.113.9"``, ``"user:42"``, or what a limit's
        ``key_func`` returns). Cost 0 peeks without consuming: ``guard.evaluate(checks)`` then
        tells where the client stands. Includes the global limits, every tier's limits and the
        limits of every route (per method where ``per_method``); one entry per storage key.
        Needs an app context (it reads the app's URL map).
        """
        tag = identity_tag(identity)
        found: dict[str, tuple[str, Check]] = {}

        def add(b: BoundLimit) -> None:
            key = b.key(tag)
            found.setdefault(
                key, (b.name, Check(key, b.algorithm, b.rate.amount, b.rate.period, cost))
            )

        for b in self.global_limits:
            add(b)
        for bounds in self.tier_limits.values():
            for b in bounds:
                add(b)
        app = current_app
        for rule in app.url_map.iter_rules():
            endpoint = rule.endpoint
            if endpoint == "static" or endpoint.endswith(".static"):
                continue
            parts = endpoint.split(".")[:-1]
            blueprints = [".".join(parts[: i + 1]) for i in range(len(parts))][::-1]
            for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
                plan = build_plan(
                    self.registry,
                    endpoint=endpoint,
                    view=app.view_functions.get(endpoint),
                    blueprints=blueprints,
                    method=method,
                    default_limits=self._default_specs,
                    prefix=self.settings.key_prefix,
                    default_algorithm=self.settings.algorithm,
                )
                for b in plan.limits:
                    add(b)
        return list(found.values())

    def after_fork(self) -> None:
        """In a forked child (gunicorn): new connections and a fresh deny-cache lock."""
        self.storage.reset_after_fork()
        if self.deny_cache is not None:
            self.deny_cache.reset_after_fork()


def _report(b: BoundLimit, d: Decision, *, denied: bool) -> Report:
    reduced = d.limit != b.rate.amount  # the local fallback divides limits
    return Report(
        name=b.name,
        limit=d.limit,
        period=b.rate.period,
        remaining=d.remaining,
        reset_after=d.reset_after,
        retry_after=d.retry_after if denied else 0.0,
        policy=None if reduced else b.policy,
        quoted=b.quoted,
    )


class Limiter:
    """Distributed rate limits for Flask apps.

    ``Limiter(app)`` or ``Limiter()`` then ``limiter.init_app(app)``; one Limiter may serve
    several apps, each with its own configuration.

    - ``storage``: a ready :class:`~flask_distlimit.storage.base.Storage` used instead of
      ``DISTLIMIT_STORAGE_URL`` (e.g. ``RedisStorage(fakeredis.FakeRedis())`` in tests);
    - ``clock``: the time in microseconds since the epoch, for tests
      (:class:`flask_distlimit.testing.FakeClock`); it is then passed to the storage too.
      Production leaves it ``None``: the storage uses the Redis server's clock;
    - ``on_breach``: called with a :class:`Breach` on every refused request; it may return a
      response to send instead of the problem+json 429;
    - ``deny_cache``: answer a flooding client locally while the storage would refuse it anyway
      (default on); ``deny_cache_size`` bounds it.

    Every non-exempt request is checked against ``DISTLIMIT_GLOBAL_LIMITS`` (per client IP), the
    limits of its identity's tier in ``DISTLIMIT_TIERS`` (e.g. ``{"anonymous": "60/minute",
    ...}`` by default; give a tier ``""`` to leave it unlimited), and its route's limits (its own,
    else its blueprint's, else ``DISTLIMIT_DEFAULT_LIMITS``): all in one storage call. A route's
    limits are bound on its first request; declare them before the app serves.
    """

    def __init__(
        self,
        app: Flask | None = None,
        *,
        storage: Storage | None = None,
        clock: Callable[[], int] | None = None,
        on_breach: BreachHook | None = None,
        deny_cache: bool = True,
        deny_cache_size: int = 10_000,
    ) -> None:
        self.registry = LimitRegistry()
        self.hooks = IdentityHooks()
        self._storage = storage
        self._clock = clock
        self._on_breach = on_breach
        self._deny_cache = deny_cache
        self._deny_cache_size = deny_cache_size
        if app is not None:
            self.init_app(app)

    # -- setup ---------------------------------------------------------------------------------

    def init_app(self, app: Flask, *, storage: Storage | None = None) -> None:
        """Read and check the app's ``DISTLIMIT_*`` settings and hook the limiter into it.

        Raises :class:`~flask_distlimit.errors.ConfigurationError` for a bad setting or when
        the app already has a limiter. ``storage`` overrides the Limiter's and the URL.
        """
        if EXTENSION_KEY in app.extensions:
            raise ConfigurationError(
                f"A Limiter is already registered on the app {app.name!r} "
                f"(app.extensions[{EXTENSION_KEY!r}]). Call init_app once per app: use that "
                "Limiter, or create the app anew."
            )
        settings = Settings.from_config(app.config)
        settings.check_serving(storage or self._storage)  # memory:// in several processes?
        identity_settings = IdentitySettings.from_config(app.config)
        resolver = IdentityResolver(identity_settings)
        resolver.check_hooks(self.hooks)
        chosen = storage or self._storage
        if chosen is None:
            chosen = from_url(settings.storage_url, timeout=settings.redis_timeout)
        clock = self._clock
        guard_clock: Callable[[], float] = (
            (lambda: clock() / 1_000_000) if clock is not None else time.monotonic
        )
        guard = Guard(
            chosen,
            policy=settings.failure_policy,
            fail_max=settings.breaker_fail_max,
            reset_timeout=settings.breaker_reset_timeout,
            instances=settings.instances,
            key_prefix=settings.key_prefix,
            clock=guard_clock,  # an injected clock drives the breaker's reset timeout too
        )
        cache = (
            DenyCache(clock=self._clock or monotonic_us, max_entries=self._deny_cache_size)
            if self._deny_cache
            else None
        )
        state = LimiterState(
            limiter=self,
            settings=settings,
            identity_settings=identity_settings,
            storage=chosen,
            guard=guard,
            resolver=resolver,
            deny_cache=cache,
            clock=self._clock,
        )
        app.extensions[EXTENSION_KEY] = state
        if settings.enabled:
            app.before_request(state.before_request)
            app.after_request(state.after_request)

    @staticmethod
    def state(app: Flask | None = None) -> LimiterState:
        """The :class:`LimiterState` of ``app`` (default: the current app)."""
        target = app if app is not None else current_app
        try:
            state = target.extensions[EXTENSION_KEY]
        except KeyError:
            raise RuntimeError(
                f"The app {target.name!r} has no Limiter: call limiter.init_app(app) first."
            ) from None
        assert isinstance(state, LimiterState)
        return state

    # -- declaring limits ----------------------------------------------------------------------

    def limit(
        self,
        value: str,
        *,
        algorithm: str | None = None,
        key_func: KeyFunc | None = None,
        cost: int | CostFunc | None = None,
        scope: str | None = None,
        per_method: bool = False,
        exempt_when: ExemptWhen | None = None,
        on_failure: str | None = None,
    ) -> Callable[[Decorated], Decorated]:
        """Limit a view (function or class) or every route of a Blueprint; stackable.

        - ``value``: ``"100/minute"``, several joined by ``;`` (``"10/second;1000/hour"``);
        - ``algorithm``: one of :data:`~flask_distlimit.ALGORITHMS` (default
          ``DISTLIMIT_ALGORITHM``);
        - ``key_func``: who is counted, e.g. ``lambda: g.tenant_id`` (default: the request's
          identity: verified user, JWT or API key, else the client IP);
        - ``cost``: units per request, an int >= 0 or a callable answering one (default 1, or
          ``DISTLIMIT_CONDITIONAL_COST`` for conditional requests);
        - ``scope``: share one counter among every route naming the same scope;
        - ``per_method``: count each HTTP method separately;
        - ``exempt_when``: a callable; when it answers true the limit is skipped;
        - ``on_failure``: ``"open"``, ``"closed"`` or ``"local"``: this route's policy when the
          storage is down (the strictest wins when several limits of a route set one).
        """
        return self._declare(
            "shared" if scope is not None else "route",
            value,
            algorithm=algorithm,
            key_func=key_func,
            cost=cost,
            scope=scope,
            per_method=per_method,
            exempt_when=exempt_when,
            on_failure=on_failure,
        )

    def shared_limit(
        self,
        value: str,
        scope: str,
        *,
        algorithm: str | None = None,
        key_func: KeyFunc | None = None,
        cost: int | CostFunc | None = None,
        per_method: bool = False,
        exempt_when: ExemptWhen | None = None,
        on_failure: str | None = None,
    ) -> Callable[[Decorated], Decorated]:
        """A limit whose one counter (per client) is shared by every route that names ``scope``."""
        if not isinstance(scope, str) or not scope:
            raise ConfigurationError(
                f"shared_limit needs a non-empty scope string, got {scope!r}: e.g. "
                "limiter.shared_limit('100/minute', scope='search')."
            )
        return self._declare(
            "shared",
            value,
            algorithm=algorithm,
            key_func=key_func,
            cost=cost,
            scope=scope,
            per_method=per_method,
            exempt_when=exempt_when,
            on_failure=on_failure,
        )

    def _declare(
        self,
        kind: LimitKind,
        value: str,
        *,
        algorithm: str | None,
        key_func: KeyFunc | None,
        cost: int | CostFunc | None,
        scope: str | None,
        per_method: bool,
        exempt_when: ExemptWhen | None,
        on_failure: str | None,
    ) -> Callable[[Decorated], Decorated]:
        rates = parse_rates(value)
        if not rates:
            raise ConfigurationError(
                f"limiter.limit needs at least one rate, got {value!r}: e.g. '100/minute'."
            )
        if (
            cost is not None
            and not callable(cost)
            and (isinstance(cost, bool) or not isinstance(cost, int) or cost < 0)
        ):
            raise ConfigurationError(f"cost={cost!r}: use an int >= 0 or a callable returning one.")
        if scope is not None and (not isinstance(scope, str) or not scope):
            raise ConfigurationError(f"scope={scope!r}: use a non-empty string.")
        spec = LimitSpec(
            kind,
            rates,
            algorithm=validate_algorithm(algorithm) if algorithm is not None else None,
            key_func=key_func,
            cost=cost,
            scope=scope,
            per_method=per_method,
            exempt_when=exempt_when,
            on_failure=validate_policy(on_failure) if on_failure is not None else None,
        )

        def decorator(target: Decorated) -> Decorated:
            if isinstance(target, Blueprint):
                self.registry.add_blueprint(
                    target.name, spec if kind == "shared" else _as_blueprint(spec)
                )
            else:
                self.registry.add_view(target, spec)
            return target

        return decorator

    @overload
    def exempt(self, target: F) -> F: ...
    @overload
    def exempt(self, target: Blueprint) -> Blueprint: ...
    def exempt(self, target: object) -> object:
        """No limits and no headers for this view, or every route of this Blueprint."""
        if isinstance(target, Blueprint):
            self.registry.exempt_blueprints.add(target.name)
        else:
            self.registry.exempt_view(target)
        return target

    # -- identity hooks --------------------------------------------------------------------------

    def identity_loader(
        self, func: Callable[[], tuple[str, str | None] | None]
    ) -> Callable[[], tuple[str, str | None] | None]:
        """Register ``() -> (id, tier or None) | None``: a VERIFIED identity of the request
        (e.g. from Flask-Login's ``current_user``)."""
        self.hooks.identity_loader = func
        return func

    def api_key_verifier(self, func: Callable[[str], str | None]) -> Callable[[str], str | None]:
        """Register ``(raw_key) -> tier | None``; only keys it accepts identify a client."""
        self.hooks.api_key_verifier = func
        return func

    def tier_resolver(self, func: Callable[[Identity], str]) -> Callable[[Identity], str]:
        """Register ``(identity) -> tier``, replacing the default tier of every identity."""
        self.hooks.tier_resolver = func
        return func

    def on_breach(self, func: BreachHook) -> BreachHook:
        """Register the hook called with a :class:`Breach` on every refused request."""
        self._on_breach = func
        return func

    # -- tools -----------------------------------------------------------------------------------

    def health(self, app: Flask | None = None) -> dict[str, object]:
        """Storage ping latency, breaker state, scripts loaded, instances seen."""
        return self.state(app).health()

    def reset(self, app: Flask | None = None) -> int:
        """Forget every counter of ``app`` (default: the current app); for tests."""
        return self.state(app).reset()


def _as_blueprint(spec: LimitSpec) -> LimitSpec:
    return LimitSpec(
        "blueprint",
        spec.rates,
        algorithm=spec.algorithm,
        key_func=spec.key_func,
        cost=spec.cost,
        scope=spec.scope,
        per_method=spec.per_method,
        exempt_when=spec.exempt_when,
        on_failure=spec.on_failure,
    )
