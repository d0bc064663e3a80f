"""Limit values decided per request: a callable answering a limit string, or a mapping
tier -> limit string (docs/limits.md, "Limits that depend on who is asking").

A callable's answer is kept per identity for ``DISTLIMIT_DYNAMIC_LIMIT_TTL`` seconds; one that
fails is logged (rate-limited, escaped) and the limit's ``fallback`` applies, else
:class:`LimitUnresolved` lets the failure policy answer: never a 500, never a limit silently
gone. Each value counts on a key of its own (docs/design-notes.md, "Per-request limit values").
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

from flask_distlimit.core.algorithms import Algorithm
from flask_distlimit.core.limits import Rate, parse_rates
from flask_distlimit.core.pacing import Pace
from flask_distlimit.engine.registry import check_rate
from flask_distlimit.errors import ConfigurationError
from flask_distlimit.identity.tiers import parse_tier_table

log = logging.getLogger("flask_distlimit")

#: The mapping entry for every tier the mapping does not name.
ANY_TIER: Final = "*"
#: Answers kept per dynamic limit (identities; emptied when full), and bound values.
_KEPT: Final = 10_000
#: Seconds (of the request clock) between two ERROR lines of one dynamic limit.
LOG_INTERVAL: Final = 60.0
#: The most characters of an exception's text, or of a tier, that a log line quotes.
LOG_TEXT_MAX: Final = 200
_US: Final = 1_000_000


def log_text(value: object) -> str:
    """``value`` as a log line may quote it when a client may have chosen it: ``repr`` of its
    text cut to :data:`LOG_TEXT_MAX` characters (with ``...`` and the full length), so control
    characters, newlines and ANSI escapes come out escaped and a line stays short."""
    text = value if isinstance(value, str) else str(value)
    if len(text) > LOG_TEXT_MAX:
        return repr(text[:LOG_TEXT_MAX]) + f"... ({len(text)} characters)"
    return repr(text)


class LimitUnresolved(Exception):
    """A limit of the request could not be evaluated (its app code raised, and it has no
    ``fallback``): the route's failure policy answers. Never leaves the package."""


#: A limit value: a limit string, a callable answering one, or a mapping tier -> limit string.
LimitSource = str | Callable[[], object] | Mapping[str, str]

B = TypeVar("B")


@dataclass(frozen=True, slots=True, eq=False)
class DynamicValue:
    """A declared limit value that is not a plain string."""

    source: Callable[[], object] | None  #: the callable, or None for a mapping
    table: Mapping[str, tuple[Rate, ...]] | None  #: the mapping, parsed
    fallback: tuple[Rate, ...]  #: when the callable fails
    described: str  #: how messages and ``flask distlimit limits`` show it

    @property
    def by_tier(self) -> bool:
        return self.table is not None

    def most_rates(self) -> int:
        """The most rates one request may get from this value, as known at declaration (a
        callable's answer is checked when it comes)."""
        if self.table is not None:
            return max((len(r) for r in self.table.values()), default=0)
        return max(len(self.fallback), 1)

    def check_algorithm(self, algorithm: Algorithm) -> None:
        """Raise if ``algorithm`` cannot enforce a rate known at declaration (the mapping's
        values, the fallback)."""
        for rate in [r for rs in (self.table or {}).values() for r in rs] + list(self.fallback):
            check_rate(algorithm, rate)


def read_value(value: object, fallback: str | None) -> tuple[tuple[Rate, ...], DynamicValue | None]:
    """(the static rates, None) of a limit string, or ((), the dynamic value) of a callable or
    a mapping; :class:`ConfigurationError` for anything else or a bad mapping value."""
    if fallback is not None and isinstance(value, (str, Mapping)):
        raise ConfigurationError(
            f"fallback={fallback!r} is only for a callable limit value, not {value!r}: drop "
            f"fallback (a mapping's fallback is its {ANY_TIER!r} entry)."
        )
    if isinstance(value, str):
        return parse_rates(value), None
    if isinstance(value, Mapping):
        if not value:
            raise ConfigurationError(
                "A limit mapping needs at least one tier, e.g. "
                "{'free': '10/minute', 'pro': '100/minute', '*': '5/minute'}."
            )

        def check_tier(tier: object) -> None:
            if not isinstance(tier, str) or not tier:
                raise ConfigurationError(
                    f"A limit mapping has the key {tier!r}: use tier names (strings), and "
                    f"{ANY_TIER!r} for every other tier."
                )

        table = parse_tier_table(value, check_tier, "The limit mapping's entry {!r}")
        shown = ", ".join(f"{t}={';'.join(map(str, r)) or 'none'}" for t, r in table.items())
        return (), DynamicValue(None, table, (), "{" + shown + "}")
    if callable(value):
        try:
            fallback_rates = parse_rates(fallback or "")
        except ConfigurationError as exc:
            raise ConfigurationError(f"fallback={fallback!r}: {exc}") from None
        name = getattr(value, "__qualname__", None) or repr(value)
        return (), DynamicValue(value, None, fallback_rates, f"{name}()")
    raise ConfigurationError(
        f"A limit value must be a limit string ('100/minute'), a callable returning one, or a "
        f"mapping tier -> limit string; got {value!r}."
    )


