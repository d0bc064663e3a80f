"""Limit strings: ``"10/second"``, ``"100 per minute"``, ``"5/30 seconds"``, joined by ``;``.

:func:`parse_rates` turns one into :class:`Rate` values when the app is configured, never per
request, or raises :class:`~flask_distlimit.errors.ConfigurationError` naming the bad part and
the accepted forms. Units are Flask-Limiter's (a month is 30 days, a year 360), a period is at
most 366 days: docs/design-notes.md, "Limit strings".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from flask_distlimit.errors import ConfigurationError

_UNITS: Final[dict[str, int]] = {
    "s": 1, "sec": 1, "secs": 1, "second": 1, "seconds": 1,
    "min": 60, "mins": 60, "minute": 60, "minutes": 60,
    "h": 3600, "hr": 3600, "hrs": 3600, "hour": 3600, "hours": 3600,
    "d": 86400, "day": 86400, "days": 86400,
    "month": 30 * 86400, "months": 30 * 86400,
    "year": 360 * 86400, "years": 360 * 86400,
}  # fmt: skip

#: How :class:`Rate` names a period, largest unit first (a whole number of it).
_NAMES: Final = tuple((u, _UNITS[u]) for u in ("year", "month", "day", "hour", "minute", "second"))

_RATE: Final = re.compile(
    # matched on the stripped text; no two whitespace runs meet (linear, whatever the spaces)
    r"^(?P<amount>\d+)(?:\s*/\s*|\s+per\s+)(?:(?P<multiple>\d+)\s*)?(?P<unit>[a-z]+)$",
    re.IGNORECASE,
)

_ACCEPTED: Final = (
    "Write '<count>/<unit>' or '<count> per <unit>', optionally '<count>/<n> <unit>', with a "
    "count >= 0 (0 refuses every request) and a unit of second (s, sec), minute (min), hour "
    "(h, hr), day (d), month (30 days) or year (360 days), singular or plural "
    "(e.g. '10/second', '100 per minute', '5/30 seconds', '1000/hour', '10000/month'); join "
    "several with ';' (e.g. '10/second;1000/hour'), or ',' or '|' as Flask-Limiter does."
)

#: Largest accepted period (a leap year; ``"1/year"`` is 360 days), a guard against typos such
#: as '1/99999999 days', and the longest a key must live.
_MAX_PERIOD: Final = 366 * 86400
#: Largest accepted count; larger counts cannot be represented exactly by every algorithm.
_MAX_AMOUNT: Final = 10**12


@dataclass(frozen=True, slots=True)
class Rate:
    """``amount`` units per ``period`` seconds, e.g. ``Rate(100, 60)`` for ``"100/minute"``."""

    amount: int
    period: int

    def __post_init__(self) -> None:
        if not 0 <= self.amount <= _MAX_AMOUNT:  # 0: every request refused
            raise ConfigurationError(
                f"A rate needs a count from 0 to {_MAX_AMOUNT}, got {self.amount!r}. {_ACCEPTED}"
            )
        if not 1 <= self.period <= _MAX_PERIOD:
            raise ConfigurationError(
                f"A rate needs a period from 1 second to 366 days (a year is 360 days, a "
                f"month 30), got {self.period!r} seconds. {_ACCEPTED}"
            )

    @property
    def period_us(self) -> int:
        """The period in microseconds (the unit the storage computes in)."""
        return self.period * 1_000_000

    def __str__(self) -> str:
        unit, seconds = next((u, s) for u, s in _NAMES if self.period % s == 0)
        n = self.period // seconds
        return f"{self.amount}/{unit}" if n == 1 else f"{self.amount}/{n} {unit}s"

    def in_words(self) -> str:
        """Flask-Limiter's wording, e.g. ``"1 per 1 day"``, ``"5 per 30 second"``: what its
        ``RateLimitExceeded.description`` says, so ours says the same."""
        unit, seconds = next((u, s) for u, s in _NAMES if self.period % s == 0)
        return f"{self.amount} per {self.period // seconds} {unit}"


def _parse_one(text: str, whole: str) -> Rate:
    match = _RATE.match(text.strip())
    if match is None:
        raise ConfigurationError(
            f"Cannot read the rate limit {text.strip()!r} in {whole!r}. {_ACCEPTED}"
        )
    unit = match["unit"].lower()
    if unit == "m":
        raise ConfigurationError(
            f"The unit 'm' in rate limit {text.strip()!r} could mean minute or month: write "
            f"'min' or 'minute' (or 'month'). {_ACCEPTED}"
        )
    if unit not in _UNITS:
        raise ConfigurationError(
            f"Unknown time unit {match['unit']!r} in rate limit {text.strip()!r}. {_ACCEPTED}"
        )
    digits = match["amount"].lstrip("0") or "0"  # more than 10**12: as good as unlimited, 10**12
    amount = min(int(digits), _MAX_AMOUNT) if len(digits) <= 13 else _MAX_AMOUNT
    multiple = int(match["multiple"]) if match["multiple"] is not None else 1
    if multiple < 1:
        raise ConfigurationError(
            f"Rate limit {text.strip()!r} must have a period of at least 1. {_ACCEPTED}"
        )
    return Rate(amount, multiple * _UNITS[unit])


def parse_rates(value: str) -> tuple[Rate, ...]:
    """Parse ``"10/second;1000/hour"`` into rates; ``""`` gives ``()``.

    Raises :class:`ConfigurationError` for anything else, naming the value and the accepted forms.
    """
    if not isinstance(value, str):
        raise ConfigurationError(f"A rate limit must be a string, got {value!r}. {_ACCEPTED}")
    if not value.strip():
        return ()
    rates: list[Rate] = []
    for part in re.split("[;,|]", value):
        if not part.strip():
            raise ConfigurationError(f"An empty rate limit in {value!r}. {_ACCEPTED}")
        rates.append(_parse_one(part, value))
    return tuple(rates)
