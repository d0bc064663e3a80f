"""Tiers: the ``DISTLIMIT_TIERS`` table, and the tier names hooks, tokens and keys answer.

A tier name not in the table counts as ``anonymous`` (:class:`~.resolver.IdentityResolver`);
with no table, a tier only names the client's plan in reports.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Final

from flask_distlimit.core.limits import Rate, parse_rates
from flask_distlimit.errors import ConfigurationError

#: The tier of every client that no hook, token or key places in another one.
ANONYMOUS: Final = "anonymous"

_TIER_NAME: Final = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def parse_tier_table(
    value: Mapping[Any, Any], check_name: Callable[[object], None], entry: str
) -> dict[str, tuple[Rate, ...]]:
    """``value``, a mapping of tier name -> limit string, with each string parsed: the names
    checked by ``check_name`` (it raises), a bad string's error prefixed ``entry.format(name)``.
    ``DISTLIMIT_TIERS`` and a limit mapping (``limiter.limit({"free": ...})``) both read so."""
    table: dict[str, tuple[Rate, ...]] = {}
    for name, text in value.items():
        check_name(name)
        try:
            table[name] = parse_rates(text)
        except ConfigurationError as exc:
            raise ConfigurationError(f"{entry.format(name)}: {exc}") from None
    return table


def read_tiers(value: object) -> Mapping[str, tuple[Rate, ...]]:
    """``DISTLIMIT_TIERS`` parsed, or :class:`ConfigurationError` naming the fix."""
    accepted = (
        "Set DISTLIMIT_TIERS to a dict of tier name -> limit string, with an 'anonymous' tier, "
        "e.g. {'anonymous': '60/minute', 'pro': '1800/minute'}."
    )
    if not isinstance(value, Mapping):
        raise ConfigurationError(f"DISTLIMIT_TIERS must be a dict, got {value!r}. {accepted}")

    def check_name(name: object) -> None:
        if not isinstance(name, str) or not _TIER_NAME.fullmatch(name):
            raise ConfigurationError(
                f"DISTLIMIT_TIERS has the tier name {name!r}; a tier name is 1-64 letters, digits, "
                f"'_', '.' or '-'. {accepted}"
            )

    tiers = parse_tier_table(value, check_name, "DISTLIMIT_TIERS[{!r}]")
    if tiers and ANONYMOUS not in tiers:
        raise ConfigurationError(
            f"DISTLIMIT_TIERS has no 'anonymous' tier (got {sorted(tiers)}): every client that is "
            f"not identified, or whose tier is unknown, is counted in it. {accepted}"
        )
    return MappingProxyType(tiers)
