"""What a declaration attaches to, and how it is found again: by identity, never by name.

:func:`view_objects` lists the objects whose declarations apply to one view and method;
:func:`make_carrier` makes the ``functools.wraps`` wrapper ``@limiter.limit`` returns. A wrapper
the view gate cannot find (below a decorator that skips ``functools.wraps``) enforces its limits
when it runs, in a call of their own; the first request logs a WARNING naming it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any, Final

from flask import Blueprint, Flask, has_request_context
from flask.views import View

#: How deep a ``__wrapped__`` chain is followed.
_MAX_DEPTH = 32
#: The attribute holding ``(wrapper, function, limiter)`` of a limit wrapper (the wrapper itself
#: first: a decorator using ``functools.wraps`` copies the attribute onto its own wrapper).
_CARRIED = "__distlimit_carried__"
#: What an object that carries no limits answers: no wrapper and no limiter is ever one of these.
_NOT_CARRIED: Final[tuple[object, Callable[..., Any] | None, object]] = (object(), None, object())


def describe(target: object) -> str:
    """How messages name a decorated object."""
    if isinstance(target, Blueprint):
        return f"blueprint {target.name!r} (import name {target.import_name!r})"
    if isinstance(target, Flask):
        return f"app {target.name!r} (its default limits)"
    module = getattr(target, "__module__", None) or "?"
    qualname = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    what = "view class" if isinstance(target, type) else "view"
    return f"{what} {module}.{qualname or repr(target)}"


def hashable(obj: object) -> bool:
    """Whether ``obj`` can be looked up by identity in a dict or set (a declaration's target)."""
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


def view_objects(view: object, method: str) -> tuple[list[object], list[object]]:
    """The objects a view function is known by, for one HTTP method: (objects whose limits
    apply to every method, objects whose limits apply to ``method`` only).

    The view, what it wraps (``__wrapped__``), its ``view_class`` and the class's bases, and
    the class's handlers: its ``dispatch_request`` (every method) and a ``MethodView``'s method
    for ``method`` (HEAD falls back to ``get``, as ``MethodView.dispatch_request`` does);
    hashable objects only (they are looked up by identity).
    """
    every: list[object] = []
    one: list[object] = []
    for obj in _chain(view):
        every.append(obj)
        view_class = getattr(obj, "view_class", None)
        if isinstance(view_class, type) and issubclass(view_class, View):
            every.extend(c for c in view_class.__mro__ if c not in (View, object))
            dispatch = getattr(view_class, "dispatch_request", None)
            handler = getattr(view_class, method.lower(), None)
            if handler is None and method == "HEAD":
                handler = getattr(view_class, "get", None)
            every.extend(_chain(dispatch))
            if handler is not dispatch:
                one.extend(_chain(handler))
    return [o for o in every if hashable(o)], [o for o in one if hashable(o)]


def make_carrier(
    func: Callable[..., Any], limiter: object, reached: Callable[[object], None]
) -> Callable[..., Any]:
    """A wrapper of ``func`` carrying ``limiter``'s limits; it calls ``reached(wrapper)`` when it
    runs inside a request (after the app's before_request hooks)."""

    async def call_async(*args: Any, **kwargs: Any) -> Any:
        if has_request_context():
            reached(carrier)
        return await func(*args, **kwargs)

    def call(*args: Any, **kwargs: Any) -> Any:
        if has_request_context():
            reached(carrier)
        return func(*args, **kwargs)

    carrier = functools.wraps(func)(call_async if inspect.iscoroutinefunction(func) else call)
    setattr(carrier, _CARRIED, (carrier, func, limiter))
    return carrier


def carries(func: object, limiter: object) -> bool:
    """Whether ``func`` (or the wrapper it was copied from by ``functools.wraps``) carries
    ``limiter``'s limits."""
    return getattr(func, _CARRIED, _NOT_CARRIED)[2] is limiter


def is_carrier(obj: object) -> bool:
    """Whether ``obj`` is itself a limit wrapper (not a decorator's wrapper copied from one)."""
    return getattr(obj, _CARRIED, _NOT_CARRIED)[0] is obj


def carried_function(view: object, limiter: object) -> Callable[..., Any] | None:
    """The function ``view`` wraps when ``view`` is itself a limit wrapper of ``limiter`` (not a
    decorator's wrapper around one), else None. The view gate calls it directly when the
    request's plan already decided the wrapper's limits: the wrapper would only check that."""
    wrapper, function, carrier_of = getattr(view, _CARRIED, _NOT_CARRIED)
    return function if wrapper is view and carrier_of is limiter else None
