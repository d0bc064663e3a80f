"""``RateLimit-Policy`` items (the IETF rate-limit headers draft): written once, when
:mod:`~flask_distlimit.declare.route_limits` binds a limit; :mod:`~flask_distlimit.request.headers`
only joins the items of a response."""

from __future__ import annotations

import re
from typing import Final

_NOT_SF: Final = re.compile(r"[^\x20-\x7e]")


def sf_string(text: str) -> str:
    """``text`` as a structured-field String (RFC 9651): quoted, ``\\`` and ``"`` escaped,
    anything outside printable ASCII replaced by ``?``."""
    text = _NOT_SF.sub("?", text).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def policy_item(name: str, quota: int, window: int, unit: str = "requests") -> str:
    """One ``RateLimit-Policy`` item, e.g. ``"orders:100/minute";q=100;w=60``; a limit of
    another unit than requests names it: ``"files:500000000/day";q=500000000;w=86400;
    qu="content-bytes"``."""
    item = f"{sf_string(name)};q={quota};w={window}"
    return item if unit == "requests" else f'{item};qu="{unit}"'


def concurrency_policy_item(name: str, quota: int) -> str:
    """The ``RateLimit-Policy`` item of a limit of requests in flight:
    ``"orders:5 in flight";q=5;qu="concurrent-requests"`` (no window: a slot is held for as
    long as its request runs)."""
    return f'{sf_string(name)};q={quota};qu="concurrent-requests"'
