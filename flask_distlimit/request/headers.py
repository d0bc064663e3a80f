"""Rate-limit response headers: every quota policy that applied, and the numbers of the one
closest to denial.

``ietf``: ``RateLimit-Policy`` has one item per quota policy (never a shadow limit or the
fleet's capacity), the reported one first, and ``RateLimit`` ONE item, the rate policy closest
to denial; ``legacy``: ``X-RateLimit-*`` for that same policy. What each number means:
docs/algorithms.md, "What the headers say".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Final, NamedTuple

from flask_distlimit._typing import HeaderMode
from flask_distlimit.core.algorithms import CONCURRENCY
from flask_distlimit.core.decision import Check, Decision
from flask_distlimit.core.problem import retry_after_seconds
from flask_distlimit.declare.policy_items import concurrency_policy_item, policy_item, sf_string
from flask_distlimit.declare.route_limits import BoundLimit
from flask_distlimit.engine.registry import REGISTRY

#: The ``limit_id`` of the fleet's capacity slots (:mod:`flask_distlimit.defences.fleet`): the
#: server's load, not a quota of the client, so never advertised.
_FLEET_ID: Final = "fleet"


class Report(NamedTuple):
    """The numbers of one limit, as the headers tell them (a named tuple: every request that
    reports a rate makes one)."""

    name: str
    limit: int
    period: int
    remaining: int  #: never below 0 (:func:`report_of`)
    reset_after: float
    retry_after: float = 0.0
    #: the ``RateLimit-Policy`` item (None: made from the numbers above)
    policy: str | None = None
    #: the name as a structured-field String (None: quoted when sent)
    quoted: str | None = None
    #: the algorithm whose numbers these are (None: unknown, read as a window that ends
    #: when the quota is whole)
    algorithm: str | None = None


def report_of(b: BoundLimit, d: Decision, *, denied: bool) -> Report:
    """The headers' numbers of one decision."""
    reduced = d.limit != b.rate.amount  # the local fallback divides limits
    return Report(
        name=b.name,
        limit=d.limit,
        period=b.rate.period,
        remaining=max(0, d.remaining),
        reset_after=d.reset_after,
        retry_after=d.retry_after if denied else 0.0,
        policy=None if reduced else b.policy,
        quoted=b.quoted,
        algorithm=b.algorithm,
    )


class Evaluated(NamedTuple):
    """The limits one storage call of the request evaluated (kept with the request as they
    are: read only when asked). A named tuple: every request builds one, and a frozen
    dataclass costs a microsecond more to build."""

    checks: Sequence[Check]  #: each with its bound limit
    decisions: Sequence[Decision]
    wall: float  #: the wall clock (seconds) when they were decided


#: The periods an admission stays in each algorithm's windows (the engine registry's ``span``).
_SPANS: Final[dict[str | None, int]] = {name: e.span for name, e in REGISTRY.items()}


def rate_limit_headers(
    mode: HeaderMode,
    report: Report | None,
    now_s: float,
    *,
    denied: bool,
    applied: Iterable[Evaluated] = (),
) -> list[tuple[str, str]]:
    """The headers of ``mode`` for ``report`` (``None``: no rate policy to report, e.g. a
    refusal by a concurrency limit: ``RateLimit-Policy`` alone, when some policy applied);
    ``applied``: every storage call of the request, for ``RateLimit-Policy``; ``now_s`` is the
    Unix time in seconds."""
    if mode == "none" or (report is None and mode == "legacy"):
        return []
    headers: list[tuple[str, str]] = []
    if report is not None:
        # Seconds until the quota next resets, at most one window (0: nothing counted).
        reset = report.reset_after
        period = report.period
        if not 0 < reset < math.inf:
            reset = 0.0
        elif reset > period:
            # A counter weighs the previous window too (its span is 2): whole again at the end
            # of the NEXT window; the current one ends a window earlier.
            reset -= (_SPANS.get(report.algorithm, 1) - 1) * period
            reset = min(reset, float(period))
        if denied:
            wait = retry_after_seconds(report.retry_after)
            retry = report.retry_after
            instant = now_s + (max(retry, reset) if math.isfinite(retry) else reset)
            remaining = 0
        else:
            wait = math.ceil(reset - 1e-9)
            instant = now_s + reset
            remaining = report.remaining
        if mode != "ietf":
            headers += [
                ("X-RateLimit-Limit", str(report.limit)),
                ("X-RateLimit-Remaining", str(remaining)),
                ("X-RateLimit-Reset", str(math.ceil(instant - 1e-9))),
            ]
        if mode == "legacy":
            return headers
    # RateLimit-Policy: the report's item first, then one item for each other quota policy of
    # ``applied`` (each name once; no shadow limit, no fleet slot). A limit the local fallback
    # divided is advertised with the quota it was decided against.
    items: list[str] = []
    seen: set[str] = set()
    if report is not None:
        items.append(report.policy or policy_item(report.name, report.limit, report.period))
        seen.add(report.name)
    for one in applied:
        for c, d in zip(one.checks, one.decisions, strict=True):
            b: BoundLimit = c.bound
            if b.name in seen or c.shadow or b.limit_id == _FLEET_ID:
                continue
            seen.add(b.name)
            if c.algorithm == CONCURRENCY:
                items.append(concurrency_policy_item(b.name, d.limit))
            elif d.limit != c.limit:
                items.append(policy_item(b.name, d.limit, c.period))
            else:
                items.append(b.policy)
    policies = ", ".join(items)
    if report is None:
        return [("RateLimit-Policy", policies)] if policies else []
    quoted = report.quoted or sf_string(report.name)
    headers += [
        ("RateLimit-Policy", policies),
        ("RateLimit", f"{quoted};r={remaining};t={wait}"),
    ]
    return headers
