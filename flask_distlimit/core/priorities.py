"""Request priorities, ``critical``, ``default``, ``sheddable``: which traffic goes first when
the service is overloaded (:mod:`flask_distlimit.defences.shedding`).

A view's priority is its ``@limiter.priority(...)``, else the answer of the Limiter's
``@limiter.priority_resolver`` (called once per request, after every ``before_request`` hook;
``None`` is ``default``), else ``default`` (docs/defences.md, "Load shedding by priority").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, Literal, TypeVar, get_args

from flask_distlimit.errors import ConfigurationError

Priority = Literal["critical", "default", "sheddable"]
#: From the most to the least important.
PRIORITIES: Final[tuple[Priority, ...]] = get_args(Priority)
#: ``() -> priority or None``, called inside the request.
PriorityResolver = Callable[[], str | None]

F = TypeVar("F")
_MAX_DEPTH: Final = 32


def validate_priority(value: object, where: str = "priority") -> Priority:
    """``value`` as a :data:`Priority`, or :class:`ConfigurationError`."""
    if isinstance(value, str) and value in PRIORITIES:
        return value
    raise ConfigurationError(
        f"{where}={value!r} is not a priority. Use one of: {', '.join(PRIORITIES)}."
    )


class PriorityRegistry:
    """The priorities declared on views (by identity) and the Limiter-wide resolver."""

    def __init__(self) -> None:
        self.views: dict[object, Priority] = {}
        self.resolver: PriorityResolver | None = None

    def declare(self, priority: str) -> Callable[[F], F]:
        checked = validate_priority(priority)

        def decorator(view: F) -> F:
            if not callable(view):
                raise ConfigurationError(
                    f"limiter.priority({priority!r}) decorates a view function; got {view!r}."
                )
            self.views[view] = checked
            return view

        return decorator

    def of_view(self, view: object) -> Priority | None:
        """The priority declared on ``view`` or on a function it wraps (``__wrapped__``)."""
        for _ in range(_MAX_DEPTH):
            if view is None:
                return None
            try:
                found = self.views.get(view)
            except TypeError:  # unhashable
                return None
            if found is not None:
                return found
            view = getattr(view, "__wrapped__", None)  # the function it wraps, if any
        return None

    def of_request(self, view: object | None) -> Priority:
        """The request's priority: its view's, else the resolver's, else ``default``."""
        found = self.of_view(view)  # None for no view
        if found is not None:
            return found
        resolver = self.resolver
        if resolver is not None:
            answer = resolver()
            if answer is not None:
                return validate_priority(answer, "the priority resolver's answer")
        return "default"
