"""One request's limiter data, :class:`RequestData`, kept in the request's WSGI environ (under
:attr:`~flask_distlimit.request.enforcement.Enforcer.environ_key`), which lives exactly as long
as the request; not on ``g``, which an app context shared by several requests would hand on.
"""

from __future__ import annotations

from flask_distlimit.core.decision import Decision
from flask_distlimit.declare.route_limits import BoundLimit
from flask_distlimit.defences.concurrency import SlotRelease
from flask_distlimit.request import deduction
from flask_distlimit.request.headers import Evaluated, Report

__all__ = ["RequestData", "report_of"]


class RequestData:
    """This request's limiter data, kept in the request environ under ``environ_key``."""

    __slots__ = (
        "client_ip",
        "covered",
        "deferred",
        "degraded",
        "denied",
        "evaluated",
        "exempt",
        "report",
        "retry_after",
        "slots",
    )

    def __init__(self, covered: frozenset[object], *, exempt: bool = False) -> None:
        self.covered = covered  #: limit wrappers whose limits were decided with the route's
        self.exempt = exempt
        #: the limit closest to denial so far, for the headers (None: no rate to report)
        self.report: Report | None = None
        self.degraded = False
        self.denied = False
        self.retry_after: int | None = None
        #: ``"ip:<address>"`` of the client, once some limit needed it
        self.client_ip: str | None = None
        #: the limits evaluated so far (``limiter.current_limits``)
        self.evaluated: list[Evaluated] = []
        #: ``deduct_when`` limits to charge after the response, by key
        self.deferred: dict[str, deduction.Deferred] = {}
        #: concurrency slots, held by the request's ledger (flask_distlimit.defences.lifecycle)
        self.slots: SlotRelease | None = None


def report_of(b: BoundLimit, d: Decision, *, denied: bool) -> Report:
    """The headers' numbers of one decision."""
    reduced = d.limit != b.rate.amount  # the local fallback divides limits
    return Report(
        name=b.name,
        limit=d.limit,
        period=b.rate.period,
        remaining=d.remaining,
        reset_after=d.reset_after,
        retry_after=d.retry_after if denied else 0.0,
        policy=None if reduced else b.policy,
        quoted=b.quoted,
        algorithm=b.algorithm,
    )
