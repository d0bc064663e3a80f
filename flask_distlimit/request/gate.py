"""The view gate: where Flask calls the view, after every ``before_request`` hook.

On the app's first request :func:`finalize` wraps each view in a gate
(:meth:`Enforcer.gate <flask_distlimit.request.enforcement.Enforcer.gate>`), binds every route's
plan (too many limits fail loudly there) and warns of declarations that match no endpoint. The
gate enforces, then calls the view, so every ``key_func``, ``cost`` and identity loader sees
what the app's hooks set (docs/design-notes.md, "The view gate").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Final

from flask import Flask

from flask_distlimit.core.algorithms import check_limit_count
from flask_distlimit.declare.targets import describe
from flask_distlimit.request.plans import Plans, is_static

log = logging.getLogger("flask_distlimit")

#: Declarations named in the first request's WARNING, at most.
_UNMATCHED_SHOWN: Final = 20

#: A view function in its gate, given its endpoint.
Gate = Callable[[str, Any], Callable[..., Any]]


class _Served:
    """The objects one app serves: declaring a limit on them from now on raises."""

    __slots__ = ("__weakref__", "app_name", "objects")

    def __init__(self, app_name: str, objects: set[object]) -> None:
        self.app_name = app_name
        self.objects = objects


def finalize(app: Flask, plans: Plans, every_request: int, gate: Gate) -> object:
    """Bind every route's plan, wrap every view function of ``app`` in its ``gate``, close the
    registry on what it serves and warn about declarations that match none of its endpoints.
    ``every_request``: how many limits every request carries. Answers what the app serves: the
    registry watches it while the caller keeps it."""
    registry = plans.registry
    views: dict[str, object] = dict(app.view_functions)
    methods: dict[str, set[str]] = {}
    for rule in app.url_map.iter_rules():
        methods.setdefault(rule.endpoint, set()).update(rule.methods or ())
    served: set[object] = {app, *app.blueprints.values()}  # the app: its default limits
    routed = [(e, v) for e, v in views.items() if not is_static(e)]
    taken: dict[Any, set[str]] = {}  # each view's methods, over its endpoints
    for endpoint, view in routed:
        taken.setdefault(view, set()).update(methods.get(endpoint, ()))
        for method in sorted(methods.get(endpoint, {""})):
            every, one = registry.attached(view, method)
            served.update(every, one)
            # Bound now: a route that would carry too many limits fails here, loudly.
            plan = plans.plan(endpoint, method)
            check_limit_count(
                every_request + sum(b.most_rates for b in plan.limits),
                f"The global, tier and route limits of {endpoint!r} ({method})",
            )
            for specs in plan.inner.values():  # decided in a call of their own
                check_limit_count(
                    sum(s.rate_count for s in specs),
                    f"The limits under a decorator of {endpoint!r} ({method})",
                )
    for endpoint, view in routed:
        app.view_functions[endpoint] = gate(endpoint, view)
    closed = _Served(app.name, served)
    registry.served.add(closed)
    unused = [  # methods=["PSOT"]: a typo that left the route's POST unlimited
        f"limit {spec.shown()} on {spec.declared_on} (methods {sorted(spec.methods)})"
        for view, accepted in taken.items()
        for spec in registry.views.get(view, ())
        if spec.methods and not spec.methods & accepted
    ]
    plans.views = views
    told, exempt = registry.told, (*registry.exempt_views, *registry.exempt_blueprints)
    unmatched = [
        f"limit {spec.shown()} on {spec.declared_on}"
        for target, specs in (*registry.views.items(), *registry.blueprints.items())
        if target not in served and target not in told
        for spec in specs[:1]
    ] + [
        f"exemption of {describe(target)}"
        for target in (*exempt, *registry.scopes)
        if target not in served and target not in told
    ]
    told.update(registry.views, registry.blueprints, exempt, registry.scopes)
    unmatched += unused
    if unmatched:
        shown = sorted(set(unmatched))
        more = len(shown) - _UNMATCHED_SHOWN
        log.warning(
            "%d rate-limit declaration(s) match no endpoint of the app %r: %s%s. A limit on a "
            "view the app does not serve never applies, nor one whose methods= its route does "
            "not accept; one behind a decorator without "
            "functools.wraps is enforced only when that view runs, in a storage call of its own; "
            "an exemption there is not applied. Register the view, or use functools.wraps in "
            "your decorators.",
            len(shown), app.name, "; ".join(shown[:_UNMATCHED_SHOWN]),
            f" and {more} more" if more > 0 else "",
        )  # fmt: skip
    return closed
