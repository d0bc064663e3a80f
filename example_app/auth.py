"""Who is calling: demo accounts with JWTs (PyJWT), and API keys kept only as digests.

- ``POST /token`` checks an account's password and issues a short-lived HS256 JWT whose ``tier``
  claim says which quota the caller gets. :func:`verify_token` checks signature, ``exp``, ``aud``
  and ``iss`` before anything in the token is believed: an unverified token is never an identity.
- API keys live in :data:`API_KEYS` as SHA-256 digests, never in clear; :func:`verify_api_key`
  answers the key's client and tier, or ``None`` for an unknown key.

The demo store is in the code so the example runs anywhere; a real app keeps accounts and keys in
its database, passwords as a slow hash (argon2, bcrypt, scrypt).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, Final

import jwt
from flask import current_app, g, request

__all__ = [
    "ACCOUNTS",
    "API_KEYS",
    "Caller",
    "authenticate",
    "issue_token",
    "jwt_secret",
    "verify_api_key",
    "verify_password",
    "verify_token",
]

log = logging.getLogger(__name__)

AUDIENCE: Final = "example-api"
ISSUER: Final = "example-app"
TOKEN_LIFETIME: Final = 3600  # seconds


@dataclass(frozen=True, slots=True)
class Caller:
    """A verified caller: ``client_id`` is stable across requests, ``tier`` picks the quota."""

    client_id: str
    tier: str
    via: str  # "jwt" or "api_key"


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Account:
    name: str
    password_sha256: str
    tier: str


#: Demo accounts: ``alice``/``alice-pw`` (free), ``bob``/``bob-pw`` (pro), ``ops``/``ops-pw``
#: (internal). SHA-256 keeps the demo dependency-free; use a slow password hash in a real app.
ACCOUNTS: Final[dict[str, Account]] = {
    a.name: a
    for a in (
        Account("alice", _sha256("alice-pw"), "free"),
        Account("bob", _sha256("bob-pw"), "pro"),
        Account("ops", _sha256("ops-pw"), "internal"),
    )
}

#: Demo API keys by SHA-256 digest: ``free-demo-key`` and ``pro-demo-key``.
API_KEYS: Final[dict[str, tuple[str, str]]] = {
    _sha256("free-demo-key"): ("acme-free", "free"),
    _sha256("pro-demo-key"): ("acme-pro", "pro"),
}


def jwt_secret() -> str:
    """The HS256 signing key (``create_app`` derives it from ``SECRET_KEY``)."""
    return str(current_app.config["EXAMPLE_JWT_KEY"])


def verify_password(account: str, password: str) -> Account | None:
    """The account when the password matches, else ``None`` (compared in constant time)."""
    found = ACCOUNTS.get(account)
    # Compare against a dummy digest for unknown accounts so timing does not reveal names.
    expected = found.password_sha256 if found else _sha256(secrets.token_hex(8))
    if hmac.compare_digest(expected, _sha256(password)) and found is not None:
        return found
    return None


def issue_token(account: Account, *, now: float | None = None) -> str:
    """A signed JWT for ``account``: ``sub``, ``tier``, ``aud``, ``iss``, ``iat``, ``exp``."""
    issued = int(time.time() if now is None else now)
    claims = {
        "sub": account.name,
        "tier": account.tier,
        "aud": AUDIENCE,
        "iss": ISSUER,
        "iat": issued,
        "exp": issued + TOKEN_LIFETIME,
    }
    return jwt.encode(claims, jwt_secret(), algorithm="HS256")


def verify_token(token: str) -> Caller | None:
    """The caller of a valid token (signature, exp, aud, iss checked), else ``None``."""
    try:
        claims: dict[str, Any] = jwt.decode(
            token,
            jwt_secret(),
            algorithms=["HS256"],
            audience=AUDIENCE,
            issuer=ISSUER,
            options={"require": ["exp", "sub", "aud", "iss"]},
        )
    except jwt.InvalidTokenError as exc:
        log.info("rejected a bearer token: %s", exc)
        return None
    tier = claims.get("tier")
    return Caller(f"user:{claims['sub']}", tier if isinstance(tier, str) else "free", "jwt")


def verify_api_key(key: str) -> Caller | None:
    """The caller of a known API key, else ``None`` (the key itself is never stored or logged)."""
    found = API_KEYS.get(_sha256(key))
    if found is None:
        return None
    client_id, tier = found
    return Caller(f"key:{client_id}", tier, "api_key")


def authenticate() -> Caller | None:
    """The verified caller of the current request (Bearer JWT first, then ``X-Api-Key``).

    Cached on ``g`` so the rate limiter's identity hook and the view verify only once.
    """
    if "example_caller" in g:
        cached: Caller | None = g.example_caller
        return cached
    caller: Caller | None = None
    header = request.headers.get("Authorization", "")
    if header[:7].lower() == "bearer ":
        caller = verify_token(header[7:].strip())
    elif "X-Api-Key" in request.headers:
        caller = verify_api_key(request.headers["X-Api-Key"])
    g.example_caller = caller
    return caller
