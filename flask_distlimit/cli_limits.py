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


def _kind(b: BoundLimit) -> str:
    return {"g": "global", "t": "tier", "s": "shared", "r": "route"}.get(b.limit_id[:1], "route")


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
    if spec.deduct_when is not None:
        notes.append("deduct_when")
    if spec.settle is not None:
        notes.append("settle")
    if spec.cost is not None and spec.cost != 1:
        notes.append(f"cost {spec.cost if isinstance(spec.cost, int) else 'callable'}")
    if spec.exempt_when is not None:
        notes.append("exempt_when")
    return ", ".join(notes)


def limit_rows(
    state: LimiterState, endpoint: str | None, method: str | None
) -> list[dict[str, object]]:
    """Every limit's row, or one ``endpoint``'s and/or ``method``'s (global and tier: always)."""
    rows: list[dict[str, object]] = []
    default_policy = state.settings.failure_policy

    def row(endpoint: str, methods: str, rule: str, b: BoundLimit | None, **extra: object) -> None:
        rows.append(
            {
                "endpoint": endpoint,
                "methods": methods,
                "rule": rule,
                "limit": b.name if b is not None else extra.get("limit", "-"),
                "value": b.shown if b is not None else "",
                "kind": _kind(b) if b is not None else "",
                "algorithm": b.algorithm if b is not None else "",
                "key": _key_kind(b) if b is not None else "",
                "on_failure": extra.get("policy", default_policy) if b is not None else "",
                "notes": _notes(b) if b is not None else "",
            }
        )

    for b in state.global_limits:
        row("*", "*", "every request", b)
    for tier, bounds in state.tier_limits.items():
        for b in bounds:
            row("*", "*", f"every request of tier {tier}", b)
    for name, rule, m, plan in route_plans(state, endpoint):
        if method is not None and m != method:
            continue
        if plan.exempt:
            row(name, m, rule, None, limit="exempt")
        elif not plan.limits:
            row(name, m, rule, None)
        for b in plan.limits:
            row(name, m, rule, b, policy=plan.policy or default_policy)
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
