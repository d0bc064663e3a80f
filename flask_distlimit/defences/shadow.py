"""Shadow limits: decided and counted as if enforced, never refusing (a dark launch).

A limit declared with ``shadow=True`` (``limiter.limit``, ``limiter.shared_limit``), or made a
shadow by ``DISTLIMIT_SHADOW`` (``True``: every limit; or a list naming the limits declared in
config: ``"global"``, ``"default"``, ``"tier:<name>"``), goes into the request's one storage call
like any other, with the flag :attr:`~flask_distlimit.core.decision.Check.shadow`:

- it is decided by the same algorithm on the same key as the enforced limit would be, so turning
  shadow off enforces from the next request with the counts already in place;
- it never denies the request: the enforced limits of the request decide alone, all-or-nothing
  among themselves;
- it is charged exactly when the enforced limit would have been: when the request is admitted
  and it would have admitted it too. A would-be refusal is NOT charged to it, since an enforced
  limit that refuses charges nothing; so its stored count equals the count of the same limit
  enforced on the same traffic (``tests/defences/test_shadow.py`` holds the two equal);
- a would-be refusal is logged at INFO (once per client and limit per window, as breaches are)
  and counted in ``distlimit_shadow_denials_total{limit}``;
- it never shows in the rate-limit headers: clients would otherwise slow down for a limit that
  is not enforced (``RateLimit``/``X-RateLimit-*`` describe the enforced limit closest to denial;
  a request with only shadow limits carries none).

This module holds the configuration form of ``DISTLIMIT_SHADOW`` and the bounded log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from typing import Final

from flask_distlimit.errors import ConfigurationError

__all__ = ["ShadowLog", "ShadowSetting", "check_tiers", "parse_shadow", "spec_is_shadow"]

log = logging.getLogger("flask_distlimit")

#: ``DISTLIMIT_SHADOW``: every limit (True), none (False), or the config-declared limits named.
ShadowSetting = bool | frozenset[str]

#: Clients and limits whose would-be refusal was logged, kept until their window ends.
_KEPT: Final = 10_000


def parse_shadow(key: str, value: object) -> ShadowSetting:
    """Validate ``DISTLIMIT_SHADOW``: a bool, or a list/tuple/set of ``"global"``,
    ``"default"`` and ``"tier:<name>"`` (tier names are checked against ``DISTLIMIT_TIERS``
    by :func:`check_tiers`)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (list, tuple, set, frozenset)):
        names: set[str] = set()
        for item in value:
            if not isinstance(item, str) or not (
                item in ("global", "default") or (item.startswith("tier:") and len(item) > 5)
            ):
                break
            names.add(item)
        else:
            return frozenset(names)
    raise ConfigurationError(
        f"{key}={value!r} is not valid. Use True (every limit is a shadow limit), False, or a "
        "list naming the limits declared in config that are: 'global' "
        "(DISTLIMIT_GLOBAL_LIMITS), 'default' (DISTLIMIT_DEFAULT_LIMITS), 'tier:<name>' (a tier "
        "of DISTLIMIT_TIERS). Decorated limits take shadow=True."
    )


def check_tiers(setting: ShadowSetting, tiers: Collection[str]) -> None:
    """Raise at start-up when ``DISTLIMIT_SHADOW`` names a tier that is not configured."""
    if isinstance(setting, bool):
        return
    unknown = sorted(n for n in setting if n.startswith("tier:") and n[5:] not in tiers)
    if unknown:
        raise ConfigurationError(
            f"DISTLIMIT_SHADOW names {', '.join(map(repr, unknown))}, but DISTLIMIT_TIERS has no "
            f"such tier (tiers: {', '.join(sorted(tiers)) or 'none'}). Name a configured tier."
        )


def spec_is_shadow(setting: ShadowSetting, kind: str, tier: str | None = None) -> bool:
    """Whether ``DISTLIMIT_SHADOW`` makes a limit of ``kind`` (and ``tier``) a shadow limit."""
    if isinstance(setting, bool):
        return setting
    if kind == "tier":
        return f"tier:{tier}" in setting
    return kind in setting


class ShadowLog:
    """One INFO line per client and shadow limit per window at most, never one per request."""

    def __init__(self, clock: Callable[[], int]) -> None:
        self._clock = clock  # microseconds
        self._logged: dict[str, int] = {}

    def would_deny(
        self,
        denied: Sequence[tuple[str, str, float]],
        method: str,
        endpoint: str | None,
    ) -> None:
        """``denied``: (key, limit name, period in seconds) of each shadow limit that would have
        refused the request."""
        now = self._clock()
        logged = self._logged
        fresh = [(k, name) for k, name, _ in denied if logged.get(k, 0) <= now]
        if not fresh:
            return
        if len(logged) >= _KEPT:
            for k in [k for k, until in logged.items() if until <= now]:
                del logged[k]
            if len(logged) >= _KEPT:
                logged.clear()
        for k, _, period in denied:
            logged[k] = now + int(period * 1_000_000)
        log.info(
            "Shadow rate limit would have refused a request (not enforced): %s; %s %s "
            "(logged once per client and limit per window)",
            ", ".join(f"{name} (client {_tag(k)})" for k, name in fresh),
            method,
            endpoint,
        )


def _tag(key: str) -> str:
    """The hash tag of a storage key (the client's digest, never the identity in clear)."""
    start, end = key.find("{"), key.find("}")
    return key[start + 1 : end] if 0 <= start < end else "?"
