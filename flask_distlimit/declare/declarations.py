"""Declaring limits: the decorators of a :class:`~flask_distlimit.Limiter` and the registry
they fill.

A declaration attaches to exactly the object it decorates, found again by identity, never by
name (many views share a ``__qualname__``: every ``View.as_view()`` function, every wrapper
written without ``functools.wraps``):

- a view function: ``@limiter.limit`` returns a ``functools.wraps`` wrapper that carries the
  limits; stacked declarations share one wrapper;
- a method of a class-based view (``def post(self)``): the same wrapper; the limit applies to
  that HTTP method only and is counted per method;
- a ``View``/``MethodView`` class: the class itself (its subclasses inherit it, as they inherit
  ``decorators``), and a wrapper appended to the class's ``decorators`` so that ``as_view``
  carries it;
- ``decorators=[limiter.limit(...)]`` in a class body: the wrapper of the view ``as_view`` makes;
- a ``Blueprint``: the blueprint object, whatever name it is registered under and however often.

Where the limits are found before the view runs (a view's ``__wrapped__`` chain, its
``view_class`` and the class's handler for the request method), every limit of the request goes
to the storage in one call. A wrapper the chain does not reach (a decorator above it that skips
``functools.wraps``) still enforces its limits when it is called, in a call of its own; the
first request logs a WARNING naming it.

A ``scope`` callable is called with the endpoint once, when the route's limits are bound (its
first request), never per request. Flask-Limiter calls it on every request, and its "dynamic
shared limit" recipe (``scope=lambda endpoint: request.host``) relies on that: bound once here,
every host would share the first host's counter, without a word. So a scope callable is tried
at declaration, outside any request, with a sample endpoint: one that needs a request or app
context (it raises Flask's ``RuntimeError``) is refused with the port spelled out (the value it
reads goes in ``key_func``, the scope becomes a string); one that answers from the endpoint alone
is kept.

Declarations close for an object once an app serves it: declaring a limit or an exemption on
a view, class or blueprint that an app already served a request for raises
:class:`~flask_distlimit.errors.ConfigurationError`, as Flask's own setup methods do.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar, overload

from flask import Blueprint, has_request_context
from flask.views import View

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
)
from flask_distlimit.core.algorithms import (
    CONCURRENCY,
    Algorithm,
    check_cost,
    check_limit_count,
    validate_algorithm,
)
from flask_distlimit.core.limits import Rate
from flask_distlimit.core.policies import validate_policy
from flask_distlimit.declare.dynamic_limits import DynamicValue, LimitSource, read_value
from flask_distlimit.declare.lease_options import check_lease, check_lease_algorithm
from flask_distlimit.engine.concurrency import MAX_CONCURRENCY
from flask_distlimit.engine.registry import check_rate
from flask_distlimit.errors import ConfigurationError

__all__ = [
    "Declarations",
    "LimitRegistry",
    "LimitSpec",
    "carried_function",
    "check_scope",
    "describe",
    "view_objects",
]

F = TypeVar("F", bound=Callable[..., object])
Decorated = TypeVar("Decorated")

#: The attribute naming the limiter whose limits a wrapper carries.
_CARRIER = "__distlimit_limiter__"
#: The attribute holding ``(wrapper, function)`` of a limit wrapper (the wrapper itself first:
#: a decorator using ``functools.wraps`` copies the attribute onto its own wrapper).
_CARRIED = "__distlimit_carried__"
#: How deep a ``__wrapped__`` chain is followed.
_MAX_DEPTH = 32


def carried_function(view: object, limiter: object) -> Callable[..., Any] | None:
    """The function ``view`` wraps when ``view`` is itself a limit wrapper of ``limiter`` (not a
    decorator's wrapper around one), else None. The view gate calls it directly when the
    request's plan already decided the wrapper's limits: the wrapper would only check that."""
    carried = getattr(view, _CARRIED, None)
    if (
        isinstance(carried, tuple)
        and carried[0] is view
        and getattr(view, _CARRIER, None) is limiter
    ):
        return carried[1]  # type: ignore[no-any-return]
    return None


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
    deduct_when: DeductWhen | None = None  #: checked before the view, charged after it
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

    def shown(self) -> str:
        """The value as written, for messages and listings."""
        if self.dynamic is not None:
            return self.dynamic.described
        return "; ".join(str(r) for r in self.rates)

    def with_kind(self, kind: LimitKind, *, per_method: bool | None = None) -> LimitSpec:
        """This spec as another kind (and maybe counted per method)."""
        return replace(
            self, kind=kind, per_method=self.per_method if per_method is None else per_method
        )


#: The endpoint a ``scope`` callable is tried with at declaration.
_SAMPLE_ENDPOINT = "distlimit_scope_probe.view"


def check_scope(scope: object) -> None:
    """Refuse a ``scope`` callable that reads the request (see the module docstring); a string
    or None passes. Raises :class:`ConfigurationError` with the port."""
    if not callable(scope):
        return
    name = getattr(scope, "__qualname__", None) or repr(scope)
    port = (
        "Flask-Limiter calls a scope callable on every request (its dynamic shared limit: "
        "scope=lambda endpoint: request.host); here a scope is bound once per route, so every "
        "request would share the first one's counter. Port it: name the scope with a string "
        "and put what the callable reads in key_func, e.g. limiter.shared_limit('100/hour', "
        "scope='per-host', key_func=lambda: request.host) for one counter per host, or "
        "key_func=lambda: f'{request.host}|{g.user_id}' for one per client of each host. A "
        "scope callable that answers from the endpoint it is given alone is accepted. See "
        "docs/migrating-from-flask-limiter.md."
    )
    if has_request_context():
        raise ConfigurationError(
            f"scope={name} is declared inside a request, where it cannot be told whether it "
            "reads the request. Declare limits at import time or in the app factory, outside "
            f"any request. {port}"
        )
    try:
        scope(_SAMPLE_ENDPOINT)  # its answer for a real endpoint is checked when bound
    except RuntimeError as exc:  # Flask's "Working outside of request/application context."
        raise ConfigurationError(
            f"scope={name} reads the request or the app context (called with an endpoint "
            f"outside any request, it raised RuntimeError: {exc}). {port}"
        ) from None
    except Exception:  # it may need a real endpoint: checked when bound, as before
        return


def describe(target: object) -> str:
    """How messages name a decorated object."""
    if isinstance(target, Blueprint):
        return f"blueprint {target.name!r} (import name {target.import_name!r})"
    module = getattr(target, "__module__", None) or "?"
    qualname = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    what = "view class" if isinstance(target, type) else "view"
    return f"{what} {module}.{qualname or repr(target)}"


def _hashable(obj: object) -> bool:
    try:
        hash(obj)
    except TypeError:
        return False
    return True


def _chain(obj: object) -> Iterator[object]:
    """``obj`` and what it wraps through ``functools.wraps`` (``__wrapped__``)."""
    seen: list[object] = []
    current: object | None = obj
    while current is not None and len(seen) < _MAX_DEPTH and not any(current is s for s in seen):
        seen.append(current)
        yield current
        current = getattr(current, "__wrapped__", None)


def _handlers(view_class: type, method: str) -> tuple[list[object], list[object]]:
    """(every-method handlers, this-method handlers) of a class-based view: its
    ``dispatch_request``, and a ``MethodView``'s method for ``method`` (HEAD falls back to
    ``get``, as ``MethodView.dispatch_request`` does)."""
    every = [getattr(view_class, "dispatch_request", None)]
    one: list[object] = []
    if method:
        handler = getattr(view_class, method.lower(), None)
        if handler is None and method == "HEAD":
            handler = getattr(view_class, "get", None)
        if handler is not None and handler is not every[0]:
            one.append(handler)
    return [o for h in every if h is not None for o in _chain(h)], [
        o for h in one for o in _chain(h)
    ]


def view_objects(view: object, method: str) -> tuple[list[object], list[object]]:
    """The objects a view function is known by, for one HTTP method: (objects whose limits
    apply to every method, objects whose limits apply to ``method`` only).

    The view, what it wraps (``__wrapped__``), its ``view_class`` and the class's bases, and
    the class's handlers; hashable objects only (they are looked up by identity).
    """
    every: list[object] = []
    one: list[object] = []
    for obj in _chain(view):
        every.append(obj)
        view_class = getattr(obj, "view_class", None)
        if isinstance(view_class, type) and issubclass(view_class, View):
            every.extend(c for c in view_class.__mro__ if c not in (View, object))
            all_methods, this_method = _handlers(view_class, method)
            every.extend(all_methods)
            one.extend(this_method)
    return [o for o in every if _hashable(o)], [o for o in one if _hashable(o)]


@dataclass
class LimitRegistry:
    """Every limit and exemption declared through one ``Limiter``, by object identity."""

    views: dict[object, list[LimitSpec]] = field(default_factory=dict)
    exempt_views: set[object] = field(default_factory=set)
    #: a decorated function -> the limit wrappers made of it (``@limiter.limit`` above
    #: ``@app.route`` registers the function itself: its limits still apply)
    wrapped_by: dict[object, list[object]] = field(default_factory=dict)
    blueprints: dict[object, list[LimitSpec]] = field(default_factory=dict)
    exempt_blueprints: set[object] = field(default_factory=set)
    #: the objects each app served (held by the app's state; dropped with it)
    _served: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)

    def watch(self, served: Any) -> None:
        """``served.objects`` is the set of objects an app serves: declaring on one of them
        from now on raises."""
        self._served.add(served)

    def check_open(self, target: object, what: str) -> None:
        """Raise if an app already serves ``target``: a declaration on it would never apply."""
        if not _hashable(target):
            return
        for served in list(self._served):
            if target in served.objects:
                raise ConfigurationError(
                    f"{what} on {describe(target)} comes after the app {served.app_name!r} "
                    "served its first request, so it would never apply: that app bound its "
                    "limits then. Declare every limit and exemption before the app serves "
                    "(at import time or in the app factory), as Flask requires for app.route."
                )

    def add_view(self, view: object, spec: LimitSpec) -> None:
        self.views.setdefault(view, []).append(spec)

    def attached(self, view: object, method: str) -> tuple[list[object], list[object]]:
        """:func:`view_objects` of ``view`` and ``method``, with the limit wrappers made of
        each of them."""
        every, one = view_objects(view, method)
        wrapped_by = self.wrapped_by
        if wrapped_by:
            every += [w for o in every for w in wrapped_by.get(o, ())]
            one += [w for o in one for w in wrapped_by.get(o, ())]
        return every, one

    def add_blueprint(self, blueprint: Blueprint, spec: LimitSpec) -> None:
        self.blueprints.setdefault(blueprint, []).append(spec)

    def declared(self) -> list[LimitSpec]:
        """Every spec declared so far, on views and blueprints."""
        tables: tuple[dict[Any, list[LimitSpec]], ...] = (self.views, self.blueprints)
        return [spec for table in tables for specs in table.values() for spec in specs]


class Declarations:
    """The declaration API of :class:`~flask_distlimit.Limiter`: ``limit``, ``shared_limit``
    and ``exempt``. The registry it fills is ``self.registry``."""

    registry: LimitRegistry

    def _reached(self, carrier: object) -> None:
        """Called by a wrapper when its view runs inside a request (the extension enforces)."""
        raise NotImplementedError

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
        methods: Iterable[str] | None = None,
        override_defaults: bool = True,
        on_breach: LimitBreachHook | None = None,
        error_message: ErrorMessage | None = None,
        shadow: bool = False,
        lease: bool | int = False,
    ) -> Callable[[Decorated], Decorated]:
        """Limit a view function, a view class, one method of a class-based view, or every
        route of a Blueprint; stackable.

        - ``value``: ``"100/minute"``, several joined by ``;`` (``"10/second;1000/hour"``); or
          a callable answering such a string per identity (kept
          ``DISTLIMIT_DYNAMIC_LIMIT_TTL`` seconds), or a mapping tier -> limit string
          (``{"free": "10/minute", "pro": "100/minute", "*": "5/minute"}``):
          :mod:`flask_distlimit.declare.dynamic_limits`;
        - ``algorithm``: one of :data:`~flask_distlimit.ALGORITHMS` (default
          ``DISTLIMIT_ALGORITHM``);
        - ``key_func``: who is counted, e.g. ``lambda: g.tenant_id`` (default: the request's
          identity: verified user, JWT or API key, else the client IP); it answers a ``str`` or
          ``int``, or ``None``/``""`` for the request's own identity, and runs after the app's
          and the blueprints' ``before_request`` hooks, so it sees what they set;
        - ``cost``: units per request, an int >= 0 or a callable answering one (default 1, or
          ``DISTLIMIT_CONDITIONAL_COST`` for conditional requests);
        - ``scope``: share one counter among every route naming the same scope; a callable is
          called with the endpoint when the route's limits are bound (its first request), so
          one that reads the request is refused when declared, with the port (the module
          docstring says why);
        - ``per_method``: count each HTTP method separately;
        - ``exempt_when``: a callable; when it answers true the limit is skipped;
        - ``on_failure``: ``"open"``, ``"closed"`` or ``"local"``: this route's policy when the
          storage is down (the strictest wins when several limits of a route set one);
        - ``fallback``: for a callable ``value``: the limit string used when it fails (default:
          no limit);
        - ``deduct_when``: ``(response) -> bool``: the request is refused before the view when
          the quota is spent, and charged after the response only when it answers true (a
          second storage call): :mod:`flask_distlimit.request.deduction`;
        - ``methods``: the HTTP methods the limit applies to (default: every one; ``GET``
          includes ``HEAD``, which Flask answers with the GET view);
        - ``override_defaults``: False keeps ``DISTLIMIT_DEFAULT_LIMITS`` beside this limit;
        - ``on_breach``: called with a :class:`~flask_distlimit.Breach` when this limit
          refuses, instead of the Limiter's hook; may return a response;
        - ``error_message``: the 429's ``detail`` when this limit refuses (a string, or a
          callable answering one).
        - ``shadow``: count as if enforced but never refuse; log and count what it would have
          refused (:mod:`flask_distlimit.defences.shadow`).
        - ``lease``: ``True`` (sized from this process's traffic) or a number of units: take
          units from the shared count in advance and spend them in-process, so most requests
          need no storage call (:mod:`flask_distlimit.resilience.leases`, ``docs/leasing.md``); for
          a hot key shared by many clients. Not with ``sliding_window_log``.
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
            fallback=fallback,
            deduct_when=deduct_when,
            methods=methods,
            override_defaults=override_defaults,
            on_breach=on_breach,
            error_message=error_message,
            shadow=shadow,
            lease=lease,
        )

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
        methods: Iterable[str] | None = None,
        override_defaults: bool = True,
        on_breach: LimitBreachHook | None = None,
        error_message: ErrorMessage | None = None,
        shadow: bool = False,
        lease: bool | int = False,
    ) -> Callable[[Decorated], Decorated]:
        """A limit whose one counter (per client) is shared by every route that names ``scope``
        (the options are :meth:`limit`'s)."""
        if not callable(scope) and (not isinstance(scope, str) or not scope):
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
            fallback=fallback,
            deduct_when=deduct_when,
            methods=methods,
            override_defaults=override_defaults,
            on_breach=on_breach,
            error_message=error_message,
            shadow=shadow,
            lease=lease,
        )

    def concurrency(
        self,
        limit: int,
        *,
        key_func: KeyFunc | None = None,
        scope: str | None = None,
        on_failure: str | None = None,
    ) -> Callable[[Decorated], Decorated]:
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
        return self._declare(
            "shared" if scope is not None else "route",
            f"{limit}/second",  # the period is the lease, set at init_app
            algorithm=None,
            key_func=key_func,
            cost=None,
            scope=scope,
            per_method=False,
            exempt_when=None,
            on_failure=on_failure,
            concurrency=True,
        )

    def _declare(
        self,
        kind: LimitKind,
        value: LimitSource,
        *,
        algorithm: str | None,
        key_func: KeyFunc | None,
        cost: int | CostFunc | None,
        scope: str | ScopeFunc | None,
        per_method: bool,
        exempt_when: ExemptWhen | None,
        on_failure: str | None,
        fallback: str | None = None,
        deduct_when: DeductWhen | None = None,
        methods: Iterable[str] | None = None,
        override_defaults: bool = True,
        on_breach: LimitBreachHook | None = None,
        error_message: ErrorMessage | None = None,
        shadow: bool = False,
        concurrency: bool = False,
        lease: bool | int = False,
    ) -> Callable[[Decorated], Decorated]:
        rates, dynamic = read_value(value, fallback)
        if not isinstance(shadow, bool):
            raise ConfigurationError(f"shadow={shadow!r}: use True or False.")
        if not rates and dynamic is None:
            raise ConfigurationError(
                f"limiter.limit needs at least one rate, got {value!r}: e.g. '100/minute'."
            )
        if (
            cost is not None
            and not callable(cost)
            and (isinstance(cost, bool) or not isinstance(cost, int) or cost < 0)
        ):
            raise ConfigurationError(f"cost={cost!r}: use an int >= 0 or a callable returning one.")
        if isinstance(cost, int) and rates:  # a callable's value is checked when it answers
            check_cost(cost, rates, f"limiter.limit({value!r})")
        count = dynamic.most_rates() if dynamic is not None else len(rates)
        check_limit_count(count, f"The rates of limiter.limit({value!r})")
        if scope is not None and not callable(scope) and (not isinstance(scope, str) or not scope):
            raise ConfigurationError(
                f"scope={scope!r}: use a non-empty string, or a callable (endpoint) -> str."
            )
        check_scope(scope)
        for name, func in (
            ("key_func", key_func),
            ("exempt_when", exempt_when),
            ("deduct_when", deduct_when),
            ("on_breach", on_breach),
        ):
            if func is not None and not callable(func):
                raise ConfigurationError(
                    f"{name}={func!r} is not callable: pass a function, e.g. "
                    "deduct_when=lambda response: response.status_code == 401."
                )
        if error_message is not None and not (
            isinstance(error_message, str) or callable(error_message)
        ):
            raise ConfigurationError(
                f"error_message={error_message!r}: use a string or a callable returning one."
            )
        method_set: frozenset[str] | None = None
        if methods is not None:
            if isinstance(methods, str) or not all(
                isinstance(m, str) and m.strip() for m in methods
            ):
                raise ConfigurationError(
                    f"methods={methods!r}: use a list of HTTP method names, e.g. ['POST']."
                )
            method_set = frozenset(m.strip().upper() for m in methods)
            if not method_set:
                raise ConfigurationError("methods=[] would never apply: name at least one method.")
            if "GET" in method_set:  # Flask runs the GET view for HEAD: one limit, one quota
                method_set |= {"HEAD"}
        checked_algorithm = validate_algorithm(algorithm) if algorithm is not None else None
        if concurrency:
            checked_algorithm = CONCURRENCY
        if checked_algorithm is not None:
            for rate in rates:
                check_rate(checked_algorithm, rate)
            if dynamic is not None:
                dynamic.check_algorithm(checked_algorithm)
        policy = validate_policy(on_failure) if on_failure is not None else None
        shown = value if isinstance(value, str) else (dynamic.described if dynamic else "")
        check_lease(
            lease,
            rates,
            f"limiter.limit({shown!r})",
            algorithm=checked_algorithm,
            dynamic=dynamic is not None,
            deduct_when=deduct_when is not None,
            shadow=shadow,
        )

        def decorator(target: Decorated) -> Decorated:
            spec = LimitSpec(
                "blueprint" if kind == "route" and isinstance(target, Blueprint) else kind,
                rates,
                algorithm=checked_algorithm,
                key_func=key_func,
                cost=cost,
                scope=scope,
                per_method=per_method,
                exempt_when=exempt_when,
                on_failure=policy,
                declared_on=describe(target),
                dynamic=dynamic,
                deduct_when=deduct_when,
                methods=method_set,
                override_defaults=override_defaults,
                on_breach=on_breach,
                error_message=error_message,
                shadow=shadow,
                lease=lease,
            )
            self.registry.check_open(target, f"limiter.limit({shown!r})")
            if isinstance(target, Blueprint):
                self.registry.add_blueprint(target, spec)
                return target
            if isinstance(target, type) and issubclass(target, View):
                self.registry.add_view(target, spec)
                self._carry_in_decorators(target)
                return target
            if not callable(target):
                raise ConfigurationError(
                    f"limiter.limit({shown!r}) decorates a view function, a View class, a "
                    f"method of one, or a Blueprint; got {target!r}."
                )
            carrier = self._carrier(target)
            if carrier is not target and _hashable(target):
                self.registry.wrapped_by.setdefault(target, []).append(carrier)
            self.registry.add_view(carrier, spec)
            return carrier  # type: ignore[return-value]

        return decorator

    def _carrier(self, func: Callable[..., Any], *, reuse: bool = True) -> Callable[..., Any]:
        """``func`` itself when it already carries this limiter's limits (and ``reuse``), else a
        wrapper that tells the limiter when it runs (after the app's before_request hooks)."""
        if (
            reuse
            and self.registry.views.get(func) is not None
            and getattr(func, _CARRIER, None) is self
        ):
            return func
        reached = self._reached
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_carrier(*args: Any, **kwargs: Any) -> Any:
                if has_request_context():
                    reached(async_carrier)
                return await func(*args, **kwargs)

            setattr(async_carrier, _CARRIER, self)
            setattr(async_carrier, _CARRIED, (async_carrier, func))
            return async_carrier

        @functools.wraps(func)
        def carrier(*args: Any, **kwargs: Any) -> Any:
            if has_request_context():
                reached(carrier)
            return func(*args, **kwargs)

        setattr(carrier, _CARRIER, self)
        setattr(carrier, _CARRIED, (carrier, func))
        return carrier

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
            carrier = self._carrier(view, reuse=False)
            registry.views[carrier] = specs  # the class's list: later declarations show too
            return carrier  # type: ignore[return-value]

        setattr(view_class, marker, True)
        view_class.decorators = [*view_class.decorators, carry]

    @overload
    def exempt(self, target: F) -> F: ...
    @overload
    def exempt(self, target: Blueprint) -> Blueprint: ...
    def exempt(self, target: object) -> object:
        """No limits and no headers for this view, view class, method of a class-based view
        (that HTTP method), or Blueprint (and the blueprints nested in it)."""
        self.registry.check_open(target, "limiter.exempt")
        if isinstance(target, Blueprint):
            self.registry.exempt_blueprints.add(target)
        elif _hashable(target):
            self.registry.exempt_views.add(target)
        else:
            raise ConfigurationError(
                f"limiter.exempt decorates a view function, a View class, a method of one, or a "
                f"Blueprint; got {target!r}."
            )
        return target
