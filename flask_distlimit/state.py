"""One app's limiter: :class:`LimiterState`, kept in ``app.extensions["distlimit"]``.

Everything an app configures lives here: settings, storage, guard, identity resolver, deny
cache, the bound global and tier limits, and the app's request path
(:class:`~flask_distlimit.request.enforcement.Enforcer`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from flask_distlimit.config import Settings
from flask_distlimit.core.algorithms import check_limit_count
from flask_distlimit.core.pacing import Pace
from flask_distlimit.declare.route_limits import BoundLimit, bind
from flask_distlimit.declare.specs import LimitSpec
from flask_distlimit.defences.deny_cache import DenyCache, monotonic_us
from flask_distlimit.defences.lifecycle import Lifecycle
from flask_distlimit.defences.shadow import check_tiers as check_shadow_tiers
from flask_distlimit.defences.shadow import spec_is_shadow
from flask_distlimit.defences.shedding import Shedding, WorkerLoad
from flask_distlimit.forks import AfterFork
from flask_distlimit.identity import IdentityResolver, IdentitySettings
from flask_distlimit.identity.digests import IdentityTags
from flask_distlimit.ops import admin
from flask_distlimit.request.enforcement import Declared, Enforcer
from flask_distlimit.resilience.guard import Guard
from flask_distlimit.storage.base import Storage
from flask_distlimit.telemetry import otel

_states: AfterFork[LimiterState] = AfterFork(lambda state: state.after_fork())


def _every_request(
    global_spec: LimitSpec, meta_spec: LimitSpec, identity_settings: IdentitySettings
) -> tuple[int, str]:
    """How many limits every request carries (the global and meta limits and the largest
    tier), and their words for messages; refused when they alone are more than
    ``MAX_LIMITS_PER_REQUEST``."""
    tiers = [(len(rates), tier) for tier, rates in identity_settings.tiers.items()]
    most, tier = max(tiers, default=(0, ""))
    global_count, meta_count = global_spec.rate_count, meta_spec.rate_count
    every = global_count + meta_count + most
    head = f"DISTLIMIT_GLOBAL_LIMITS ({global_count})"
    if meta_count:
        head += f", DISTLIMIT_META_LIMITS ({meta_count})"
    if most:
        head += f", the tier {tier!r} of DISTLIMIT_TIERS ({most})"
    check_limit_count(every, head)
    return every, head


class LimiterState:
    """Everything one app's limiter needs: ``app.extensions["distlimit"]``.

    Attributes: ``limiter`` (the :class:`~flask_distlimit.Limiter`, as
    :class:`~flask_distlimit.request.enforcement.Declared`, whose ``hooks`` the request path
    reads), ``settings``, ``storage``, ``guard`` (made here: the storage behind its breakers),
    ``clock`` (the injected clock, ``None`` when none is), ``resolver``, ``deny_cache``
    (``None`` when disabled), ``global_limits``,
    ``meta_limits`` and ``tier_limits`` (bound), ``enforcer`` (the request path), ``tags``
    (:class:`~flask_distlimit.identity.digests.IdentityTags`) and ``identity_tag``, its ``tag``
    function: the keyed digest of an identity text in this app's keys.
    """

    def __init__(
        self,
        *,
        limiter: Declared,
        settings: Settings,
        identity_settings: IdentitySettings,
        storage: Storage,
        resolver: IdentityResolver,
        deny_cache_size: int | None,
        clock: Callable[[], int] | None,
    ) -> None:
        seconds = (lambda: clock() / 1_000_000) if clock is not None else None
        # an injected clock drives the breakers' reset timeout and the tags' refreshes too
        monotonic = seconds or time.monotonic
        self.limiter = limiter
        self.settings = settings
        self.storage = storage
        self.guard = guard = Guard(
            storage,
            policy=settings.failure_policy,
            clock=monotonic,
            fail_max=settings.breaker_fail_max,
            reset_timeout=settings.breaker_reset_timeout,
            instances=settings.instances,
            instances_min=settings.instances_min,
            key_prefix=settings.key_prefix,
            fallback_max_keys=settings.fallback_max_keys,
        )
        self.resolver = resolver
        #: the injected clock, in microseconds (``None``: the real ones)
        self.clock = clock
        #: the injected clock's time for the storage (``None``: the Redis server's clock)
        self.storage_now: Callable[[], int | None] = clock if clock is not None else lambda: None
        #: the local clock, in microseconds (the deny cache's and the breach log's)
        self.local_clock: Callable[[], int] = clock or monotonic_us
        #: the pace of the ERROR lines about each limit's callables failing after the response
        self.paces: dict[str, Pace] = {}
        self.deny_cache: DenyCache | None = None  # deny_cache_size None: off
        if deny_cache_size is not None:
            self.deny_cache = DenyCache(clock=self.local_clock, max_entries=deny_cache_size)
        #: the wall clock, in seconds (for header reset times)
        self.wall: Callable[[], float] = seconds or time.time
        #: this app's identity tags: keyed with its secret, else a key the storage keeps; read
        #: while the breaker of the node serving that key (on a Redis Cluster) lets calls
        #: through, and that breaker hears how the read ended
        self.tags = IdentityTags(
            identity_settings.tag_secret,
            storage=storage,
            key_prefix=settings.key_prefix,
            clock=monotonic,
            guard=guard,
        )
        self.identity_tag: Callable[[str], str] = self.tags.tag
        algorithm, shadow = settings.algorithm, settings.shadow
        configured = {"global"} if settings.global_limits or settings.global_dynamic else set()
        configured |= {"default"} if settings.default_limits or settings.default_dynamic else set()
        check_shadow_tiers(shadow, identity_settings.tiers, configured)
        default_spec = LimitSpec(
            "default",
            settings.default_limits,
            shadow=spec_is_shadow(shadow, "default"),
            dynamic=settings.default_dynamic,  # a callable or mapping default
        )
        has_default = settings.default_limits or settings.default_dynamic is not None
        self.default_specs: tuple[LimitSpec, ...] = (default_spec,) if has_default else ()
        global_spec = LimitSpec(
            "global",
            settings.global_limits,
            shadow=spec_is_shadow(shadow, "global"),
            dynamic=settings.global_dynamic,  # a callable: its answer per request
        )
        meta_spec = LimitSpec("meta", settings.meta_limits)
        tier_specs = {
            tier: LimitSpec("tier", rates, tier=tier, shadow=spec_is_shadow(shadow, "tier", tier))
            for tier, rates in identity_settings.tiers.items()
        }
        for spec in (global_spec, meta_spec, *tier_specs.values()):
            spec.check_rates(algorithm)
        self._every = _every_request(global_spec, meta_spec, identity_settings)
        self.check_declared("DISTLIMIT_DEFAULT_LIMITS", self.default_specs)
        for table in (limiter.registry.views, limiter.registry.blueprints):
            for specs in table.values():
                self.check_declared(specs[0].declared_on if specs else "", specs)

        def bound(spec: LimitSpec, label: str) -> tuple[BoundLimit, ...]:
            return tuple(
                bind(spec, prefix=settings.key_prefix, default_algorithm=algorithm, label=label)
            )

        self.global_limits = bound(global_spec, "global")
        self.meta_limits = bound(meta_spec, "meta")  # never shadow: DISTLIMIT_SHADOW names none
        self.tier_limits = {t: bound(spec, t) for t, spec in tier_specs.items() if spec.rates}
        #: what each request takes, and its one release (flask_distlimit.defences.lifecycle)
        self.lifecycle = Lifecycle(self.local_clock, settings.concurrency_lease)
        #: request priorities and worker-utilization shedding (flask_distlimit.defences.shedding)
        self.shedding = Shedding(
            limiter.priorities,
            WorkerLoad(
                settings.worker_threads,
                settings.worker_shed_at,
                lambda: guard.metrics,
                clock=self.local_clock,
                hold_us=settings.concurrency_lease * 1_000_000,
            )
            if settings.worker_threads
            else None,
            self.lifecycle,
        )
        self.enforcer = Enforcer(self)
        #: OpenTelemetry metrics (flask_distlimit.telemetry.otel): on when the API is installed
        self.otel: otel.OTelHook | None = None
        otel.auto(self)
        _states.add(self)

    # -- tools (see flask_distlimit.ops.admin)
    # -------------------------------------------------------

    def health(self) -> dict[str, object]:
        """The guard's health report (storage latency, breaker state, scripts, instances), with
        the fleet's usage and this process's load when shedding is on."""
        report = self.guard.health()
        report["leases"] = self.lease_report()
        fleet, load = self.enforcer.fleet, self.shedding.load
        if fleet is not None:
            report["fleet"] = fleet.health(self.storage, now_us=self.storage_now())
        if load is not None:
            report["worker"] = load.health()
        return report

    def reset(self) -> int:
        """Delete every count of this app (its clients' keys and its leases' records) and
        forget local denials; answer how many keys were deleted. For tests and operators, not
        the request path (:func:`flask_distlimit.ops.admin.reset`)."""
        return admin.reset(self)

    def reset_identity(self, identity: str) -> int:
        """Delete every key of one identity (e.g. ``"ip:203.0.113.9"``, or ``"func:alice"`` for
        a ``key_func`` that returned ``"alice"``); answer how many
        (:func:`flask_distlimit.ops.admin.identity_keys` finds them)."""
        return admin.delete_counts(self, admin.identity_keys(self, identity))

    def checks_for(self, identity: str, cost: int = 0) -> list[admin.NamedCheck]:
        """Every configured limit that can apply to ``identity``, named, as checks of ``cost``
        (see :func:`flask_distlimit.ops.admin.checks_for`)."""
        return admin.checks_for(self, identity, cost)

    def check_declared(self, where: str, specs: Sequence[LimitSpec]) -> None:
        """Refuse the limits ``specs`` of one view, class or blueprint (``where``), at start-up or
        when declared after it: a rate the app's default algorithm cannot enforce (those with an
        algorithm of their own were checked when declared), or more limits in one request than
        ``MAX_LIMITS_PER_REQUEST`` with those of every request."""
        for spec in specs:
            if spec.algorithm is None:
                spec.check_rates(self.settings.algorithm)
        count = sum(spec.rate_count for spec in specs)
        if count:
            every, head = self._every
            check_limit_count(every + count, f"{head} and the limits on {where} ({count})")

    def lease_report(self) -> dict[str, dict[str, object]]:
        """The quota leases this process holds, by storage key (``health()["leases"]``)."""
        return self.enforcer.leases.held()

    def drop_leases(self, keys: Iterable[str] | None = None) -> None:
        """Forget this process's leases of ``keys`` (``None``: all), whose counts were just
        deleted (:meth:`Leases.drop <flask_distlimit.resilience.leases.Leases.drop>`)."""
        self.enforcer.leases.drop(keys)

    def lease_size(self, key: str) -> int | None:
        """The most units a process leases of the limit stored under ``key`` (``None``: not
        leased, or none of its routes bound yet)."""
        return self.enforcer.leases.largest(key)

    def lease_records_key(self) -> str:
        """The key where every process of the app publishes the leases it holds (read by
        ``flask distlimit inspect``, deleted by :meth:`reset`)."""
        return self.enforcer.leases.records_key

    def after_fork(self) -> None:
        """In a forked child (gunicorn): new connections and a fresh deny-cache lock."""
        self.storage.reset_after_fork()
        self.tags.after_fork()
        if self.shedding.load is not None:
            self.shedding.load.after_fork()
        if self.deny_cache is not None:
            self.deny_cache.reset_after_fork()
