"""Types shared by several modules, kept apart so that none of them imports another for a name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

#: What a storage outage means for a request: allow, refuse (503) or limit in-process.
FailurePolicy = Literal["open", "closed", "local"]
#: Which rate-limit headers responses carry (``DISTLIMIT_HEADERS``).
HeaderMode = Literal["legacy", "ietf", "both", "none"]
#: Where a declared limit comes from.
LimitKind = Literal["route", "shared", "blueprint", "default", "global", "tier", "meta"]
#: ``key_func=``: who is counted, called inside the request after the app's hooks; ``None`` (or
#: ``""``): the request's own identity.
KeyFunc = Callable[[], str | int | None]
#: ``cost=`` as a callable: the units a request costs, an int >= 0.
CostFunc = Callable[[], int]
#: ``exempt_when=``: the limit is skipped for a request when it answers true.
ExemptWhen = Callable[[], bool]
#: ``deduct_when=``: called with the view's response; the limit is charged only when it answers
#: true.
DeductWhen = Callable[[Any], bool]
#: ``settle=``: called with the view's response; the units the request really cost (an int >=
#: 0), charged or given back against the ``cost`` reserved before the view.
Settle = Callable[[Any], int]
#: ``unit=``: what a limit counts: requests (each its ``cost``), or the bytes of the response
#: bodies the server sent (the IETF draft's quota units).
Unit = Literal["requests", "content-bytes"]
#: ``error_message=``: the 429's ``detail``, or a callable answering it.
ErrorMessage = str | Callable[[], str]
#: A limit's own ``on_breach=`` (called with a :class:`~flask_distlimit.Breach`; may answer a
#: response).
LimitBreachHook = Callable[[Any], Any]
#: ``Limiter(request_filter=...)``: a request for which it answers true is not limited at all.
RequestFilter = Callable[[], bool]
#: ``scope=`` as a callable: called with the request's endpoint, answers the scope's name.
ScopeFunc = Callable[[str], str]
