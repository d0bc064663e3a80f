"""Every identity setting, read and checked once by :meth:`IdentitySettings.from_config`."""

from __future__ import annotations

import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Final

from flask_distlimit.core.limits import Rate
from flask_distlimit.errors import ConfigurationError
from flask_distlimit.identity.api_keys import api_key_digest_key
from flask_distlimit.identity.digests import tag_secret
from flask_distlimit.identity.jwt import JwtSettings, read_jwt
from flask_distlimit.identity.tiers import DEFAULT_TIERS, default_tiers, read_tiers

#: Every key :meth:`IdentitySettings.from_config` reads (the others: ``config.DEFAULTS``); an
#: app's other ``DISTLIMIT_*`` keys are refused as unknown (``Settings.from_config``).
IDENTITY_KEYS: Final = (
    "DISTLIMIT_TIERS",
    "DISTLIMIT_TRUSTED_PROXIES",
    "DISTLIMIT_IPV6_PREFIX",
    "DISTLIMIT_API_KEY_HEADER",
    "DISTLIMIT_API_KEY_SECRET",
    "DISTLIMIT_JWT_KEYS",
    "DISTLIMIT_JWT_ALGORITHMS",
    "DISTLIMIT_JWT_AUDIENCE",
    "DISTLIMIT_JWT_ISSUER",
    "DISTLIMIT_JWT_LEEWAY",
    "DISTLIMIT_JWT_SUBJECT_CLAIM",
    "DISTLIMIT_JWT_CLIENT_CLAIM",
    "DISTLIMIT_JWT_TIER_CLAIM",
)

_HEADER_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9\-]{0,63}")


@dataclass(frozen=True)
class IdentitySettings:
    """Every identity setting, read once from ``app.config`` by :meth:`from_config`.

    ============================  ==================  ==============================================
    key                           default             meaning
    ============================  ==================  ==============================================
    DISTLIMIT_TIERS               {} (no tier limits) tier -> limit string, with "anonymous"
                                                      when not empty; "" means no tier limit
    DISTLIMIT_TRUSTED_PROXIES     0                   proxy hops whose X-Forwarded-For counts
    DISTLIMIT_IPV6_PREFIX         64                  IPv6 clients grouped by this prefix, 1-128
    DISTLIMIT_API_KEY_HEADER      "X-Api-Key"         the API key's request header
    DISTLIMIT_API_KEY_SECRET      None: SECRET_KEY    secret of the API keys' HMAC digests and
                                                      of the identity tags in storage keys
    DISTLIMIT_JWT_KEYS            None: no JWT path   HMAC secret or PEM public key, or a list
    DISTLIMIT_JWT_ALGORITHMS      None                required with keys, e.g. ["RS256"]
    DISTLIMIT_JWT_AUDIENCE        None                required with keys: accepted "aud" values
    DISTLIMIT_JWT_ISSUER          None                when set, "iss" must equal it
    DISTLIMIT_JWT_LEEWAY          0                   seconds of skew for exp/nbf/iat, 0-300
    DISTLIMIT_JWT_SUBJECT_CLAIM   "sub"               claim naming the client
    DISTLIMIT_JWT_CLIENT_CLAIM    "client_id"         used when the subject claim is missing
    DISTLIMIT_JWT_TIER_CLAIM      "tier"              claim naming the tier
    ============================  ==================  ==============================================
    """

    tiers: Mapping[str, tuple[Rate, ...]] = field(default_factory=default_tiers)
    trusted_proxies: int = 0
    ipv6_prefix: int = 64
    api_key_header: str = "X-Api-Key"
    api_key_secret: bytes | None = field(default=None, repr=False)
    jwt: JwtSettings | None = None
    #: the key of identity tags derived from the same secret
    #: (:mod:`flask_distlimit.identity.digests`); ``None``: the storage keeps one for the deployment
    tag_secret: bytes | None = field(default=None, repr=False)

    @classmethod
    def from_config(cls, config: MutableMapping[str, object]) -> IdentitySettings:
        """Read (``setdefault``) and check every identity key of ``config``.

        Raises :class:`ConfigurationError` naming the key, the value and the accepted forms.
        """
        tiers = read_tiers(config.setdefault("DISTLIMIT_TIERS", dict(DEFAULT_TIERS)))
        trusted = _read_int(
            "DISTLIMIT_TRUSTED_PROXIES", config.setdefault("DISTLIMIT_TRUSTED_PROXIES", 0), 0, 32,
            "the number of proxy hops in front of the app that append to X-Forwarded-For "
            "(0 when clients connect directly)",
        )  # fmt: skip
        prefix = _read_int(
            "DISTLIMIT_IPV6_PREFIX", config.setdefault("DISTLIMIT_IPV6_PREFIX", 64), 1, 128,
            "the IPv6 prefix length clients are grouped by (64 is one subscriber's network)",
        )  # fmt: skip
        header = config.setdefault("DISTLIMIT_API_KEY_HEADER", "X-Api-Key")
        if not isinstance(header, str) or not _HEADER_NAME.fullmatch(header):
            raise ConfigurationError(
                f"DISTLIMIT_API_KEY_HEADER must be an HTTP header name of letters, digits and '-' "
                f"(e.g. 'X-Api-Key'), got {header!r}."
            )
        secret = _read_secret(
            config.setdefault("DISTLIMIT_API_KEY_SECRET", None), config.get("SECRET_KEY")
        )
        return cls(
            tiers=tiers,
            trusted_proxies=trusted,
            ipv6_prefix=prefix,
            api_key_header=header,
            api_key_secret=api_key_digest_key(secret) if secret is not None else None,
            jwt=read_jwt(config),
            tag_secret=tag_secret(secret) if secret is not None else None,
        )


def _read_int(key: str, value: object, low: int, high: int, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigurationError(
            f"{key} must be an integer from {low} to {high}: {meaning}; got {value!r}."
        )
    return value


def _read_secret(secret: object, app_secret: object) -> bytes | None:
    """``DISTLIMIT_API_KEY_SECRET``, else ``SECRET_KEY``, as bytes; ``None`` when neither."""
    for key, value in (("DISTLIMIT_API_KEY_SECRET", secret), ("SECRET_KEY", app_secret)):
        if value is None or value == "" or value == b"":
            continue
        if isinstance(value, str):
            value = value.encode("utf-8")
        if not isinstance(value, bytes):
            raise ConfigurationError(
                f"{key} must be a string or bytes (a long random secret, e.g. "
                f"secrets.token_hex(32)), got a {type(value).__name__}."
            )
        return value
    return None
