"""The decorators of a :class:`~flask_distlimit.Limiter` (:class:`Declarations`), and ``with
limiter.limit(...)`` inside a view (:class:`LimitDeclaration`).

A declaration attaches to exactly the object it decorates, found again by identity
(:mod:`flask_distlimit.declare.targets`; docs/limits.md, "What a declaration attaches to"). Its
options are checked when it is made (:mod:`flask_distlimit.declare.options`, which says why a
``scope`` callable that reads the request is refused).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, Final, TypeVar, overload

from flask import Blueprint, Flask
from flask.views import View

from flask_distlimit._typing import (
    CostFunc,
    DeductWhen,
    ErrorMessage,
    ExemptWhen,
    KeyFunc,
    LimitBreachHook,
    LimitKind,
    ScopeFunc,
    Settle,
)
from flask_distlimit.declare.dynamic_limits import LimitSource
from flask_distlimit.declare.options import check_options
from flask_distlimit.declare.registry import ExemptionScope, LimitRegistry
from flask_distlimit.declare.specs import LimitSpec
from flask_distlimit.declare.targets import carries, describe, hashable, make_carrier
from flask_distlimit.engine.concurrency import MAX_CONCURRENCY
from flask_distlimit.errors import ConfigurationError

F = TypeVar("F", bound=Callable[..., object])
Decorated = TypeVar("Decorated")


@dataclass(frozen=True, slots=True)
class LimitDeclaration:
    """What ``limit``, ``shared_limit`` and ``concurrency`` return: a decorator, and a context
    manager deciding the limit where a ``with`` block in a view starts."""

    limiter: Declarations
    #: the options, checked; ``declared_on`` names the declaration (``limiter.limit('...')``)
    checked: LimitSpec

    def __call__(self, target: Decorated) -> Decorated:
        limiter = self.limiter
        what = self.checked.declared_on
        kind_on: LimitKind = self.checked.kind
        if kind_on == "route" and isinstance(target, (Blueprint, Flask)):
            kind_on = "blueprint" if isinstance(target, Blueprint) else "default"
        spec = replace(self.checked, kind=kind_on, declared_on=describe(target))
        registry = limiter.registry
        registry.check_open(target, what)

        def add(table: dict[Any, list[LimitSpec]], key: object) -> None:
            specs = table.setdefault(key, [])
            limiter._declared([*specs, spec])
            specs.append(spec)

        if isinstance(target, (Blueprint, Flask)):  # an app's limits: default limits
            add(registry.blueprints, target)
            return target
        if isinstance(target, type) and issubclass(target, View):
            add(registry.views, target)
            limiter._carry_in_decorators(target)
            return target
        if not callable(target):
            raise _not_a_target(what, target)
        # the target itself when it already carries this limiter's limits, else a wrapper
        # that tells the limiter when it runs (after the app's before_request hooks)
        carrier: Callable[..., Any] = target
        if registry.views.get(target) is None or not carries(target, limiter):
            carrier = make_carrier(target, limiter, limiter._reached)
        add(registry.views, carrier)
        if carrier is not target and hashable(target):
            registry.wrapped_by.setdefault(target, []).append(carrier)
        return carrier  # type: ignore[return-value]

    def __enter__(self) -> None:
        if self.checked.lease is not False:
            raise ConfigurationError(
                f"{self.checked.declared_on} with lease= cannot be a with block: a lease is "
                "held per route, bound once. Declare the limit on the view instead."
            )
        self.limiter._entered(replace(self.checked, declared_on="a with block"))

    def __exit__(self, *exc_info: object) -> None:
        return None


class Declarations:
    """The declaration API of :class:`~flask_distlimit.Limiter`: ``limit``, ``shared_limit``
    and ``exempt``. The registry it fills is ``self.registry``."""

    registry: LimitRegistry
    #: called by a wrapper when its view runs inside a request (the extension enforces)
    _reached: Callable[[object], None]
    #: called when a ``with limiter.limit(...)`` block starts (the extension enforces)
    _entered: Callable[[LimitSpec], None]
    #: called with a target's limits, a new one last, before it is added (the extension checks
    #: them against the apps it is already set up on)
    _declared: Callable[[list[LimitSpec]], None]

    def limit(
        self,
        value: LimitSource,
        *,
        algorithm: str | None = None,
        key_func: KeyFunc | None = None,
        cost: int | CostFunc | None = None,
        scope: str | ScopeFunc | None = None,
        per_method: bool = False,
        exempt_when: ExemptWhen | None = None,
        on_failure: str | None = None,
        fallback: str | None = None,
        deduct_when: DeductWhen | None = None,
        settle: Settle | None = None,
        unit: str = "requests",
        methods: Iterable[str] | None = None,
        override_defaults: bool = True,
        on_breach: LimitBreachHook | None = None,
        error_message: ErrorMessage | None = None,
        shadow: bool = False,
        lease: bool | int = False,
    ) -> LimitDeclaration:
        """Limit a view function, a view class, one method of a class-based view, or every
        route of a Blueprint; stackable. On the Flask app itself (``limiter.limit(...)(app)``),
        a default limit with every option here, beside ``DISTLIMIT_DEFAULT_LIMITS``. Or, inside
        a view, ``with limiter.limit("1/second"):`` decides the limit when the block starts, in a
        storage call of its own, and raises the 429 there (as Flask-Limiter's context-manager
        form does); counted per endpoint, like a limit on the view.

        - ``value``: ``"100/minute"``, several joined by ``;`` (``"10/second;1000/hour"``); or
          a callable answering such a string per identity (kept
          ``DISTLIMIT_DYNAMIC_LIMIT_TTL`` seconds), or a mapping tier -> limit string
          (``{"free": "10/minute", "pro": "100/minute", "*": "5/minute"}``):
          :mod:`flask_distlimit.declare.dynamic_limits`;
        - ``algorithm``: one of :data:`~flask_distlimit.ALGORITHMS` (default
          ``DISTLIMIT_ALGORITHM``);
        - ``key_func``: who is counted, e.g. ``lambda: g.tenant_id`` (default: the request's
          identity: verified user, JWT or API key, else the client IP); it answers a ``str`` or
          ``int``, or ``None``/``""`` to skip this limit for the request (as in
          Flask-Limiter); it runs after the app's and the blueprints' ``before_request`` hooks,
          and, declared below another decorator, after that decorator too;
        - ``cost``: units per request, an int >= 0 or a callable answering one (default 1, or
          ``DISTLIMIT_CONDITIONAL_COST`` for conditional requests);
        - ``scope``: share one counter among every route naming the same scope (an int, such as
          a view argument in a ``with`` block, is its string); a callable is
          called with the endpoint when the route's limits are bound (its first request), so
          one that reads the request is refused when declared, with the port (the module
          docstring says why);
        - ``per_method``: count each HTTP method separately;
        - ``exempt_when``: a callable; when it answers true the limit is skipped;
        - ``on_failure``: ``"open"``, ``"closed"`` or ``"local"``: this route's policy when the
          storage is down (the strictest wins when several limits of a route set one);
        - ``fallback``: for a callable ``value``: the limit string used when it fails (default:
          no limit);
        - ``deduct_when``: ``(response) -> bool``: the cost is reserved before the view (refused
          when it does not fit) and given back after the response when it answers false (a
          second storage call); a callable ``cost`` is then called after the response:
          :mod:`flask_distlimit.request.deduction`;
        - ``settle``: ``(response) -> int``: the units the request really cost, known after the
          response (tokens used, rows scanned); ``cost`` is then the reservation made before the
          view, and the difference is charged (up to the limit) or given back:
          :mod:`flask_distlimit.request.deduction`;
        - ``unit``: ``"requests"`` (the default), or ``"content-bytes"``: the limit counts the
          bytes of the response bodies the server sent (``send_file``, byte ranges and streams
          included; a ``HEAD`` costs 0), settled when the body ends; ``cost`` is then the
          reservation before the view (default 1);
        - ``methods``: the HTTP methods the limit applies to (default: every one; ``GET``
          includes ``HEAD``, which Flask answers with the GET view);
        - ``override_defaults``: False keeps ``DISTLIMIT_DEFAULT_LIMITS`` beside this limit;
        - ``on_breach``: called with a :class:`~flask_distlimit.Breach` when this limit
          refuses, after the Limiter's hook; may return a response (sent instead of the
          Limiter's hook's); one that raises is logged and the 429 sent all the same;
        - ``error_message``: the 429's ``detail`` when this limit refuses (a string, or a
          callable answering one).
        - ``shadow``: count as if enforced but never refuse; log and count what it would have
          refused (:mod:`flask_distlimit.defences.shadow`).
        - ``lease``: ``True`` (sized from this process's traffic) or a number of units: take
          units from the shared count in advance and spend them in-process, so most requests
          need no storage call (:mod:`flask_distlimit.resilience.leases`, ``docs/leasing.md``); for
          a hot key shared by many clients. Not with ``sliding_window_log``.
        """
        if isinstance(scope, int) and not isinstance(scope, bool):
            scope = str(scope)  # a view argument, as in Flask-Limiter: ``scope=order_id``
        # only the arguments are local yet
        return LimitDeclaration(self, check_options(value, locals()))

    def shared_limit(
        self,
        value: LimitSource,
        scope: str | ScopeFunc,
        *,
        algorithm: str | None = None,
        key_func: KeyFunc | None = None,
        cost: int | CostFunc | None = None,
        per_method: bool = False,
        exempt_when: ExemptWhen | None = None,
        on_failure: str | None = None,
        fallback: str | None = None,
        deduct_when: DeductWhen | None = None,
        settle: Settle | None = None,
        unit: str = "requests",
        methods: Iterable[str] | None = None,
        override_defaults: bool = True,
        on_breach: LimitBreachHook | None = None,
        error_message: ErrorMessage | None = None,
        shadow: bool = False,
        lease: bool | int = False,
    ) -> LimitDeclaration:
        """A limit whose one counter (per client) is shared by every route that names ``scope``
        (the options are :meth:`limit`'s)."""
        if not callable(scope) and (not isinstance(scope, str) or not scope):
            raise ConfigurationError(
                f"shared_limit needs a non-empty scope string, got {scope!r}: e.g. "
                "limiter.shared_limit('100/minute', scope='search')."
            )
        return LimitDeclaration(self, check_options(value, locals()))

    def concurrency(
        self,
        limit: int,
        *,
        key_func: KeyFunc | None = None,
        scope: str | None = None,
        on_failure: str | None = None,
    ) -> LimitDeclaration:
        """At most ``limit`` requests of one client in flight at once, across every process
        and instance (:mod:`flask_distlimit.defences.concurrency`); ``key_func``, ``scope`` and
        ``on_failure`` as for :meth:`limit`. Decided in the request's one storage call with its
        rate limits; the slot is given back when the response ends, or by its lease
        (``DISTLIMIT_CONCURRENCY_LEASE``) if the process died."""
        whole = isinstance(limit, int) and not isinstance(limit, bool)
        if not whole or not 0 < limit <= MAX_CONCURRENCY:
            raise ConfigurationError(
                f"limiter.concurrency({limit!r}): use an int from 1 to {MAX_CONCURRENCY} (the "
                "requests of one client in flight at once), e.g. limiter.concurrency(20)."
            )
        options = dict(_LIMIT_DEFAULTS, key_func=key_func, scope=scope, on_failure=on_failure)
        # the period is the lease, set at init_app
        return LimitDeclaration(self, check_options(f"{limit}/second", options, concurrency=True))

    def _carry_in_decorators(self, view_class: type[View]) -> None:
        """Append, once, a decorator to the class's ``decorators`` whose wrapper carries the
        class's limits (for an ``as_view()`` result wrapped by a decorator without
        ``functools.wraps``)."""
        marker = f"__distlimit_decorates_{id(self):x}__"
        if view_class.__dict__.get(marker):
            return
        registry = self.registry
        specs = registry.views[view_class]

        def carry(view: F) -> F:
            carrier = make_carrier(view, self, self._reached)
            registry.views[carrier] = specs  # the class's list: later declarations show too
            return carrier  # type: ignore[return-value]

        setattr(view_class, marker, True)
        view_class.decorators = [*view_class.decorators, carry]

    @overload
    def exempt(self, target: F, *, flags: ExemptionScope | None = None) -> F: ...
    @overload
    def exempt(self, target: Blueprint, *, flags: ExemptionScope | None = None) -> Blueprint: ...
    @overload
    def exempt(self, *, flags: ExemptionScope) -> Callable[[F], F]: ...
    def exempt(self, target: object = None, *, flags: ExemptionScope | None = None) -> object:
        """No limits and no headers for this view, view class, method of a class-based view
        (that HTTP method), or Blueprint (and the blueprints nested in it); with ``flags``, only
        what they name (:class:`~flask_distlimit.ExemptionScope`): ``@limiter.exempt(flags=
        ExemptionScope.DEFAULT)``, or ``limiter.exempt(bp, flags=...)``."""
        if flags is not None and (not isinstance(flags, ExemptionScope) or not flags):
            raise ConfigurationError(
                f"limiter.exempt(flags={flags!r}): flags must be one or more ExemptionScope "
                "members, e.g. ExemptionScope.DEFAULT | ExemptionScope.APPLICATION; leave "
                "flags out for a whole exemption."
            )
        if target is None:
            if flags is None:
                raise ConfigurationError(
                    "limiter.exempt() needs a view or blueprint: use @limiter.exempt, "
                    "or limiter.exempt(flags=...) for an exemption in part."
                )
            return lambda view: self.exempt(view, flags=flags)
        self.registry.check_open(target, "limiter.exempt")
        if not (isinstance(target, Blueprint) or hashable(target)):
            raise _not_a_target("limiter.exempt", target)
        if flags is not None:
            self.registry.scopes[target] = self.registry.scopes.get(target, flags) | flags
        elif isinstance(target, Blueprint):
            self.registry.exempt_blueprints.add(target)
        else:
            self.registry.exempt_views.add(target)
        return target


def _not_a_target(what: str, target: object) -> ConfigurationError:
    return ConfigurationError(
        f"{what} decorates a view function, a View class, a method of one, or a Blueprint; got "
        f"{target!r}."
    )


#: :meth:`Declarations.limit`'s options and their defaults, for :meth:`Declarations.concurrency`.
_LIMIT_DEFAULTS: Final[dict[str, Any]] = dict(Declarations.limit.__kwdefaults__ or {})
