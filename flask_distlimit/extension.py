"""The Flask extension, :class:`Limiter`: ``Limiter(app)`` or ``limiter.init_app(app)``, which
reads ``DISTLIMIT_*`` once and keeps the app's state in ``app.extensions["distlimit"]``.

The ``Limiter`` holds only what is declared in code (limits, exemptions, identity hooks) and may
serve several apps; what an app configures lives in its
:class:`~flask_distlimit.state.LimiterState`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Final, TypeVar

from flask import Flask, current_app, got_request_exception, has_request_context, request

from flask_distlimit import forks
from flask_distlimit._typing import RequestFilter
from flask_distlimit.config import Settings, config_policy
from flask_distlimit.core.priorities import PriorityRegistry, PriorityResolver
from flask_distlimit.core.problem import RateLimitUnavailable
from flask_distlimit.declare.decorators import Declarations
from flask_distlimit.declare.options import check_callable
from flask_distlimit.declare.registry import LimitRegistry
from flask_distlimit.declare.route_limits import strictest
from flask_distlimit.declare.specs import LimitSpec
from flask_distlimit.declare.targets import describe
from flask_distlimit.errors import ConfigurationError, StorageError
from flask_distlimit.identity import Identity, IdentityHooks, IdentityResolver, IdentitySettings
from flask_distlimit.identity.api_keys import ApiKeyVerifier
from flask_distlimit.ops import migration, serving
from flask_distlimit.request import current_limits as _current
from flask_distlimit.request.refuse import BreachHook
from flask_distlimit.state import LimiterState
from flask_distlimit.storage.base import Storage
from flask_distlimit.storage.client_retries import warn_if_client_retries, warn_if_client_waits_long
from flask_distlimit.storage.memory import MemoryStorage
from flask_distlimit.storage.startup_check import check_storage
from flask_distlimit.storage.urls import from_url
from flask_distlimit.telemetry import otel

#: The key of the per-app state in ``app.extensions``.
EXTENSION_KEY: Final = "distlimit"

log = logging.getLogger("flask_distlimit")

_Verifier = TypeVar("_Verifier", bound=ApiKeyVerifier)
_F = TypeVar("_F")


class Limiter(Declarations):
    """Distributed rate limits for Flask apps.

    ``Limiter(app)`` (or ``Limiter(app=app)``) or ``Limiter()`` then ``limiter.init_app(app)``;
    one Limiter may serve several apps, each with its own configuration. Flask-Limiter's
    ``Limiter(key_func, ...)`` and its other arguments raise :class:`TypeError` saying how to
    port them (:mod:`flask_distlimit.ops.migration`).

    - ``storage``: a ready :class:`~flask_distlimit.storage.base.Storage` used instead of
      ``DISTLIMIT_STORAGE_URL`` (e.g. ``RedisStorage(fakeredis.FakeRedis())`` in tests);
    - ``clock``: the time in microseconds since the epoch, for tests
      (:class:`flask_distlimit.testing.FakeClock`); it is then passed to the storage too.
      Production leaves it ``None``: the storage uses the Redis server's clock;
    - ``on_breach``: called with a :class:`Breach` on every refused request; it may return a
      response to send instead of the problem+json 429;
    - ``deny_cache``: answer a flooding client locally while the storage would refuse it anyway
      (default on); ``deny_cache_size`` bounds it;
    - ``request_filter``: a callable of no arguments; a request for which it answers true is
      not limited at all (more with :meth:`request_filter`).

    Nothing is limited until it is declared: ``DISTLIMIT_GLOBAL_LIMITS`` (per client IP),
    ``DISTLIMIT_TIERS`` (per identity tier), ``DISTLIMIT_DEFAULT_LIMITS`` and the decorators.
    Every limit of a request is decided in one storage call, when Flask calls the view: after
    the app's and the blueprints' ``before_request`` hooks, whatever their order (a limit whose
    callables may read what a decorator above it sets is decided where it sits, after it).
    Declare limits before the app serves its first request.
    """

    def __init__(
        self,
        app_or_key_func: Flask | None = None,
        /,
        *,
        app: Flask | None = None,
        storage: Storage | None = None,
        clock: Callable[[], int] | None = None,
        on_breach: BreachHook | None = None,
        deny_cache: bool = True,
        deny_cache_size: int = 10_000,
        request_filter: RequestFilter | None = None,
        **flask_limiter_options: object,
    ) -> None:
        if flask_limiter_options:  # Flask-Limiter's arguments: say how to port them
            raise TypeError(migration.options_message(flask_limiter_options))
        if app_or_key_func is not None and not isinstance(app_or_key_func, Flask):
            if callable(app_or_key_func):
                raise TypeError(migration.key_func_message(app_or_key_func))
            raise TypeError(f"Limiter(app): app must be a Flask app, got {app_or_key_func!r}.")
        if app_or_key_func is not None and app is not None:
            raise TypeError("Limiter() got the app twice: pass Limiter(app) or Limiter(app=app).")
        app = app_or_key_func or app
        if isinstance(storage, str) or not (clock is None or callable(clock)):
            raise TypeError(
                f"Limiter(storage={storage!r}, clock={clock!r}): storage= takes a Storage (a URL "
                "goes in DISTLIMIT_STORAGE_URL), clock= a function answering microseconds."
            )
        if not (
            isinstance(deny_cache, bool) and type(deny_cache_size) is int and deny_cache_size > 0
        ):
            raise ConfigurationError(
                f"deny_cache={deny_cache!r}, deny_cache_size={deny_cache_size!r}: use True or "
                "False, and a number of keys of at least 1 (default 10000)."
            )
        if request_filter is not None:
            check_callable("request_filter", request_filter)
        #: the logger of every line the limiter writes (Flask-Limiter's ``limiter.logger``)
        self.logger = log
        #: False: no request is limited, in every app this Limiter serves, until it is True
        #: again (Flask-Limiter's run-time switch; ``DISTLIMIT_ENABLED`` hooks nothing in)
        self.enabled = True
        self.registry = LimitRegistry()
        #: callables exempting a request from every limit
        #: (:mod:`flask_distlimit.declare.request_filters`)
        self.request_filters: list[RequestFilter] = [request_filter] if request_filter else []
        self.priorities = PriorityRegistry()
        self.hooks = IdentityHooks()
        self._storage = storage
        self._clock = clock
        if on_breach is not None:
            check_callable("on_breach", on_breach)
        self.breach_hook: BreachHook | None = on_breach
        self._deny_cache_size = deny_cache_size if deny_cache else None
        #: (app, view) whose limits were reached on an app this Limiter is not set up on
        self._unset_logged: set[tuple[str, str]] = set()
        #: the apps' states this Limiter is set up on (their limits are checked when declared)
        self._states: weakref.WeakSet[LimiterState] = weakref.WeakSet()
        if app is not None:
            self.init_app(app)

    # -- setup ---------------------------------------------------------------------------------

    def init_app(self, app: Flask, *, storage: Storage | None = None) -> None:
        """Read and check the app's ``DISTLIMIT_*`` settings and hook the limiter into it.

        Raises :class:`~flask_distlimit.errors.ConfigurationError` for a bad setting or when
        the app already has a limiter. ``storage`` overrides the Limiter's and the URL. Probes
        the storage once (``DISTLIMIT_STARTUP_CHECK``,
        :mod:`flask_distlimit.storage.startup_check`): a WARNING when it is unusable, or its
        :class:`~flask_distlimit.errors.StorageError` under ``"error"``.
        """
        if EXTENSION_KEY in app.extensions:
            raise ConfigurationError(
                f"A Limiter is already registered on the app {app.name!r} "
                f"(app.extensions[{EXTENSION_KEY!r}]). Call init_app once per app: use that "
                "Limiter, or create the app anew."
            )
        settings = Settings.from_config(app.config)
        migration.warn_leftover_keys(app.config, app.name)  # RATELIMIT_* keys: not read
        # "is None", not "or": a MemoryStorage with no key yet is falsy (it has a length)
        given = storage if storage is not None else self._storage
        serving.warn_if_memory_per_process(settings.storage_url, given)  # in several processes?
        identity_settings = IdentitySettings.from_config(app.config)
        resolver = IdentityResolver(identity_settings)
        resolver.check_hooks(self.hooks)
        chosen = given
        if chosen is None:
            chosen = from_url(
                settings.storage_url,
                timeout=settings.redis_timeout,
                request_tokens=settings.request_tokens,
            )
            if self._clock is not None and isinstance(chosen, MemoryStorage):  # keys expire by it
                chosen = MemoryStorage(clock=self._clock)
        else:
            settings.check_request_tokens(chosen)
        state = LimiterState(
            limiter=self,
            settings=settings,
            identity_settings=identity_settings,
            storage=chosen,
            resolver=resolver,
            deny_cache_size=self._deny_cache_size,
            clock=self._clock,
        )
        # start-up warnings (one line each): a client passed in that retries, or that waits
        # for a stalled Redis forever; uWSGI without the fork hooks that reset this state in
        # every worker
        warn_if_client_retries(chosen)
        warn_if_client_waits_long(chosen, settings.redis_timeout)
        forks.warn_if_uwsgi_skips_fork_hooks()
        if settings.enabled:
            # one call, as a request makes it: unreachable, refused, slots not served?
            try:
                if check_storage(
                    chosen,
                    mode=settings.startup_check,
                    url=settings.storage_url if given is None else None,
                    key_prefix=settings.key_prefix,
                    timeout=settings.redis_timeout,
                    policy=settings.failure_policy,
                ):
                    state.tags.check_secret()  # the same secret in every process?
            except StorageError:
                if given is None:
                    chosen.close()  # ours: the app does not start
                raise
        app.extensions[EXTENSION_KEY] = state
        self._states.add(state)
        if settings.enabled:
            # what a request takes is given back however its response ends, and each request
            # is counted once (OpenTelemetry), at the WSGI level
            made = None if state.otel is None else functools.partial(otel.request, state)
            state.lifecycle.install(app, made)
            # first: worker shedding decides before anything else is done
            app.before_request(state.enforcer.before_request)
            app.after_request(state.enforcer.after_request)
            with contextlib.suppress(RuntimeError):  # Flask 2.2 without blinker: no signals
                got_request_exception.connect(state.enforcer.forget_headers, app)

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

    def _reached(self, carrier: object) -> None:
        """A view carrying this limiter's limits runs inside a request: enforce them (unless
        the request's plan already did)."""
        specs = self.registry.views.get(carrier, ())
        state = self._state_here(specs, describe(carrier))
        if state is not None and state.settings.enabled:
            state.enforcer.reached(carrier, specs)

    def _declared(self, specs: list[LimitSpec]) -> None:
        """Limits declared on a target after ``init_app``: refused now (not on the app's first
        request) when an app this Limiter is set up on cannot enforce them."""
        for state in self._states:
            state.check_declared(specs[-1].declared_on, specs)

    def _entered(self, spec: LimitSpec) -> None:
        """``with limiter.limit(...)`` inside a request: decide that limit now."""
        if not has_request_context():
            raise RuntimeError(
                "with limiter.limit(...) decides a limit for the current request: use it "
                "inside a view (or a function a view calls), not outside a request."
            )
        state = self._state_here((spec,), f"a with block in the endpoint {request.endpoint!r}")
        if state is not None and state.settings.enabled:
            state.enforcer.entered(spec)

    def _state_here(self, specs: Sequence[LimitSpec], where: str) -> LimiterState | None:
        """This limiter's state on the current app; None when it was never set up there: then
        the limits cannot be evaluated, and their failure policy answers (``on_failure``, else
        ``DISTLIMIT_FAILURE_POLICY``): admitted under ``open``, a 503 otherwise, with an ERROR
        line naming the fix once per app and view. Never a 500."""
        app = current_app
        state = app.extensions.get(EXTENSION_KEY)
        if isinstance(state, LimiterState) and state.limiter is self:
            return state
        policy = strictest(spec.on_failure for spec in specs) or config_policy(app.config)
        if (app.name, where) not in self._unset_logged:
            self._unset_logged.add((app.name, where))
            log.error(
                "The rate limits of %s belong to a Limiter that was never set up on the app "
                "%r, so they cannot be enforced; the failure policy %r answers (open: "
                "admitted; closed or local: 503). Call limiter.init_app(app) (or Limiter(app)) "
                "with that same Limiter in the app factory, before the app serves. (Logged once "
                "per app and view.)",
                where, app.name, policy,
            )  # fmt: skip
        if policy != "open":
            raise RateLimitUnavailable(retry_after=1, instance=request.path, unresolved=True)
        return None

    # -- identity hooks --------------------------------------------------------------------------

    def identity_loader(
        self, func: Callable[[], tuple[str, str | None] | None]
    ) -> Callable[[], tuple[str, str | None] | None]:
        """Register ``() -> (id, tier or None) | None``: a VERIFIED identity of the request
        (e.g. from Flask-Login's ``current_user``)."""
        check_callable("identity_loader", func)
        self.hooks.identity_loader = func
        return func

    def api_key_verifier(self, func: _Verifier) -> _Verifier:
        """Register ``(raw_key) -> (key_id, tier or None) | tier | None``; only keys it accepts
        identify a client. Answer the key's canonical id with its tier when several spellings
        of one key are accepted (e.g. any letter case): the key is counted by that id, never by
        its spelling."""
        check_callable("api_key_verifier", func)
        self.hooks.api_key_verifier = func
        return func

    def tier_resolver(self, func: Callable[[Identity], str]) -> Callable[[Identity], str]:
        """Register ``(identity) -> tier``, replacing the default tier of every identity."""
        check_callable("tier_resolver", func)
        self.hooks.tier_resolver = func
        return func

    def request_filter(self, func: RequestFilter) -> RequestFilter:
        """Register a callable of no arguments: a request for which it answers true is not
        limited at all (e.g. internal health probes). Register filters before the app serves."""
        check_callable("request_filter", func)
        self.request_filters.append(func)
        return func

    @property
    def current_limits(self) -> list[_current.RequestLimit]:
        """The limits the current request's storage calls evaluated so far, with their numbers
        (:mod:`flask_distlimit.request.current_limits`); empty outside a request."""
        if not has_request_context() or EXTENSION_KEY not in current_app.extensions:
            return []
        return _current.current_limits(self.state())

    @property
    def current_limit(self) -> _current.RequestLimit | None:
        """Flask-Limiter's: the limit the current request's rate-limit headers describe, the
        one that refused it or else the one closest to refusing it (None: none)."""
        if not has_request_context() or EXTENSION_KEY not in current_app.extensions:
            return None
        return _current.current_limit(self.state())

    def clear(self, limit_name: str) -> int:
        """Forget the current identity's counter of the limit ``limit_name`` (its name in
        :attr:`current_limits`, with or without its rate), e.g. after a successful login;
        answer how many keys were deleted."""
        return _current.clear(self.state(), limit_name)

    def priority(self, priority: str) -> Callable[[_F], _F]:
        """Give a view a priority: ``"critical"``, ``"default"`` or ``"sheddable"``; the least
        important is shed first when the service is overloaded
        (:mod:`flask_distlimit.defences.shedding`,
        :mod:`flask_distlimit.defences.fleet`)."""
        return self.priorities.declare(priority)

    def priority_resolver(self, func: PriorityResolver) -> PriorityResolver:
        """Register ``() -> priority or None``, called in a request whose view declares none
        (e.g. ``"critical"`` for a POST to payments); ``None`` means ``default``."""
        check_callable("priority_resolver", func)
        self.priorities.resolver = func
        return func

    def on_breach(self, func: BreachHook) -> BreachHook:
        """Register the hook called with a :class:`Breach` on every refused request."""
        check_callable("on_breach", func)
        self.breach_hook = func
        return func

    # -- tools -----------------------------------------------------------------------------------

    def health(self, app: Flask | None = None) -> dict[str, object]:
        """Storage ping latency, breaker state, scripts loaded, instances seen. Never raises: a
        failing storage answers ``ok: False`` with ``error`` and ``error_type``."""
        return self.state(app).health()

    def reset(self, app: Flask | None = None) -> int:
        """Forget every counter of ``app`` (default: the current app); for tests."""
        return self.state(app).reset()
