"""After the response is made (``after_request``): charges, headers, telemetry.

:meth:`AfterResponse.finish` settles ``deduct_when`` reservations (:mod:`.deduction`), adds the
headers of the limit closest to denial (:mod:`.headers`; ``Retry-After`` on a 429/503 the app
replaced without one) and counts the request in OpenTelemetry. A response object that passes
twice has our headers replaced, never doubled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from werkzeug.wrappers import Response as WerkzeugResponse

from flask_distlimit._typing import HeaderMode
from flask_distlimit.core.decision import Decision
from flask_distlimit.defences.lifecycle import Holding
from flask_distlimit.request.data import RequestData, report_of
from flask_distlimit.request.deduction import Deferred
from flask_distlimit.request.headers import rate_limit_headers
from flask_distlimit.telemetry.otel import OTelHook

__all__ = ["AfterResponse", "Charge"]

#: Set on a response the rate-limit headers were added to: whether ``Retry-After`` was too.
_HEADERS_ADDED: Final = "_distlimit_headers_added"
#: Every header name :meth:`AfterResponse.finish` adds but ``Retry-After``.
_OUR_HEADERS: Final = (
    "X-RateLimit-Limit",
    "X-RateLimit-Remaining",
    "X-RateLimit-Reset",
    "RateLimit-Policy",
    "RateLimit",
    "X-RateLimit-Degraded",
)

#: Settles the reservations of a response's request (those settled when its body ends go to
#: the holding function: the request's ledger); answers each settled with its decision.
Charge = Callable[
    [dict[str, Deferred], WerkzeugResponse, Callable[[Holding], None]],
    list[tuple[Deferred, Decision]],
]


def _drop_our_headers(headers: Any, *, retry_after: bool) -> None:
    """Remove the headers an earlier pass of the same response object added."""
    for name in (*_OUR_HEADERS, "Retry-After") if retry_after else _OUR_HEADERS:
        headers.remove(name)


class AfterResponse:
    """What one app's limiter does to each response (see the module docstring)."""

    def __init__(
        self,
        mode: HeaderMode,
        wall: Callable[[], float],
        charge: Charge,
        hold: Callable[[Holding], None],
    ) -> None:
        self._mode = mode
        self._wall = wall  #: the wall clock, in seconds (for the reset instants)
        self._charge = charge
        self._hold = hold  #: gives a holding to the current request's ledger

    def finish(self, response: WerkzeugResponse, data: RequestData, otel: OTelHook | None) -> None:
        """Charge, add the headers to ``response`` and count it (``otel``: when on)."""
        if data.deferred:  # deduct_when reservations: settled now, as the response says
            for later, charged in self._charge(data.deferred, response, self._hold):
                if later.check.shadow:  # never reported (clients would slow down for it)
                    continue
                report = report_of(later.bound, charged, denied=False)
                now = data.report
                if now is None or now.name == report.name or report.remaining < now.remaining:
                    data.report = report  # the count after the settlement, not the reservation's
        headers = response.headers
        marks = response.__dict__
        if _HEADERS_ADDED in marks:
            # A response object that passed here before (a view returns one object every time,
            # or a cached copy): ours from then go, or they would be sent twice, stale first.
            _drop_our_headers(headers, retry_after=marks[_HEADERS_ADDED])
        if (data.report is not None or data.evaluated) and self._mode != "none":
            # The names are ours alone: appended (werkzeug checks each value), no scan for an
            # existing one, one call for all of them.
            headers[len(headers) :] = rate_limit_headers(
                self._mode, data.report, self._wall(), denied=data.denied,
                applied=data.evaluated,
            )  # fmt: skip
        if data.degraded:
            headers["X-RateLimit-Degraded"] = "true"
        marks[_HEADERS_ADDED] = False  # True: Retry-After is ours too
        if (
            data.retry_after is not None
            and response.status_code in (429, 503)
            and "Retry-After" not in headers
        ):
            headers["Retry-After"] = str(data.retry_after)
            marks[_HEADERS_ADDED] = True
        if otel is not None:  # OpenTelemetry's count of requests (telemetry.otel)
            otel.request(data, response)
