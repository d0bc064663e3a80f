"""Every identity setting, read and checked once by :meth:`IdentitySettings.from_config`."""

from __future__ import annotations

import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Final

from flask_distlimit.core.limits import Rate
from flask_distlimit.errors import ConfigurationError
from flask_distlimit.identity.digests import tag_secret
from flask_distlimit.identity.jwt import JwtVerifier, read_jwt
from flask_distlimit.identity.tiers import read_tiers

#: Every key :meth:`IdentitySettings.from_config` reads, with its default (the others:
#: ``config.DEFAULTS``); an app's other ``DISTLIMIT_*`` keys are refused as unknown
#: (``Settings.from_config``). Each is documented in docs/configuration.md.
IDENTITY_KEYS: Final[dict[str, object]] = {
    "DISTLIMIT_TIERS": {},  # no tier limits: nothing is limited that the app did not declare
    "DISTLIMIT_TRUSTED_PROXIES": 0,
    "DISTLIMIT_IPV6_PREFIX": 64,
    "DISTLIMIT_API_KEY_HEADER": "X-Api-Key",
    "DISTLIMIT_API_KEY_SECRET": None,  # SECRET_KEY
    "DISTLIMIT_JWT_KEYS": None,  # no JWT path
    "DISTLIMIT_JWT_ALGORITHMS": None,
    "DISTLIMIT_JWT_AUDIENCE": None,
    "DISTLIMIT_JWT_ISSUER": None,
    "DISTLIMIT_JWT_LEEWAY": 0,
    "DISTLIMIT_JWT_SUBJECT_CLAIM": "sub",
    "DISTLIMIT_JWT_CLIENT_CLAIM": "client_id",
    "DISTLIMIT_JWT_TIER_CLAIM": "tier",
}

_HEADER_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9\-]{0,63}")


@dataclass(frozen=True)
class IdentitySettings:
    """Every identity setting (the keys of :data:`IDENTITY_KEYS`), read once from
    ``app.config`` by :meth:`from_config`."""

    tiers: Mapping[str, tuple[Rate, ...]]
    trusted_proxies: int
    ipv6_prefix: int
    api_key_header: str
    #: ``DISTLIMIT_API_KEY_SECRET``, else ``SECRET_KEY``, as bytes; ``None``: neither is set
    api_key_secret: bytes | None = field(repr=False)
    jwt: JwtVerifier | None
    #: the key of identity tags derived from the same secret
    #: (:mod:`flask_distlimit.identity.digests`); ``None``: the storage keeps one for the deployment
    tag_secret: bytes | None = field(repr=False)

    @classmethod
    def from_config(cls, config: MutableMapping[str, object]) -> IdentitySettings:
        """Read (``setdefault``) and check every identity key of ``config``.

        Raises :class:`ConfigurationError` naming the key, the value and the accepted forms.
        """
        for key, default in IDENTITY_KEYS.items():
            config.setdefault(key, dict(default) if isinstance(default, dict) else default)
        tiers = read_tiers(config["DISTLIMIT_TIERS"])
        trusted = _read_int(
            config, "DISTLIMIT_TRUSTED_PROXIES", 0, 32,
            "the number of proxy hops in front of the app that append to X-Forwarded-For "
            "(0 when clients connect directly)",
        )  # fmt: skip
        prefix = _read_int(
            config, "DISTLIMIT_IPV6_PREFIX", 1, 128,
            "the IPv6 prefix length clients are grouped by (64 is one subscriber's network)",
        )  # fmt: skip
        header = config["DISTLIMIT_API_KEY_HEADER"]
        if not isinstance(header, str) or not _HEADER_NAME.fullmatch(header):
            raise ConfigurationError(
                f"DISTLIMIT_API_KEY_HEADER must be an HTTP header name of letters, digits and '-' "
                f"(e.g. 'X-Api-Key'), got {header!r}."
            )
        secret = _read_secret(config)
        return cls(
            tiers=tiers,
            trusted_proxies=trusted,
            ipv6_prefix=prefix,
            api_key_header=header,
            api_key_secret=secret,
            jwt=read_jwt(config),
            tag_secret=tag_secret(secret) if secret is not None else None,
        )


def _read_int(config: Mapping[str, object], key: str, low: int, high: int, meaning: str) -> int:
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigurationError(
            f"{key} must be an integer from {low} to {high}: {meaning}; got {value!r}."
        )
    return value


def _read_secret(config: Mapping[str, object]) -> bytes | None:
    """``DISTLIMIT_API_KEY_SECRET``, else ``SECRET_KEY``, as bytes; ``None`` when neither."""
    for key in ("DISTLIMIT_API_KEY_SECRET", "SECRET_KEY"):
        value = config.get(key)
        if value is None or value == "" or value == b"":
            continue
        if isinstance(value, str):
            value = value.encode("utf-8")
        if not isinstance(value, bytes):
            raise ConfigurationError(
                f"{key} must be a string or bytes (a long random secret, e.g. "
                f"secrets.token_hex(32)), got the type {type(value).__name__}."
            )
        return value
    return None
