"""Shadow limits: decided and counted as if enforced, never refusing (a dark launch).

A shadow limit rides the request's one storage call on the key it would have if enforced, is
charged exactly when the enforced limit would have been, never denies and never shows in the
headers. This module holds ``DISTLIMIT_SHADOW``'s form and the bounded INFO log of would-be
refusals (docs/defences.md, "What a shadow limit does, exactly").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence

from flask import request

from flask_distlimit.core.decision import Check
from flask_distlimit.core.pacing import OncePerWindow
from flask_distlimit.declare.dynamic_limits import log_text
from flask_distlimit.declare.keys import key_tag
from flask_distlimit.errors import ConfigurationError

log = logging.getLogger("flask_distlimit")

#: ``DISTLIMIT_SHADOW``: every limit (True), none (False), or the config-declared limits named.
ShadowSetting = bool | frozenset[str]


def parse_shadow(key: str, value: object) -> ShadowSetting:
    """Validate ``DISTLIMIT_SHADOW``: a bool, or a list/tuple/set of ``"global"``,
    ``"default"`` and ``"tier:<name>"`` (tier names are checked against ``DISTLIMIT_TIERS``
    by :func:`check_tiers`)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (list, tuple, set, frozenset)) and all(
        isinstance(item, str)
        and (item in ("global", "default") or (item.startswith("tier:") and len(item) > 5))
        for item in value
    ):
        return frozenset(value)
    raise ConfigurationError(
        f"{key}={value!r} is not valid. Use True (every limit is a shadow limit), False, or a "
        "list naming the limits declared in config that are: 'global' "
        "(DISTLIMIT_GLOBAL_LIMITS), 'default' (DISTLIMIT_DEFAULT_LIMITS), 'tier:<name>' (a tier "
        "of DISTLIMIT_TIERS). Decorated limits take shadow=True."
    )


def check_tiers(setting: ShadowSetting, tiers: Collection[str], kinds: Collection[str]) -> None:
    """Raise at start-up when ``DISTLIMIT_SHADOW`` names a tier that is not configured, or
    ``"global"`` or ``"default"`` when ``kinds``, those configured, lack it: a setting that
    changes nothing."""
    if isinstance(setting, bool):
        return
    unknown = sorted(
        n for n in setting if (n[5:] not in tiers if n.startswith("tier:") else n not in kinds)
    )
    if unknown:
        raise ConfigurationError(
            f"DISTLIMIT_SHADOW names {', '.join(map(repr, unknown))}, but no such limit is "
            f"configured (DISTLIMIT_GLOBAL_LIMITS, DISTLIMIT_DEFAULT_LIMITS, tiers: "
            f"{', '.join(sorted(tiers)) or 'none'}). Name a configured limit."
        )


def spec_is_shadow(setting: ShadowSetting, kind: str, tier: str | None = None) -> bool:
    """Whether ``DISTLIMIT_SHADOW`` makes a limit of ``kind`` (and ``tier``) a shadow limit."""
    if isinstance(setting, bool):
        return setting
    return (f"tier:{tier}" if kind == "tier" else kind) in setting


class ShadowLog:
    """One INFO line per client and shadow limit per window at most, never one per request."""

    def __init__(self, clock: Callable[[], int]) -> None:
        self._clock = clock  # microseconds
        self._logged = OncePerWindow()

    def would_deny(self, denied: Sequence[Check]) -> None:
        """``denied``: the current request's shadow checks that would have refused it."""
        fresh = self._logged.due(denied, self._clock())
        if not fresh:
            return
        log.info(
            "Shadow rate limit would have refused a request (not enforced): %s; %s %s "
            "(logged once per client and limit per window)",
            ", ".join(f"{c.bound.name} (client {key_tag(c.key)})" for c in fresh),
            log_text(request.method),  # any word a server took (not gunicorn: tokens)
            request.endpoint,
        )
