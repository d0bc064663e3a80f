"""Refusals as RFC 9457 problem details (``application/problem+json``).

:class:`RateLimitExceeded` (429) is a werkzeug ``TooManyRequests``, so ordinary Flask error
handling applies and ``@app.errorhandler(429)`` can replace it; :class:`RateLimitUnavailable`
(503) answers an outage under policy ``closed``. Both carry ``Cache-Control: no-store`` and
``Retry-After`` (whole seconds, rounded up), except a 429 that can never pass (its cost exceeds
the limit's window). Problem types: draft-ietf-httpapi-ratelimit-headers, section 5.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from werkzeug.exceptions import HTTPException, ServiceUnavailable, TooManyRequests

if TYPE_CHECKING:
    from _typeshed.wsgi import WSGIEnvironment

QUOTA_EXCEEDED: Final = "https://iana.org/assignments/http-problem-types#quota-exceeded"
TEMPORARY_REDUCED_CAPACITY: Final = (
    "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"
)
#: Not an IANA-registered type (none says "too many in flight"): this project's own, whose page
#: (docs/defences.md) explains it.
CONCURRENCY_LIMIT_EXCEEDED: Final = (
    "https://github.com/flask-distlimit/flask-distlimit/blob/main/docs/defences.md"
    "#concurrency-limit-exceeded"
)
#: The problems' media type (RFC 9457).
PROBLEM_MEDIA_TYPE: Final = "application/problem+json"
#: Retry-After for a request that can never pass (its cost exceeds the limit): one day.
_NEVER_SECONDS: Final = 86400
#: Why a 503 of a limit that could not be counted refuses all the same.
_REFUSES: Final = " and this route refuses requests it cannot count"


def retry_after_seconds(seconds: float) -> int:
    """``seconds`` as a ``Retry-After`` value: an integer rounded up, at least 1.

    Rounding up keeps the advertised time no earlier than the real one; ``inf`` (a cost larger
    than the limit) becomes one day.
    """
    if not math.isfinite(seconds):
        return _NEVER_SECONDS
    return max(1, math.ceil(seconds - 1e-9))


class _Problem(HTTPException):
    """Body and headers of the problem exceptions (mixed in before the werkzeug class, whose
    ``code`` is the status and whose ``__init__`` each subclass calls last)."""

    problem_type: str
    title: str
    retry_after_s: int | None  #: None: the request can never pass, so no Retry-After
    violated_policies: tuple[str, ...] = ()
    instance: str | None
    detail_text: str

    def problem(self) -> dict[str, Any]:
        """The problem object, as sent in the body."""
        body: dict[str, Any] = {
            "type": self.problem_type,
            "title": self.title,
            "status": self.code,
            "detail": self.detail_text,
        }
        if self.instance is not None:
            body["instance"] = self.instance
        body["violated-policies"] = list(self.violated_policies)
        if self.retry_after_s is not None:
            body["retry_after"] = self.retry_after_s
        return body

    def get_body(
        self,
        environ: WSGIEnvironment | None = None,
        scope: dict[str, Any] | None = None,
    ) -> str:
        return json.dumps(self.problem(), separators=(",", ":"))

    def get_headers(
        self,
        environ: WSGIEnvironment | None = None,
        scope: dict[str, Any] | None = None,
    ) -> list[tuple[str, str]]:
        headers = [("Content-Type", PROBLEM_MEDIA_TYPE), ("Cache-Control", "no-store")]
        if self.retry_after_s is not None:
            headers.append(("Retry-After", str(self.retry_after_s)))
        return headers


class RateLimitExceeded(_Problem, TooManyRequests):
    """429: the request exceeds one or more rate limits; nothing was consumed.

    ``violated_policies`` names the limits that denied (as in the ``RateLimit`` header);
    ``retry_after`` is the seconds until the request could pass, rounded up; ``detail`` is the
    body's ``detail``; ``description`` (``e.description`` in an ``errorhandler(429)``) is what
    Flask-Limiter's says: the limit's ``error_message``, else its rate (``"1 per 1 day"``),
    else the detail.
    """

    problem_type = QUOTA_EXCEEDED
    title = "Request cannot be satisfied as the assigned quota has been exceeded"
    #: the :class:`~flask_distlimit.Breach` the ``on_breach`` hooks are told, when the limiter
    #: raised it: ``e.limit.limit`` is the rate that refused, as Flask-Limiter's ``e.limit``
    limit: Any = None

    def __init__(
        self,
        *,
        retry_after: float | None,
        violated_policies: Sequence[str],
        instance: str | None = None,
        detail: str | None = None,
        description: str | None = None,
    ) -> None:
        self.retry_after_s = (
            retry_after_seconds(retry_after)
            if retry_after is not None and math.isfinite(retry_after)
            else None
        )
        self.violated_policies = tuple(violated_policies)
        self.instance = instance
        self.detail_text = detail or self._default_detail(description)
        super().__init__(
            description=description or self.detail_text, retry_after=self.retry_after_s
        )

    def _default_detail(self, in_words: str | None) -> str:
        """The detail when the limit gives no ``error_message``: its name, then its rate in
        words as Flask-Limiter's 429 says it (``null:1/day (1 per 1 day)``)."""
        words = f" ({in_words})" if in_words else ""
        return f"Rate limit {', '.join(self.violated_policies) or 'exceeded'}{words}: " + (
            f"retry in {self.retry_after_s} s."
            if self.retry_after_s is not None
            else "this request can never be admitted."
        )