@dataclass(slots=True, eq=False)
class DynamicLimit(Generic[B]):
    """One dynamic value bound to one route (or scope): resolves it per request and keeps the
    answers per identity and the bound limits per value. ``make`` binds rates."""

    value: DynamicValue
    make: Callable[[tuple[Rate, ...]], tuple[B, ...]]
    algorithm: Algorithm
    name: str
    _answers: dict[str, tuple[int, tuple[Rate, ...]]] = field(default_factory=dict, init=False)
    #: the bound limits of each value answered, made once
    _bound: Callable[[tuple[Rate, ...]], tuple[B, ...]] = field(init=False)
    _pace: Pace = field(default_factory=lambda: Pace(LOG_INTERVAL * _US), init=False)  # ERRORs

    def __post_init__(self) -> None:
        self._bound = functools.lru_cache(maxsize=_KEPT)(self.make)

    def resolve(
        self, tag: str, tier: str | None, now_us: int, ttl_us: int, room: int
    ) -> tuple[B, ...]:
        """The bound limits of this request. ``tag`` names the counted identity, ``tier`` its
        tier, ``room`` how many more limits the request may carry."""
        table = self.value.table
        if table is not None:
            found = table.get(tier or ANY_TIER)
            rates = found if found is not None else table.get(ANY_TIER, ())
        else:
            kept = self._answers.get(tag)
            if kept is not None and kept[0] > now_us:
                rates = kept[1]
            else:
                rates = self._ask(now_us)
                if ttl_us > 0:
                    if len(self._answers) >= _KEPT:
                        self._answers.clear()
                    self._answers[tag] = (now_us + ttl_us, rates)  # whole: routes' room differs
        if len(rates) > room:  # the first apply (a mapping's largest value: only in a carrier)
            self._error(  # (the limit's name holds its value: value() or a mapping)
                "The rate limit %s has %d rates for tier %s where the request has room for %d; "
                "the first %d apply (logged at most once a minute; %d since the last line).",
                self.name, len(rates), log_text(tier), room, room, now_us=now_us,
            )  # fmt: skip
            rates = rates[:room]
        return self._bound(rates) if rates else ()

    def _error(self, message: str, *args: object, now_us: int) -> None:
        """Log ``message`` at ERROR with ``args`` and the count of lines not logged since the
        last one: at most once every :data:`LOG_INTERVAL` seconds."""
        skipped = self._pace.due(now_us)
        if skipped is not None:
            log.error(message, *args, skipped)

    def _ask(self, now_us: int) -> tuple[Rate, ...]:
        source = self.value.source
        assert source is not None
        try:
            answer = source()  # None and "" are no limit
            if answer is not None and not isinstance(answer, str):
                raise TypeError(f"it returned {answer!r}, not a limit string")
            rates = parse_rates(answer or "")
            for rate in rates:
                check_rate(self.algorithm, rate)
            return rates
        except Exception as exc:  # the app's code: any failure falls back, never a 500
            fallback = self.value.fallback
            self._error(
                "The limit value %s of the rate limit %s failed (%s: %s); %s. Return a "
                "limit string such as '100/minute', or None for no limit. (Logged at most "
                "once a minute per limit; %d failure(s) since the last line.)",
                self.value.described, self.name, type(exc).__name__, log_text(exc),
                f"using its fallback {';'.join(map(str, fallback))} until it is asked again"
                if fallback
                else "it has no fallback=, so the route's failure policy answers (open: "
                "admitted, marked degraded; closed or local: 503)",
                now_us=now_us,
            )  # fmt: skip
            if not fallback:
                raise LimitUnresolved(self.name) from exc
            return fallback


def ttl_us(seconds: float) -> int:
    """``DISTLIMIT_DYNAMIC_LIMIT_TTL`` in microseconds."""
    return 0 if seconds <= 0 or not math.isfinite(seconds) else int(seconds * 1_000_000)
