"""Who is asking: the identity a request is counted under, and its tier.

A request counts as the first that holds of ``user`` (the app's ``identity_loader``), ``jwt``
(:mod:`.jwt`), ``apikey`` (only when the app's verifier accepts it, :mod:`.api_keys`), else
``ip``, the address trusted proxies vouch for (:mod:`.addresses`); a limit's ``key_func`` comes
first. Tiers: :mod:`.tiers`. Settings are read once (:meth:`IdentitySettings.from_config`).
"""

from __future__ import annotations

from flask_distlimit.identity.resolver import Identity, IdentityHooks, IdentityResolver
from flask_distlimit.identity.settings import IDENTITY_KEYS, IdentitySettings

__all__ = [
    "IDENTITY_KEYS",
    "Identity",
    "IdentityHooks",
    "IdentityResolver",
    "IdentitySettings",
]