class ConcurrencyLimitExceeded(RateLimitExceeded):
    """429: the client has as many requests in flight as its concurrency limit allows
    (:mod:`flask_distlimit.defences.concurrency`); not a rate: one ending frees a slot."""

    problem_type = CONCURRENCY_LIMIT_EXCEEDED
    title = "Too many requests in flight at the same time"

    def _default_detail(self, in_words: str | None) -> str:
        return (
            f"Concurrency limit {', '.join(self.violated_policies)}: too many of your requests "
            "are in progress at once. Retry when one of them has finished."
        )


class _Unavailable(_Problem, ServiceUnavailable):
    """503: the two refusals for want of capacity."""

    problem_type = TEMPORARY_REDUCED_CAPACITY
    title = "Request cannot be satisfied due to temporary server capacity constraints"


class Overloaded(_Unavailable):
    """503: the service sheds this request's priority to keep capacity for more important
    traffic (:mod:`flask_distlimit.defences.shedding`: this process is busy;
    :mod:`flask_distlimit.defences.fleet`: the fleet is)."""

    def __init__(
        self,
        *,
        priority: str,
        reason: str,
        retry_after: float = 1.0,
        instance: str | None = None,
    ) -> None:
        self.retry_after_s = retry_after_seconds(retry_after)
        self.instance = instance
        self.priority = priority
        self.reason = reason  #: "worker" or "fleet"
        where = "this server is" if reason == "worker" else "the service is"
        self.detail_text = (
            f"Overloaded: {where} near capacity and sheds {priority} requests first, to keep "
            f"room for more important ones; retry in {self.retry_after_s} s."
        )
        super().__init__(description=self.detail_text, retry_after=self.retry_after_s)

    def problem(self) -> dict[str, Any]:
        body = super().problem()
        del body["violated-policies"]
        body["priority"] = self.priority
        return body


class RateLimitUnavailable(_Unavailable):
    """503: the rate-limit storage is unreachable and the failure policy is ``closed``; or
    (``busy``) this process's limiter calls queued past their budget, whatever the policy
    (:class:`~flask_distlimit.errors.StorageBusy`); or (``unresolved``) a limit of the route
    could not be evaluated and its failure policy is not ``open``."""

    def __init__(
        self,
        *,
        retry_after: float,
        violated_policies: Sequence[str] = (),
        instance: str | None = None,
        busy: bool = False,
        unresolved: bool = False,
    ) -> None:
        self.retry_after_s = retry_after_seconds(retry_after)
        self.violated_policies = tuple(violated_policies)
        self.instance = instance
        if busy:
            cause = "This server is overloaded: its rate-limit decisions queue past their budget"
        elif unresolved:
            cause = f"A rate limit of this route could not be evaluated{_REFUSES}"
        else:
            cause = f"The rate-limit store is unavailable{_REFUSES}"
        self.detail_text = f"{cause}; retry in {self.retry_after_s} s."
        super().__init__(description=self.detail_text, retry_after=self.retry_after_s)
