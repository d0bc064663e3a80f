"""Who is asking: the identity a request is counted under, and its tier.

Secure by default. A request is identified by the first of these that holds (an app-given
``key_func`` on a limit is applied by the extension before any of them):

1. ``user``: a verified identity from the app's ``identity_loader`` hook (e.g. Flask-Login's
   ``current_user``), as ``(id, tier or None)``;
2. ``jwt``: ``Authorization: Bearer <token>`` verified by PyJWT (:mod:`.jwt`);
3. ``api_key``: the ``X-Api-Key`` header, only when the app's ``api_key_verifier`` accepts it,
   kept only as an HMAC digest (:mod:`.api_keys`);
4. ``ip``: the client address, ``REMOTE_ADDR`` or the ``X-Forwarded-For`` entry that
   ``DISTLIMIT_TRUSTED_PROXIES`` hops vouch for, read exactly as the proxies wrote it; where
   that entry is no address, ``ip:invalid-via:<nearest trusted hop>`` (:mod:`.addresses`).

Tiers come from ``DISTLIMIT_TIERS`` (:mod:`.tiers`); the app's ``tier_resolver`` hook, when set,
has the last word.

Every setting is read and checked once, by :meth:`IdentitySettings.from_config`
(:mod:`.settings`); :meth:`IdentityResolver.identify` (:mod:`.resolver`) runs on every request
and reads no configuration.
"""

from __future__ import annotations

from flask_distlimit.identity.addresses import INVALID_IP, UNIDENTIFIED_VIA
from flask_distlimit.identity.api_keys import MAX_API_KEY_LENGTH
from flask_distlimit.identity.jwt import MAX_TOKEN_LENGTH, JwtSettings
from flask_distlimit.identity.resolver import Identity, IdentityHooks, IdentityResolver
from flask_distlimit.identity.settings import IDENTITY_KEYS, IdentitySettings
from flask_distlimit.identity.tiers import ANONYMOUS, DEFAULT_TIERS, EXAMPLE_TIERS

__all__ = [
    "ANONYMOUS",
    "DEFAULT_TIERS",
    "EXAMPLE_TIERS",
    "IDENTITY_KEYS",
    "INVALID_IP",
    "MAX_API_KEY_LENGTH",
    "MAX_TOKEN_LENGTH",
    "UNIDENTIFIED_VIA",
    "Identity",
    "IdentityHooks",
    "IdentityResolver",
    "IdentitySettings",
    "JwtSettings",
]
