"""One request's limiter data, :class:`RequestData`, kept in the request's WSGI environ (under
:attr:`~flask_distlimit.request.enforcement.Enforcer.environ_key`), which lives exactly as long
as the request; not on ``g``, which an app context shared by several requests would hand on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flask_distlimit.defences.concurrency import SlotRelease
from flask_distlimit.request import deduction
from flask_distlimit.request.headers import Evaluated, Report

if TYPE_CHECKING:
    from werkzeug.wrappers import Response


@dataclass(slots=True, eq=False)
class RequestData:
    """This request's limiter data, kept in the request environ under ``environ_key``."""

    #: limit wrappers whose limits were decided with the route's
    covered: frozenset[object] = frozenset()
    exempt: bool = False
    meta_limits: bool = True  #: the meta limits apply (the route's ExemptionScope.META lifts them)
    #: the limit closest to denial so far, for the headers (None: no rate to report)
    report: Report | None = None
    degraded: bool = False
    denied: bool = False
    retry_after: int | None = None
    #: ``"ip:<address>"`` of the client, once some limit needed it
    client_ip: str | None = None
    #: the limits evaluated so far (``limiter.current_limits``)
    evaluated: list[Evaluated] = field(default_factory=list)
    #: ``deduct_when`` limits to charge after the response, by key
    deferred: dict[str, deduction.Deferred] = field(default_factory=dict)
    #: concurrency slots, held by the request's ledger (flask_distlimit.defences.lifecycle)
    slots: SlotRelease | None = None
    #: the last response our ``after_request`` saw, for the request's count (telemetry.otel)
    response: Response | None = None

    def unwritten(self) -> None:
        """A call of the request was refused or not made: what it reserved was never written;
        an earlier call's reservations are settled after the response all the same."""
        self.deferred = {k: d for k, d in self.deferred.items() if d.written}
