"""The limit wrapper: what ``@limiter.limit`` returns for a view function or a method.

A carrier is a ``functools.wraps`` wrapper (async for a coroutine function) marked with the
limiter whose limits it carries. Where the view gate finds it before the view runs (through
the view's ``__wrapped__`` chain), the request's plan decides its limits and the gate calls the
wrapped function directly (:func:`carried_function`). A carrier the chain does not reach (a
decorator above it that skips ``functools.wraps``) tells the limiter when it runs, inside a
request, so that its limits are still enforced, in a call of their own.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from flask import has_request_context

__all__ = ["carried_function", "carries", "make_carrier"]

#: The attribute naming the limiter whose limits a wrapper carries.
_CARRIER = "__distlimit_limiter__"
#: The attribute holding ``(wrapper, function)`` of a limit wrapper (the wrapper itself first:
#: a decorator using ``functools.wraps`` copies the attribute onto its own wrapper).
_CARRIED = "__distlimit_carried__"


def make_carrier(
    func: Callable[..., Any], limiter: object, reached: Callable[[object], None]
) -> Callable[..., Any]:
    """A wrapper of ``func`` carrying ``limiter``'s limits; it calls ``reached(wrapper)`` when it
    runs inside a request (after the app's before_request hooks)."""
    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def async_carrier(*args: Any, **kwargs: Any) -> Any:
            if has_request_context():
                reached(async_carrier)
            return await func(*args, **kwargs)

        setattr(async_carrier, _CARRIER, limiter)
        setattr(async_carrier, _CARRIED, (async_carrier, func))
        return async_carrier

    @functools.wraps(func)
    def carrier(*args: Any, **kwargs: Any) -> Any:
        if has_request_context():
            reached(carrier)
        return func(*args, **kwargs)

    setattr(carrier, _CARRIER, limiter)
    setattr(carrier, _CARRIED, (carrier, func))
    return carrier


def carries(func: object, limiter: object) -> bool:
    """Whether ``func`` (or the wrapper it was copied from by ``functools.wraps``) carries
    ``limiter``'s limits."""
    return getattr(func, _CARRIER, None) is limiter


def carried_function(view: object, limiter: object) -> Callable[..., Any] | None:
    """The function ``view`` wraps when ``view`` is itself a limit wrapper of ``limiter`` (not a
    decorator's wrapper around one), else None. The view gate calls it directly when the
    request's plan already decided the wrapper's limits: the wrapper would only check that."""
    carried = getattr(view, _CARRIED, None)
    if isinstance(carried, tuple) and carried[0] is view and carries(view, limiter):
        return carried[1]  # type: ignore[no-any-return]
    return None
