"""Rate-limit response headers, for the one limit closest to denial.

- ``legacy``: ``X-RateLimit-Limit``, ``X-RateLimit-Remaining``, ``X-RateLimit-Reset`` (the Unix
  time, in whole seconds rounded up, when the quota is whole again; on a 429, when the request
  could pass).
- ``ietf`` (draft-ietf-httpapi-ratelimit-headers-10/-11, structured fields)::

      RateLimit-Policy: "orders:100/minute";q=100;w=60
      RateLimit: "orders:100/minute";r=0;t=17

  ``q`` the quota, ``w`` its window in seconds, ``r`` the units left, ``t`` the seconds until the
  quota is whole again (on a 429: until the request could pass, equal to ``Retry-After``, so
  ``Retry-After`` never points before the end of the effective window, as the draft asks).

Which limit: on a denial, the denied limit that keeps the client waiting longest; otherwise the
one with the fewest units left (ties: the one whose quota returns last).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Final

from .config import HeaderMode
from .problem import retry_after_seconds

__all__ = ["Report", "closest_to_denial", "policy_item", "rate_limit_headers", "sf_string"]

_NOT_SF: Final = re.compile(r"[^\x20-\x7e]")


def sf_string(text: str) -> str:
    """``text`` as a structured-field String (RFC 9651): quoted, ``\\`` and ``"`` escaped,
    anything outside printable ASCII replaced by ``?``."""
    text = _NOT_SF.sub("?", text).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def policy_item(name: str, quota: int, window: int) -> str:
    """One ``RateLimit-Policy`` item, e.g. ``"orders:100/minute";q=100;w=60``."""
    return f"{sf_string(name)};q={quota};w={window}"


class Report:
    """The numbers of one limit, as the headers tell them."""

    __slots__ = (
        "limit",
        "name",
        "period",
        "policy",
        "quoted",
        "remaining",
        "reset_after",
        "retry_after",
    )

    def __init__(
        self,
        *,
        name: str,
        limit: int,
        period: int,
        remaining: int,
        reset_after: float,
        retry_after: float = 0.0,
        policy: str | None = None,
        quoted: str | None = None,
    ) -> None:
        self.name = name
        self.limit = limit
        self.period = period
        self.remaining = max(0, remaining)
        self.reset_after = reset_after
        self.retry_after = retry_after
        #: the ``RateLimit-Policy`` item (precomputed at registration when possible)
        self.policy = policy or policy_item(name, limit, period)
        #: the name as a structured-field String
        self.quoted = quoted or sf_string(name)


def closest_to_denial(reports: Sequence[Report]) -> Report:
    """The report to send: the longest wait among denials, else the fewest units left."""
    denied = [r for r in reports if r.retry_after > 0]
    if denied:
        return max(denied, key=lambda r: r.retry_after)
    return min(reports, key=lambda r: (r.remaining, -r.reset_after))


def rate_limit_headers(
    mode: HeaderMode, report: Report, now_s: float, *, denied: bool
) -> list[tuple[str, str]]:
    """The headers of ``mode`` for ``report``; ``now_s`` is the Unix time in seconds."""
    if mode == "none":
        return []
    if denied:
        wait = retry_after_seconds(report.retry_after)
        remaining = 0
    else:
        reset_after = report.reset_after
        wait = math.ceil(reset_after - 1e-9) if math.isfinite(reset_after) else 0
        if wait < 0:
            wait = 0
        remaining = report.remaining
    if mode == "both":  # the default: one list, no concatenation
        return [
            ("X-RateLimit-Limit", str(report.limit)),
            ("X-RateLimit-Remaining", str(remaining)),
            ("X-RateLimit-Reset", str(math.ceil(now_s) + wait)),
            ("RateLimit-Policy", report.policy),
            ("RateLimit", f"{report.quoted};r={remaining};t={wait}"),
        ]
    headers: list[tuple[str, str]] = []
    if mode in ("legacy", "both"):
        headers += [
            ("X-RateLimit-Limit", str(report.limit)),
            ("X-RateLimit-Remaining", str(remaining)),
            ("X-RateLimit-Reset", str(math.ceil(now_s) + wait)),
        ]
    if mode in ("ietf", "both"):
        headers += [
            ("RateLimit-Policy", report.policy),
            ("RateLimit", f"{report.quoted};r={remaining};t={wait}"),
        ]
    return headers
