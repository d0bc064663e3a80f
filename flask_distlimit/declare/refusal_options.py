"""What a refused limit answers with: its own ``on_breach`` hook and ``error_message``.

The Limiter's hook is called, then each refusing limit's (each hook once); the response of the
last hook that answered one is sent. The first refusing limit's message becomes the 429's
``detail``; a message callable that raises or answers no string is logged, and the standard
detail is used.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from flask_distlimit._typing import LimitBreachHook

if TYPE_CHECKING:
    from flask_distlimit.declare.route_limits import BoundLimit


log = logging.getLogger("flask_distlimit")


def breach_hooks(
    denied: Sequence[BoundLimit], app_hook: LimitBreachHook | None
) -> list[LimitBreachHook]:
    """The hooks to call, in order: ``app_hook``, then each denied limit's own, each once."""
    hooks = (app_hook, *(b.spec.on_breach for b in denied))
    return list({id(h): h for h in hooks if h is not None}.values())  # a hook may not hash


def error_message(denied: Sequence[BoundLimit]) -> str | None:
    """The ``error_message`` of the first denied limit that has one, if it answers a string."""
    for b in denied:
        message = b.spec.error_message
        if message is None:
            continue
        if isinstance(message, str):
            return message
        try:
            text = message()
        except Exception:
            log.exception("The error_message callable of the rate limit %s raised.", b.name)
            return None
        if isinstance(text, str):
            return text
        log.error("The error_message callable of the rate limit %s answered %r.", b.name, text)
        return None
    return None
