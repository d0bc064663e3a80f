"""Limiter-wide request filters: ``Limiter(request_filter=...)`` or ``@limiter.request_filter``.

A filter is called inside the request, after the app's ``before_request`` hooks; when any
answers true the request is not limited at all (no limit, no headers). A filter that raises is
logged and does not exempt the request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from flask_distlimit._typing import RequestFilter

log = logging.getLogger("flask_distlimit")


def filtered(filters: Sequence[RequestFilter]) -> bool:
    """True when a filter exempts the current request."""
    for func in filters:
        try:
            if func():
                return True
        except Exception:
            log.exception(
                "The request filter %r raised; the request is limited as usual.",
                getattr(func, "__qualname__", func),
            )
    return False
