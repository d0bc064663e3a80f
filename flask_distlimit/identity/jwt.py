"""The built-in JWT path: ``DISTLIMIT_JWT_*`` read once, bearer tokens verified with PyJWT.

A token is an identity only when its signature, ``exp``, ``aud`` (and ``iss`` when configured)
were verified with the configured keys and algorithms (never ``none``); any other token is no
identity, never a 500. PyJWT is imported only when ``DISTLIMIT_JWT_KEYS`` is set.
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final

from flask_distlimit.errors import ConfigurationError
from flask_distlimit.identity.api_keys import id_text

#: Longest bearer token verified; a longer one is ignored as unverifiable.
MAX_TOKEN_LENGTH: Final = 8192

_CLAIM_NAME: Final = re.compile(r"[^\s]{1,64}")
_JWT_HINT: Final = "Install it with `pip install 'pyjwt>=2.8'` (Flask-DistLimit's `jwt` extra)."


@dataclass(frozen=True)
class JwtVerifier:
    """The built-in JWT path, made from ``DISTLIMIT_JWT_*`` by :func:`read_jwt`: verifies bearer
    tokens with PyJWT; answers an identity or ``None``, never raises.

    ``keys`` pairs every configured algorithm with each key that can verify it, already prepared
    by PyJWT (a PEM key is parsed once, at start-up); ``decode_options``: the keywords of PyJWT's
    ``decode`` (audience, issuer, leeway, required claims).
    """

    keys: Mapping[str, tuple[object, ...]] = field(repr=False)
    decode_options: Mapping[str, Any]
    subject_claim: str
    client_claim: str
    tier_claim: str
    header: Callable[[str], dict[str, Any]] = field(repr=False)
    decode: Callable[..., dict[str, Any]] = field(repr=False)
    errors: tuple[type[BaseException], ...] = field(repr=False)

    def identify(self, authorization: object) -> tuple[str, object] | None:
        """``(identity text, tier claim)`` of the verified ``Authorization: Bearer <token>``
        when it names a client, else ``None``."""
        if not isinstance(authorization, str) or len(authorization) > MAX_TOKEN_LENGTH + 16:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return None
        try:
            alg = self.header(token).get("alg")
        except self.errors:
            return None
        # 'none', or an algorithm not configured: no key, never trusted
        for key in self.keys.get(alg, ()) if isinstance(alg, str) else ():
            try:
                claims = self.decode(token, key, algorithms=[alg], **self.decode_options)
            except self.errors:
                continue
            subject = claims.get(self.subject_claim)
            if isinstance(subject, str) and subject:
                return f"jwt:sub:{subject}", claims.get(self.tier_claim)
            client = id_text(claims.get(self.client_claim))
            if client is None:
                return None  # verified, but it names no one
            return f"jwt:client_id:{client}", claims.get(self.tier_claim)
        return None


def _as_list(value: object) -> list[object]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def read_jwt(config: Mapping[str, object]) -> JwtVerifier | None:
    """Check every ``DISTLIMIT_JWT_*`` key of ``config`` (each set, to its default when absent,
    by :meth:`~flask_distlimit.identity.IdentitySettings.from_config`); ``None``: no JWT path."""
    keys = config["DISTLIMIT_JWT_KEYS"]
    algorithms = config["DISTLIMIT_JWT_ALGORITHMS"]
    audience = config["DISTLIMIT_JWT_AUDIENCE"]
    issuer = config["DISTLIMIT_JWT_ISSUER"]
    leeway = config["DISTLIMIT_JWT_LEEWAY"]
    if keys is None or keys in ("", b"", [], ()):
        if algorithms is not None or audience is not None or issuer is not None:
            logging.getLogger("flask_distlimit").warning(
                "DISTLIMIT_JWT_* is set but DISTLIMIT_JWT_KEYS is empty, so no token is read."
            )
        return None
    try:
        jwt = importlib.import_module("jwt")
    except ImportError:
        raise ConfigurationError(
            f"DISTLIMIT_JWT_KEYS is set, but PyJWT is not installed. {_JWT_HINT}"
        ) from None

    algs = _as_list(algorithms) if algorithms is not None else []
    available = jwt.algorithms.get_default_algorithms()  # name -> PyJWT's Algorithm
    supported = sorted(a for a in available if a != "none")
    if not algs or any(not isinstance(a, str) or a not in supported for a in algs):
        raise ConfigurationError(
            f"DISTLIMIT_JWT_ALGORITHMS must list the algorithms your tokens are signed with, "
            f"from {supported} ('none' is never accepted), e.g. ['RS256']; got {algorithms!r}. "
            "With a PEM public key, use RS*/PS*/ES*/EdDSA (asymmetric ones need "
            "`pip install pyjwt[crypto]`)."
        )

    auds = _as_list(audience) if audience is not None else []
    if not auds or any(not isinstance(a, str) or not a for a in auds):
        raise ConfigurationError(
            f"DISTLIMIT_JWT_AUDIENCE must be the audience ('aud') your tokens are issued for, a "
            f"string or a list of strings, e.g. 'https://api.example.com'; got {audience!r}. "
            "A token for another audience is not an identity here."
        )
    if issuer is not None and (not isinstance(issuer, str) or not issuer):
        raise ConfigurationError(
            f"DISTLIMIT_JWT_ISSUER must be a string (the tokens' 'iss') or None, got {issuer!r}."
        )
    if isinstance(leeway, bool) or not isinstance(leeway, (int, float)) or not 0 <= leeway <= 300:
        raise ConfigurationError(
            f"DISTLIMIT_JWT_LEEWAY must be a number of seconds from 0 to 300 (clock skew allowed "
            f"on exp/nbf/iat), got {leeway!r}."
        )

    prepared: dict[str, list[object]] = {str(a): [] for a in algs}
    for index, key in enumerate(_as_list(keys)):
        ready = {alg: _prepare_key(available[alg], alg, key, index) for alg in prepared}
        if all(prepared_key is None for prepared_key in ready.values()):
            raise ConfigurationError(
                f"DISTLIMIT_JWT_KEYS[{index}] cannot verify any of DISTLIMIT_JWT_ALGORITHMS "
                f"{list(prepared)}: an HMAC secret (str/bytes) needs HS256/HS384/HS512, a PEM "
                "public key ('-----BEGIN PUBLIC KEY-----...') needs RS*/PS*/ES*/EdDSA."
            )
        for alg, prepared_key in ready.items():
            if prepared_key is not None:
                prepared[alg].append(prepared_key)
    require = ["exp", "aud"] + (["iss"] if issuer is not None else [])
    return JwtVerifier(
        keys=MappingProxyType({alg: tuple(ks) for alg, ks in prepared.items() if ks}),
        decode_options={
            "audience": [str(a) for a in auds],
            "issuer": issuer,
            "leeway": float(leeway),
            "options": {"require": require, "verify_signature": True, "strict_aud": False},
        },
        subject_claim=_claim(config, "DISTLIMIT_JWT_SUBJECT_CLAIM"),
        client_claim=_claim(config, "DISTLIMIT_JWT_CLIENT_CLAIM"),
        tier_claim=_claim(config, "DISTLIMIT_JWT_TIER_CLAIM"),
        header=jwt.get_unverified_header,
        decode=jwt.PyJWT(options={"enforce_minimum_key_length": True}).decode,
        errors=(jwt.PyJWTError, ValueError, TypeError, LookupError, OverflowError, RecursionError),
    )


def _claim(config: Mapping[str, object], setting: str) -> str:
    name = config[setting]
    if not isinstance(name, str) or not _CLAIM_NAME.fullmatch(name):
        raise ConfigurationError(f"{setting} must be a claim name such as 'sub', got {name!r}.")
    return name


def _prepare_key(algorithm: Any, alg: str, key: object, index: int) -> object | None:
    """The key prepared by PyJWT for ``alg``, ``None`` when it is not a key of that family."""
    if not isinstance(key, (str, bytes)) or not key:
        raise ConfigurationError(
            f"DISTLIMIT_JWT_KEYS[{index}] must be a non-empty string or bytes (an HMAC secret or "
            f"a PEM public key), got the type {type(key).__name__}."
        )
    try:
        ready: object = algorithm.prepare_key(key)
    except Exception:  # PyJWT raises InvalidKeyError, ValueError or TypeError for another family
        return None
    if not isinstance(ready, bytes) and not hasattr(ready, "verify"):
        raise ConfigurationError(
            f"DISTLIMIT_JWT_KEYS[{index}] is a private key; give the PUBLIC key instead (the rate "
            "limiter only verifies tokens, it must never be able to sign them)."
        )
    short = algorithm.check_key_length(ready)
    if short:
        raise ConfigurationError(f"DISTLIMIT_JWT_KEYS[{index}] is too weak for {alg}: {short}")
    return ready
