"""What a declaration attaches to, and the objects a view is known by, by identity.

A declaration attaches to exactly the object it decorates and is found again by identity, never
by name: many views share a ``__qualname__`` (every ``View.as_view()`` function, every wrapper
written without ``functools.wraps``). For one view and HTTP method, :func:`view_objects` lists
the objects whose declarations apply: the view, what it wraps (``__wrapped__``), its
``view_class`` and the class's bases, and the class's handler for the method.
:func:`describe` names a decorated object in messages.
"""

from __future__ import annotations

from collections.abc import Iterator

from flask import Blueprint
from flask.views import View

__all__ = ["describe", "hashable", "view_objects"]

#: How deep a ``__wrapped__`` chain is followed.
_MAX_DEPTH = 32


def describe(target: object) -> str:
    """How messages name a decorated object."""
    if isinstance(target, Blueprint):
        return f"blueprint {target.name!r} (import name {target.import_name!r})"
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
    return [o for o in every if hashable(o)], [o for o in one if hashable(o)]
