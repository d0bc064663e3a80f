"""The ``DISTLIMIT_*`` settings: read once in ``init_app``, validated, frozen in :class:`Settings`.

A bad value, or an unknown ``DISTLIMIT_*`` key (``DISTLIMIT_STORAGE_URI`` -> "did you mean
DISTLIMIT_STORAGE_URL?"), raises :class:`~flask_distlimit.errors.ConfigurationError` before the
app serves a request; nothing is read again per request. Every key is documented once, in
docs/configuration.md (the identity keys are read by :mod:`flask_distlimit.identity`).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeVar, get_args

from flask_distlimit._typing import FailurePolicy, HeaderMode
from flask_distlimit.core.algorithms import ALGORITHMS
from flask_distlimit.core.limits import Rate, parse_rates
from flask_distlimit.core.policies import FAILURE_POLICIES
from flask_distlimit.core.ranges import Range, invalid
from flask_distlimit.declare.dynamic_limits import DynamicValue, read_value
from flask_distlimit.defences import shedding
from flask_distlimit.defences.shadow import parse_shadow
from flask_distlimit.engine.concurrency import MAX_CONCURRENCY
from flask_distlimit.errors import ConfigurationError
from flask_distlimit.identity import IDENTITY_KEYS
from flask_distlimit.request.settings import LimiterSettings
from flask_distlimit.resilience.breaker import FAIL_MAX, RESET_TIMEOUT
from flask_distlimit.resilience.instances import INSTANCES_MIN, validate_instances
from flask_distlimit.storage.startup_check import STARTUP_CHECKS
from flask_distlimit.storage.tokens import TOKEN_MODES
from flask_distlimit.storage.urls import SCHEMES

if TYPE_CHECKING:
    from flask_distlimit.storage.base import Storage


#: The default of every ``DISTLIMIT_*`` key this module reads: :class:`LimiterSettings`'s own,
#: each field its key (``redis_timeout`` is ``DISTLIMIT_REDIS_TIMEOUT``), a limit key's as text
#: (``""``: no limit); a callable limit value's parsed form has no key of its own.
DEFAULTS: Final[dict[str, object]] = {
    f"DISTLIMIT_{name.upper()}": "" if name.endswith("_limits") else value
    for name, value in dataclasses.asdict(LimiterSettings()).items()
    if not name.endswith("_dynamic")
}

#: Every ``DISTLIMIT_*`` key the extension reads: those above and the identity keys.
KNOWN_KEYS: Final[tuple[str, ...]] = (*DEFAULTS, *IDENTITY_KEYS)

_KEY_FAMILY: Final = "DISTLIMIT_"
_PREFIX: Final = re.compile(r"[A-Za-z0-9_.:/-]{1,64}\Z")  # \Z: "$" allows a final newline

T = TypeVar("T")


def config_policy(config: Mapping[str, object]) -> FailurePolicy:
    """``DISTLIMIT_FAILURE_POLICY`` of an app whose Limiter was never set up (so its settings
    were never read): the value when it is a policy, else the default ``open``."""
    value = config.get("DISTLIMIT_FAILURE_POLICY")
    return next((p for p in FAILURE_POLICIES if p == value), "open")


def _one_of(choices: tuple[T, ...]) -> Callable[[str, object], T]:
    """The reader of a key whose value is one of ``choices`` (strings)."""

    def read(key: str, value: object) -> T:
        for choice in choices:
            if choice == value:
                return choice
        raise invalid(key, value, "Use one of: " + ", ".join(repr(c) for c in choices) + ".")

    return read


def _rates(key: str, value: object) -> tuple[Rate, ...]:
    try:
        return parse_rates(value)  # type: ignore[arg-type]
    except ConfigurationError as exc:
        raise ConfigurationError(f"{key} = {value!r} is not valid: {exc}") from None


def _limit_value(
    config: Mapping[str, object], key: str
) -> tuple[tuple[Rate, ...], DynamicValue | None]:
    """``config[key]``, a limit key: a limit string's rates, or a callable's or a mapping's
    dynamic value (as ``limit()``)."""
    value = config[key]
    if isinstance(value, str):
        return _rates(key, value), None
    try:
        return read_value(value, None)
    except ConfigurationError as exc:
        raise ConfigurationError(
            f"{key} = {value!r} is not valid: {exc} {key} takes what limiter.limit takes: a "
            "limit string ('100/minute;2000/hour'), a callable answering one, or a mapping "
            "tier -> limit string ({'free': '10/minute', '*': '100/minute'})."
        ) from None


def _text(accepts: Callable[[str], object], advice: str) -> Callable[[str, object], str]:
    """The reader of a key whose value is a string that ``accepts`` answers true for; any other
    value is refused with ``advice``."""

    def read(key: str, value: object) -> str:
        if isinstance(value, str) and accepts(value):
            return value
        if isinstance(value, str):
            raise invalid(key, value, advice)
        kind = type(value).__name__  # from_prefixed_env() reads FLASK_X=123 as JSON: an int
        quote = f"quote it in JSON, FLASK_{key}='\"...\"'"
        raise invalid(key, value, f"{advice} It is {kind}, not a string: {quote}.")

    return read


def _check_keys(config: MutableMapping[str, object]) -> None:
    """Refuse any ``DISTLIMIT_*`` key that is not in :data:`KNOWN_KEYS`, naming the closest."""
    unknown = sorted(
        key
        for key in config
        if isinstance(key, str) and key.startswith(_KEY_FAMILY) and key not in KNOWN_KEYS
    )
    if not unknown:
        return
    # Compared without the common "DISTLIMIT_", which would make every key look alike.
    names = {key.removeprefix(_KEY_FAMILY): key for key in KNOWN_KEYS}
    closest = {
        key: difflib.get_close_matches(key.removeprefix(_KEY_FAMILY), names, n=1, cutoff=0.6)
        for key in unknown
    }
    parts = [f"{key} (did you mean {names[c[0]]}?)" if c else key for key, c in closest.items()]
    listed = "" if all(closest.values()) else f" The keys it reads: {', '.join(KNOWN_KEYS)}."
    raise ConfigurationError(
        f"Unknown Flask-DistLimit setting{'s' if len(unknown) > 1 else ''}: {', '.join(parts)}. "
        f"Rename or remove {'them' if len(unknown) > 1 else 'it'}: a DISTLIMIT_* key the "
        f"extension does not read would be ignored in silence.{listed}"
    )


def _bool(key: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    raise invalid(key, value, "Use True or False.")


#: How each setting is read and checked: its field of :class:`LimiterSettings` -> a reader of
#: ``(key, value)``, the key being ``DISTLIMIT_<FIELD>``. The limit keys, each read into two
#: fields (its rates, or a callable's or mapping's value), are read apart.
_READERS: Final[dict[str, Callable[[str, object], object]]] = {
    "storage_url": _text(
        lambda url: url.lower().startswith(tuple(f"{s}://" for s in SCHEMES)),
        "Use a URL such as 'redis://localhost:6379/0', 'rediss://…', 'unix:///run/redis.sock', "
        "'redis+cluster://host:7000', 'redis+sentinel://host:26379/mymaster' or 'memory://'.",
    ),
    "algorithm": _one_of(ALGORITHMS),
    "meta_limits": _rates,
    "headers": _one_of(get_args(HeaderMode)),
    "key_prefix": _text(
        _PREFIX.match,
        "Use 1 to 64 letters, digits or '_', '-', '.', ':', '/' (no glob characters "
        "'*?[]', braces or spaces), e.g. 'ratelimit' or 'myapp:rl'.",
    ),
    "redis_timeout": Range(
        False, 0, 10, " seconds (every request may wait this long for Redis)", strict=True
    ).read,
    "request_tokens": _one_of(TOKEN_MODES),
    "startup_check": _one_of(STARTUP_CHECKS),
    "conditional_cost": Range(True, 0, 1000).read,
    "enabled": _bool,
    "failure_policy": _one_of(FAILURE_POLICIES),
    "instances": lambda _, value: validate_instances(value),
    "instances_min": INSTANCES_MIN.read,
    "fallback_max_keys": Range(
        True, 1, 10_000_000, " (keys the local fallback counts: up to 1 KB each)"
    ).read,
    "breaker_fail_max": FAIL_MAX.read,
    "breaker_reset_timeout": RESET_TIMEOUT.read,
    "charge_preflights": _bool,
    "dynamic_limit_ttl": Range(
        False, 0, 86400, " seconds (how long a callable limit's answer is kept per identity)"
    ).read,
    "shadow": parse_shadow,
    "concurrency_lease": Range(
        True, 1, 86_400, " seconds (a little over the longest request served)"
    ).read,
    "worker_threads": Range(
        True, 0, 10_000, " (the request threads of one process; 0 turns worker shedding off)"
    ).read,
    "worker_shed_at": shedding.parse_shed_at,
    "fleet_capacity": Range(
        True,
        0,
        MAX_CONCURRENCY,
        " (requests in flight across the fleet; 0 turns fleet shedding off)",
    ).read,
    "fleet_shares": shedding.parse_shares,
}


@dataclass(frozen=True, slots=True)
class Settings(LimiterSettings):
    """The validated ``DISTLIMIT_*`` settings of one app (see the module docstring): the record
    the request path reads, and how ``init_app`` reads and checks it."""

    def check_request_tokens(self, storage: Storage) -> None:
        """Refuse ``DISTLIMIT_REQUEST_TOKENS = "always"`` beside a ready ``storage`` whose calls
        carry tokens only when armed, or never (a ``RedisStorage`` given a ready client: its
        calls go through redis-py's ``Script``): the setting cannot reach a storage built by
        the app. A storage that names no ``request_tokens`` (``memory://``, one of the app's
        own) is taken as it is. Called by ``init_app`` for a storage passed in."""
        mode = getattr(storage, "request_tokens", None)
        if self.request_tokens != "always" or mode in (None, "always"):
            return
        name = type(storage).__name__
        if mode == "never":
            raise ConfigurationError(
                f"DISTLIMIT_REQUEST_TOKENS = 'always' cannot hold for the storage passed in "
                f"({name} on a ready client: its calls go through redis-py's Script and carry "
                "no request token). Build it from host=/port= (or from_url) with "
                "request_tokens='always', or leave the setting at 'auto'."
            )
        raise ConfigurationError(
            f"DISTLIMIT_REQUEST_TOKENS = 'always' does not reach the storage passed in "
            f"({name}, built with request_tokens={mode!r}). Build it with "
            f"request_tokens='always', or leave the setting at 'auto'."
        )

    @classmethod
    def from_config(cls, config: MutableMapping[str, object]) -> Settings:
        """Refuse unknown ``DISTLIMIT_*`` keys, set every missing key to its default in
        ``config``, then validate them all."""
        _check_keys(config)
        for key, default in DEFAULTS.items():
            # a dict default is copied: an app that edits its config never edits ours
            config.setdefault(key, dict(default) if isinstance(default, dict) else default)
        read: dict[str, Any] = {}
        for kind in ("default", "global"):  # each a limit key, read into two fields
            key = f"DISTLIMIT_{kind.upper()}_LIMITS"
            read[f"{kind}_limits"], read[f"{kind}_dynamic"] = _limit_value(config, key)
        if read["global_dynamic"] is not None and read["global_dynamic"].by_tier:
            raise ConfigurationError(
                "DISTLIMIT_GLOBAL_LIMITS is a mapping: the global limits count every request "
                "per client address, whatever its tier. Give a limit string or a callable "
                "answering one; per-tier limits go in DISTLIMIT_TIERS."
            )
        for name, reader in _READERS.items():
            key = f"DISTLIMIT_{name.upper()}"
            read[name] = reader(key, config[key])
        return cls(**read)
