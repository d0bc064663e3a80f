"""The rows of ``flask distlimit limits``: every endpoint's limits, and the endpoint a
``--endpoint`` or ``--path`` filter reaches (:mod:`flask_distlimit.cli` prints them)."""

from __future__ import annotations

from urllib.parse import urlsplit

import click
from flask import current_app
from werkzeug.exceptions import HTTPException

from flask_distlimit.declare.route_limits import BoundLimit
from flask_distlimit.ops.admin import route_plans
from flask_distlimit.state import LimiterState

#: A limit's kind by the first letter of its id; any other (blueprint, default) shows as route.
_KINDS: dict[str, str] = {"g": "global", "t": "tier", "s": "shared"}


def _key_kind(b: BoundLimit) -> str:
    if b.keyed_on == "func":
        func = b.spec.key_func
        return f"key_func {getattr(func, '__qualname__', func)}"
    return "client ip" if b.keyed_on == "ip" else "identity"


def _notes(b: BoundLimit) -> str:
    notes: list[str] = []
    spec = b.spec
    if b.dynamic is not None:
        notes.append("per tier" if b.dynamic.value.by_tier else "per identity (callable)")
    if spec.unit != "requests":
        notes.append(spec.unit)
    notes += [name for name in ("deduct_when", "settle") if getattr(spec, name) is not None]
    if spec.cost is not None and spec.cost != 1:
        notes.append(f"cost {spec.cost if isinstance(spec.cost, int) else 'callable'}")
    if spec.exempt_when is not None:
        notes.append("exempt_when")
    return ", ".join(notes)


#: The columns of a route with no limit (or exempt) beside its ``limit`` cell.
_NO_LIMIT: dict[str, object] = dict.fromkeys(
    ("value", "kind", "algorithm", "key", "on_failure", "notes"), ""
)


def _columns(b: BoundLimit, policy: str) -> dict[str, object]:
    return {
        "limit": b.name,
        "value": str(b.rate) if b.dynamic is None else b.dynamic.value.described,
        "kind": _KINDS.get(b.limit_id[:1], "route"),
        "algorithm": b.algorithm,
        "key": _key_kind(b),
        "on_failure": policy,
        "notes": _notes(b),
    }


def limit_rows(
    state: LimiterState, endpoint: str | None, method: str | None
) -> list[dict[str, object]]:
    """Every limit's row, or one ``endpoint``'s and/or ``method``'s (global and tier: always)."""
    policy = state.settings.failure_policy
    everywhere = [("every request", state.global_limits)]
    everywhere += [(f"every request of tier {t}", b) for t, b in state.tier_limits.items()]
    rows: list[dict[str, object]] = [
        {"endpoint": "*", "methods": "*", "rule": rule, **_columns(b, policy)}
        for rule, bounds in everywhere
        for b in bounds
    ]
    counted = "GET" if method == "HEAD" else method  # Flask answers HEAD with the GET view
    for name, rule, m, plan in route_plans(state, endpoint):
        if counted is not None and m != counted:
            continue
        route = {"endpoint": name, "methods": m, "rule": rule}
        if plan.exempt or not plan.limits:
            rows.append({**route, "limit": "exempt" if plan.exempt else "-", **_NO_LIMIT})
        rows += ({**route, **_columns(b, plan.policy or policy)} for b in plan.limits)
    return rows


def endpoint_of(endpoint: str | None, path: str | None, method: str | None) -> str | None:
    """The endpoint ``--endpoint`` names or ``--path`` (with ``--method``, else GET) reaches."""
    if endpoint is not None and path is not None:
        raise click.UsageError("Use either --endpoint or --path, not both.")
    if endpoint is not None:
        if endpoint not in current_app.view_functions:
            raise click.BadParameter(
                f"The app has no endpoint {endpoint!r} ('flask routes' lists them).",
                param_hint="--endpoint",
            )
        rules = current_app.url_map.iter_rules(endpoint)
        if method is not None and not any(method in (r.methods or ()) for r in rules):
            raise click.BadParameter(
                f"The endpoint {endpoint!r} takes no {method} ('flask routes' lists its methods).",
                param_hint="--method",
            )
        return endpoint
    if path is None:
        return None
    adapter = current_app.url_map.bind("localhost")
    try:
        found, _ = adapter.match(urlsplit(path).path, method=method or "GET")
    except HTTPException as exc:  # 404, 405, or 308 (the rule ends in "/": give it so)
        raise click.BadParameter(
            f"{method or 'GET'} {path} reaches no view of the app ({exc.code} "
            f"{exc.name}); 'flask routes' lists the routes.",
            param_hint="--path",
        ) from None
    return str(found)
