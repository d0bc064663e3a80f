"""The identity of one request: user, JWT, API key or client address, in that order.

:meth:`IdentityResolver.identify` runs on every request and reads no configuration: everything
it needs was read by :meth:`~flask_distlimit.identity.IdentitySettings.from_config`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from flask_distlimit.errors import ConfigurationError
from flask_distlimit.identity.addresses import ClientAddresses
from flask_distlimit.identity.api_keys import NO_SECRET, ApiKeys, ApiKeyVerifier, id_text
from flask_distlimit.identity.settings import IdentitySettings
from flask_distlimit.identity.tiers import ANONYMOUS

if TYPE_CHECKING:
    import flask

logger = logging.getLogger(__name__)

#: How many distinct unknown tier names are warned about (bounds the memory of "warned once").
_MAX_WARNED_TIERS: Final = 256


@dataclass(frozen=True, slots=True)
class Identity:
    """The identity one request is counted under.

    - ``kind``: ``"user"``, ``"jwt"``, ``"api_key"`` or ``"ip"``;
    - ``value``: the identity text, its kind first (:mod:`flask_distlimit.declare.keys`), e.g.
      ``"user:42"``, ``"jwt:sub:alice"``, ``"apikey:<hmac hex>"``, ``"ip:203.0.113.9"``,
      ``"ip:2001:db8:1:2::/64"``, ``"ip:invalid-via:10.0.0.1"``. Never a raw API key; it may
      hold any character (storage keys carry only a keyed digest of it);
    - ``tier``: a key of ``DISTLIMIT_TIERS``.
    """

    kind: str
    value: str
    tier: str


@dataclass
class IdentityHooks:
    """The app's hooks; the :class:`~flask_distlimit.Limiter` keeps one and its decorators fill it.

    - ``identity_loader() -> (id, tier or None) | None``: a verified identity of the current
      request, e.g. ``(str(current_user.id), current_user.plan)``; ``None`` when anonymous.
    - ``api_key_verifier(raw_key) -> (key_id, tier or None) | tier | None``: a valid key's
      canonical id and tier (the key is counted by that id), or only its tier (counted by its
      spelling); ``None`` when the key is unknown (the request then counts as anonymous). See
      :mod:`flask_distlimit.identity.api_keys`.
    - ``tier_resolver(identity) -> tier``: replaces the default tier of every identity.

    Exceptions raised by hooks propagate: they are the app's code.
    """

    identity_loader: Callable[[], tuple[str, str | None] | None] | None = None
    api_key_verifier: ApiKeyVerifier | None = None
    tier_resolver: Callable[[Identity], str] | None = None


class IdentityResolver:
    """Identifies requests according to :class:`IdentitySettings` (one per app); a tier name
    not in ``DISTLIMIT_TIERS`` counts as ``anonymous``, logged at WARNING once per name."""

    def __init__(self, settings: IdentitySettings) -> None:
        self.settings = settings
        self._tier_names = frozenset(settings.tiers)
        self._warned_tiers: set[str] = set()
        self._api_keys = ApiKeys(settings.api_key_header, settings.api_key_secret)
        addresses = ClientAddresses(settings.trusted_proxies, settings.ipv6_prefix)
        #: ``client_ip(environ) -> "ip:<address>"`` of the client (see
        #: :mod:`flask_distlimit.identity.addresses`)
        self.client_ip: Callable[[Mapping[str, object]], str] = addresses.client_ip
        #: ``api_key_identity(key_id) -> "apikey:<hex>"``: the identity of a verified API key,
        #: without the key itself; ``key_id`` is the canonical id the verifier answered, or the
        #: key when it answers only a tier
        self.api_key_identity: Callable[[str], str] = self._api_keys.identity
        self._jwt = settings.jwt
        # An anonymous client's Identity per address (a frozen dataclass costs ~0.6 us to build).
        self._anonymous: Callable[[str], Identity] = functools.lru_cache(maxsize=4096)(
            functools.partial(Identity, "ip", tier=ANONYMOUS)
        )

    # -- checks ------------------------------------------------------------------------------

    def check_hooks(self, hooks: IdentityHooks) -> None:
        """Raise :class:`~flask_distlimit.errors.ConfigurationError` when the hooks cannot work
        with the settings.

        Called by ``init_app`` and, for hooks set later, on every request.
        """
        if hooks.api_key_verifier is not None and self.settings.api_key_secret is None:
            raise ConfigurationError(NO_SECRET)

    # -- the request path --------------------------------------------------------------------

    def identify(
        self, request: flask.Request, hooks: IdentityHooks, address: str | None = None
    ) -> Identity:
        """The identity of ``request``: user, JWT, API key or client IP (``address``, when it
        is known: :meth:`client_ip`), in that order."""
        verifier = hooks.api_key_verifier
        if verifier is not None and self.settings.api_key_secret is None:
            self.check_hooks(hooks)  # raises: a verifier set after init_app, and no secret
        environ = request.environ
        vouched = hooks.identity_loader is not None or self._jwt is not None or verifier is not None
        identity = self._verified(environ, hooks) if vouched else None
        if identity is None:  # anonymous: counted by its address
            identity = self._anonymous(address or self.client_ip(environ))
        if hooks.tier_resolver is not None:
            tier = self._known(hooks.tier_resolver(identity), "the tier resolver")
            if tier != identity.tier:
                identity = Identity(identity.kind, identity.value, tier)
        return identity

    def _verified(self, environ: Mapping[str, object], hooks: IdentityHooks) -> Identity | None:
        """The first identity the app's loader, a JWT or an API key vouches for."""
        loaded = hooks.identity_loader() if hooks.identity_loader is not None else None
        if loaded is not None:
            # (id, tier), not a bare id's characters
            if not (isinstance(loaded, (tuple, list)) and len(loaded) == 2):
                raise TypeError(
                    f"The identity loader must return (id, tier or None) or None, got {loaded!r}."
                )
            user_id, tier = loaded
            text = id_text(user_id)
            if text is not None:
                return Identity("user", f"user:{text}", self._known(tier, "the identity loader"))
            # no id (Flask-Login's get_id() of an anonymous user): anonymous; else not an id
            if user_id is not None and user_id != "":
                raise TypeError(
                    f"The identity loader returned the id {user_id!r}; an id is a str or int "
                    "(e.g. str(current_user.id))."
                )
        if self._jwt is not None:
            found = self._jwt.identify(environ.get("HTTP_AUTHORIZATION"))
            if found is not None:
                return Identity("jwt", found[0], self._known(found[1], "a JWT tier claim"))
        verifier = hooks.api_key_verifier
        found = self._api_keys.verify(environ, verifier) if verifier is not None else None
        if found is not None:
            return Identity("api_key", found[0], self._known(found[1], "the API key verifier"))
        return None

    def _known(self, tier: object, source: str) -> str:
        """``tier`` when the table knows it (any str when there is no table), else ANONYMOUS."""
        if tier is None:
            return ANONYMOUS
        if isinstance(tier, str) and (tier in self._tier_names or not self._tier_names):
            return tier  # with no tier table, a tier only names the client's plan in reports
        shown = repr(tier)[:80]
        if shown not in self._warned_tiers and len(self._warned_tiers) < _MAX_WARNED_TIERS:
            self._warned_tiers.add(shown)
            logger.warning(
                "Unknown tier %s from %s: counted as %r. Add it to DISTLIMIT_TIERS (known: %s). "
                "(Logged once per tier name.)",
                shown, source, ANONYMOUS, sorted(self._tier_names),
            )  # fmt: skip
        return ANONYMOUS
