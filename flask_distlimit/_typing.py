"""Types shared by several modules, kept apart so that none of them imports another for a name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

__all__ = ["CostFunc", "ExemptWhen", "FailurePolicy", "HeaderMode", "KeyFunc", "LimitKind"]

#: What a storage outage means for a request: allow, refuse (503) or limit in-process.
FailurePolicy = Literal["open", "closed", "local"]
#: Which rate-limit headers responses carry (``DISTLIMIT_HEADERS``).
HeaderMode = Literal["legacy", "ietf", "both", "none"]
#: Where a declared limit comes from.
LimitKind = Literal["route", "shared", "blueprint", "default", "global", "tier"]
#: ``key_func=``: who is counted, called inside the request after the app's hooks.
KeyFunc = Callable[[], str]
#: ``cost=`` as a callable: the units a request costs, an int >= 0.
CostFunc = Callable[[], int]
#: ``exempt_when=``: the limit is skipped for a request when it answers true.
ExemptWhen = Callable[[], bool]
