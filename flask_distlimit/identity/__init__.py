"""Who is asking: the identity a request is counted under, and its tier.

Secure by default: a request is counted as the first that holds of ``user`` (the app's
``identity_loader``), ``jwt`` (a verified bearer token, :mod:`.jwt`), ``apikey`` (only when the
app's verifier accepts it, :mod:`.api_keys`), else ``ip``, the client address trusted proxies
vouch for (:mod:`.addresses`); a limit's ``key_func`` comes before them all. Tiers come from
``DISTLIMIT_TIERS`` (:mod:`.tiers`), the ``tier_resolver`` hook having the last word. Every
setting is read once by :meth:`IdentitySettings.from_config`; :meth:`IdentityResolver.identify`
reads none per request.
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
