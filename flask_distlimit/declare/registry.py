"""The registry of one :class:`~flask_distlimit.Limiter`: every limit and exemption declared
through it, by the identity of the object declared on (:mod:`flask_distlimit.declare.targets`).

Declarations close for an object once an app serves it: :meth:`LimitRegistry.check_open` raises
:class:`~flask_distlimit.errors.ConfigurationError` for a later one, as Flask's setup methods do.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass, field
from typing import Any

from flask_distlimit.declare.specs import LimitSpec
from flask_distlimit.declare.targets import describe, hashable, view_objects
from flask_distlimit.errors import ConfigurationError


class ExemptionScope(enum.Flag):
    """What ``limiter.exempt(target, flags=...)`` lifts from a view or blueprint (Flask-Limiter's
    flags, by name); limits declared on the target itself still apply. Without ``flags`` an
    exemption is whole: no limit at all, nested blueprints included."""

    NONE = 0
    #: ``DISTLIMIT_GLOBAL_LIMITS`` and the identity's ``DISTLIMIT_TIERS`` limits
    APPLICATION = enum.auto()
    #: ``DISTLIMIT_META_LIMITS``
    META = enum.auto()
    #: ``DISTLIMIT_DEFAULT_LIMITS`` and the limits declared on the app itself
    DEFAULT = enum.auto()
    #: a blueprint's flags reach the blueprints nested in it too
    DESCENDENTS = enum.auto()
    #: no limits of the blueprints the target is nested in (a view: of its blueprints)
    ANCESTORS = enum.auto()


@dataclass
class LimitRegistry:
    """Every limit and exemption declared through one ``Limiter``, by object identity."""

    views: dict[object, list[LimitSpec]] = field(default_factory=dict)
    exempt_views: set[object] = field(default_factory=set)
    #: a decorated function -> the limit wrappers made of it (``@limiter.limit`` above
    #: ``@app.route`` registers the function itself: its limits still apply)
    wrapped_by: dict[object, list[object]] = field(default_factory=dict)
    #: a Blueprint's limits, and (on the app) its default limits
    blueprints: dict[object, list[LimitSpec]] = field(default_factory=dict)
    exempt_blueprints: set[object] = field(default_factory=set)
    #: views and blueprints exempt in part (``exempt(flags=...)``): their flags
    scopes: dict[object, ExemptionScope] = field(default_factory=dict)
    #: what each app serves, its ``objects`` (held by the app's state; dropped with it): a
    #: declaration on one of them from now on raises
    served: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)
    #: what an app's first request looked at: another app does not warn of it (an app
    #: factory's views of the apps made before)
    told: set[object] = field(default_factory=set)

    def check_open(self, target: object, what: str) -> None:
        """Raise if an app already serves ``target``: a declaration on it would never apply."""
        if not hashable(target):
            return
        for served in list(self.served):
            if target in served.objects:
                raise ConfigurationError(
                    f"{what} on {describe(target)} comes after the app {served.app_name!r} "
                    "served its first request, so it would never apply: that app bound its "
                    "limits then. Declare every limit and exemption before the app serves "
                    "(at import time or in the app factory), as Flask requires for app.route."
                )

    def attached(self, view: object, method: str) -> tuple[list[object], list[object]]:
        """:func:`~flask_distlimit.declare.targets.view_objects` of ``view`` and ``method``,
        with the limit wrappers made of each of them."""
        every, one = view_objects(view, method)
        every += [w for o in every for w in self.wrapped_by.get(o, ())]
        one += [w for o in one for w in self.wrapped_by.get(o, ())]
        return every, one
