"""Checking a declaration's options when the decorator is made: :func:`check_options` makes the
decorator's keyword arguments a :class:`~flask_distlimit.declare.specs.LimitSpec`, or raises a
:class:`~flask_distlimit.errors.ConfigurationError` naming the fix. A ``scope`` callable that
needs a request is refused there (:func:`check_scope`; docs/design-notes.md, "Scope callables").
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Final, get_args

from flask import has_request_context

from flask_distlimit._typing import Unit
from flask_distlimit.core.algorithms import (
    CONCURRENCY,
    check_cost,
    check_limit_count,
    validate_algorithm,
)
from flask_distlimit.core.policies import validate_policy
from flask_distlimit.declare.dynamic_limits import LimitSource, read_value
from flask_distlimit.declare.lease_options import check_lease
from flask_distlimit.declare.specs import LimitSpec
from flask_distlimit.errors import ConfigurationError

#: The values of ``unit=``.
UNITS: Final[tuple[str, ...]] = get_args(Unit)


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


#: What each callable option is called with, and a working example of it.
_CALLS: Final[dict[str, tuple[int, str]]] = {
    "key_func": (0, "key_func=lambda: g.user_id"),
    "exempt_when": (0, "exempt_when=lambda: request.remote_addr in TRUSTED"),
    "cost": (0, "cost=lambda: len(request.get_json())"),
    "deduct_when": (1, "deduct_when=lambda response: response.status_code == 401"),
    "settle": (1, "settle=lambda response: int(response.headers['X-Tokens'])"),
    "on_breach": (1, "on_breach=lambda breach: log.warning('refused: %s', breach.limit)"),
    "scope": (1, "scope=lambda endpoint: endpoint.split('.')[0]"),
    # the Limiter's hooks (registered by its decorators of the same names)
    "identity_loader": (0, "lambda: (str(current_user.id), None)"),
    "api_key_verifier": (1, "lambda raw_key: KEYS.get(raw_key)"),
    "tier_resolver": (1, "lambda identity: 'free'"),
    "request_filter": (0, "lambda: request.path == '/health'"),
    "priority_resolver": (0, "lambda: 'critical' if request.path == '/pay' else None"),
}


def check_callable(name: str, func: object) -> None:
    """Refuse a ``name=`` option (a key of ``_CALLS``) that is not callable, or whose signature
    cannot take the arguments the limiter calls it with: found here, not on a request."""
    args, example = _CALLS[name]
    if not callable(func):
        raise ConfigurationError(
            f"{name}={func!r} is not callable: pass a function, e.g. {example}."
        )
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):  # a builtin without one: found out when called
        return
    try:
        signature.bind(*([None] * args))
    except TypeError:
        called = "no argument" if args == 0 else "one argument"
        raise ConfigurationError(
            f"{name}={getattr(func, '__qualname__', func)!r} takes {signature}, but it is "
            f"called with {called}: e.g. {example}."
        ) from None


#: The options a :class:`LimitSpec` keeps as given (the others are read into another form).
_AS_GIVEN: Final = (
    "key_func",
    "cost",
    "scope",
    "per_method",
    "exempt_when",
    "deduct_when",
    "settle",
    "override_defaults",
    "on_breach",
    "error_message",
    "shadow",
    "lease",
)


def check_options(
    value: LimitSource, options: Mapping[str, Any], *, concurrency: bool = False
) -> LimitSpec:
    """The spec a declaration makes from ``options``, the keyword arguments of
    :meth:`~flask_distlimit.Limiter.limit` as given: ``shared`` when it names a scope, else
    ``route``; ``declared_on`` names the declaration (``limiter.limit('1/second')``) until the
    decorator names its target (and sets the kind of a blueprint's)."""
    rates, dynamic = read_value(value, options["fallback"])
    shadow, cost, scope, unit = (options[n] for n in ("shadow", "cost", "scope", "unit"))
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
    if scope is not None and not callable(scope) and (not isinstance(scope, str) or not scope):
        raise ConfigurationError(
            f"scope={scope!r}: use a non-empty string, or a callable (endpoint) -> str."
        )
    check_scope(scope)
    for name in _CALLS:
        func = options.get(name)  # an int cost, a scope's string: checked above
        if func is not None and (callable(func) or name not in ("cost", "scope")):
            check_callable(name, func)
    message = options["error_message"]
    if message is not None and not (isinstance(message, str) or callable(message)):
        raise ConfigurationError(
            f"error_message={message!r}: use a string or a callable returning one."
        )
    if unit not in UNITS:
        raise ConfigurationError(
            f"unit={unit!r}: use one of {', '.join(map(repr, UNITS))} (what the limit "
            "counts: requests, or the bytes of the response bodies sent)."
        )
    # methods=: a set of upper-case HTTP method names (GET brings HEAD)
    method_set: frozenset[str] | None = None
    if (methods := options["methods"]) is not None:
        if isinstance(methods, str) or not all(isinstance(m, str) and m.strip() for m in methods):
            raise ConfigurationError(
                f"methods={methods!r}: use a list of HTTP method names, e.g. ['POST']."
            )
        method_set = frozenset(m.strip().upper() for m in methods)
        if not method_set:
            raise ConfigurationError("methods=[] would never apply: name at least one method.")
        if "GET" in method_set:  # Flask runs the GET view for HEAD: one limit, one quota
            method_set |= {"HEAD"}
    algorithm, policy = options["algorithm"], options["on_failure"]
    algorithm = validate_algorithm(algorithm) if algorithm is not None else None
    if concurrency:
        algorithm = CONCURRENCY  # LimitSpec checks the rates against the algorithm
    policy = validate_policy(policy) if policy is not None else None
    shown = value if isinstance(value, str) else (dynamic.described if dynamic else "")
    what = f"limiter.limit({shown!r})"
    check_lease(
        options["lease"],
        rates,
        what,
        dynamic=dynamic is not None,
        deduct_when=(
            options["deduct_when"] is not None
            or options["settle"] is not None
            or unit != "requests"
        ),
        shadow=shadow,
    )
    spec = LimitSpec(
        "shared" if scope is not None else "route",
        rates,
        algorithm=algorithm,
        on_failure=policy,
        declared_on=what,
        dynamic=dynamic,
        unit=unit,
        methods=method_set,
        **{name: options[name] for name in _AS_GIVEN},
    )
    check_limit_count(spec.rate_count, f"The rates of limiter.limit({value!r})")
    return spec
