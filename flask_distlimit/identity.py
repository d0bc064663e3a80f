"""Who is asking: the identity a request is counted under, and its tier.

Secure by default. A request is identified by the first of these that holds (an app-given
``key_func`` on a limit is applied by the extension before any of them):

1. ``user``: a verified identity from the app's ``identity_loader`` hook (e.g. Flask-Login's
   ``current_user``), as ``(id, tier or None)``;
2. ``jwt``: ``Authorization: Bearer <token>`` whose signature, ``exp``, ``aud`` (and ``iss`` when
   configured) PyJWT verified with the configured keys. Its ``sub`` (else ``client_id``) claim is
   the identity, its ``tier`` claim the tier. A forged, unverified, expired, wrong-audience,
   ``alg: none`` or garbage token is not an identity: the request falls through, never a 500;
3. ``api_key``: the ``X-Api-Key`` header, only when the app's ``api_key_verifier`` accepts it (it
   answers the key's tier). The key is kept only as an HMAC-SHA256 digest (``apikey:<hex>``) and
   never appears in keys, logs or exceptions. An unknown key, or one longer than 1 KiB, is
   anonymous;
4. ``ip``: the client address: ``REMOTE_ADDR``, or the ``X-Forwarded-For`` entry that
   ``DISTLIMIT_TRUSTED_PROXIES`` hops vouch for, exactly as werkzeug's
   ``ProxyFix(x_for=DISTLIMIT_TRUSTED_PROXIES)`` picks it. IPv6 clients are grouped by their
   ``/DISTLIMIT_IPV6_PREFIX`` network so one host cannot rotate through its addresses; an
   IPv4-mapped IPv6 address counts as its IPv4 address; an unreadable address shares the bucket
   ``ip:invalid``.

Tiers come from ``DISTLIMIT_TIERS``; a tier name that is not in the table counts as
``anonymous`` (logged at WARNING once per name). The app's ``tier_resolver`` hook, when set, has
the last word.

The API-key digest key is derived from ``DISTLIMIT_API_KEY_SECRET``, else the app's
``SECRET_KEY``: ``HMAC-SHA256(HMAC-SHA256(secret, "flask-distlimit api-key"), key)``, so the same
secret never signs two kinds of data. When neither is set, an API key verifier cannot be used:
:meth:`IdentityResolver.check_hooks` (called by ``init_app``) and every request made while a
verifier is set raise :class:`~flask_distlimit.errors.ConfigurationError` saying so.

Every setting is read and checked once, by :meth:`IdentitySettings.from_config`;
:meth:`IdentityResolver.identify` runs on every request and reads no configuration.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import importlib
import ipaddress
import logging
import re
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final

from werkzeug.http import parse_list_header

from .errors import ConfigurationError
from .limits import Rate, parse_rates

if TYPE_CHECKING:
    import flask

__all__ = [
    "ANONYMOUS",
    "DEFAULT_TIERS",
    "EXAMPLE_TIERS",
    "IDENTITY_KEYS",
    "INVALID_IP",
    "Identity",
    "IdentityHooks",
    "IdentityResolver",
    "IdentitySettings",
    "JwtSettings",
]

logger = logging.getLogger(__name__)

#: The tier of every client that no hook, token or key places in another one.
ANONYMOUS: Final = "anonymous"

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

#: ``DISTLIMIT_TIERS`` when the app sets none: no tier limits. Nothing is limited that the app
#: did not declare.
DEFAULT_TIERS: Final[Mapping[str, str]] = MappingProxyType({})

#: A tier table to start from (documented; never applied unless the app sets it).
EXAMPLE_TIERS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "anonymous": "60/minute",
        "free": "300/minute",
        "pro": "1800/minute",
        "internal": "10000/minute",
    }
)

#: The one bucket shared by every request whose client address cannot be read.
INVALID_IP: Final = "ip:invalid"

#: Longest API key passed to the verifier; a longer header is ignored as an unknown key.
MAX_API_KEY_LENGTH: Final = 1024
#: Longest bearer token verified; a longer one is ignored as unverifiable.
MAX_TOKEN_LENGTH: Final = 8192
#: Longest client address text parsed (an IPv6 address with zone and port is far shorter).
_MAX_ADDRESS_LENGTH: Final = 128
#: How many distinct unknown tier names are warned about (bounds the memory of "warned once").
_MAX_WARNED: Final = 256

_TIER_NAME: Final = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_HEADER_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9\-]{0,63}")
_CLAIM_NAME: Final = re.compile(r"[^\s]{1,64}")
_DIGEST_CONTEXT: Final = b"flask-distlimit api-key"
_JWT_HINT: Final = "Install it with `pip install Flask-DistLimit[jwt]`."


@dataclass(frozen=True, slots=True)
class Identity:
    """The identity one request is counted under.

    - ``kind``: ``"user"``, ``"jwt"``, ``"api_key"`` or ``"ip"``;
    - ``value``: the identity text, e.g. ``"user:42"``, ``"jwt:sub:alice"``,
      ``"apikey:<hmac hex>"``, ``"ip:203.0.113.9"``, ``"ip:2001:db8:1:2::/64"``. Never a raw API
      key; it may hold any character (storage keys carry only a digest of it);
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
    - ``api_key_verifier(raw_key) -> tier | None``: the tier of a valid key, ``None`` when the key
      is unknown (the request then counts as anonymous).
    - ``tier_resolver(identity) -> tier``: replaces the default tier of every identity.

    Exceptions raised by hooks propagate: they are the app's code.
    """

    identity_loader: Callable[[], tuple[str, str | None] | None] | None = None
    api_key_verifier: Callable[[str], str | None] | None = None
    tier_resolver: Callable[[Identity], str] | None = None


@dataclass(frozen=True)
class JwtSettings:
    """The built-in JWT path, read from ``DISTLIMIT_JWT_*``.

    ``keys`` pairs every configured algorithm with each key that can verify it, already prepared
    by PyJWT (a PEM key is parsed once, at start-up).
    """

    keys: Mapping[str, tuple[object, ...]] = field(repr=False)
    algorithms: tuple[str, ...]
    audience: tuple[str, ...]
    issuer: str | None = None
    leeway: float = 0.0
    subject_claim: str = "sub"
    client_claim: str = "client_id"
    tier_claim: str = "tier"


def _default_tiers() -> Mapping[str, tuple[Rate, ...]]:
    return MappingProxyType({name: parse_rates(value) for name, value in DEFAULT_TIERS.items()})


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
    DISTLIMIT_API_KEY_SECRET      None: SECRET_KEY    secret of the API keys' HMAC digests
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

    tiers: Mapping[str, tuple[Rate, ...]] = field(default_factory=_default_tiers)
    trusted_proxies: int = 0
    ipv6_prefix: int = 64
    api_key_header: str = "X-Api-Key"
    api_key_secret: bytes | None = field(default=None, repr=False)
    jwt: JwtSettings | None = None

    @classmethod
    def from_config(cls, config: MutableMapping[str, object]) -> IdentitySettings:
        """Read (``setdefault``) and check every identity key of ``config``.

        Raises :class:`ConfigurationError` naming the key, the value and the accepted forms.
        """
        tiers = _read_tiers(config.setdefault("DISTLIMIT_TIERS", dict(DEFAULT_TIERS)))
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
            api_key_secret=secret,
            jwt=_read_jwt(config),
        )


def _read_tiers(value: object) -> Mapping[str, tuple[Rate, ...]]:
    accepted = (
        "Set DISTLIMIT_TIERS to a dict of tier name -> limit string, with an 'anonymous' tier, "
        "e.g. {'anonymous': '60/minute', 'pro': '1800/minute'}."
    )
    if not isinstance(value, Mapping):
        raise ConfigurationError(f"DISTLIMIT_TIERS must be a dict, got {value!r}. {accepted}")
    if not value:
        return MappingProxyType({})
    tiers: dict[str, tuple[Rate, ...]] = {}
    for name, rates in value.items():
        if not isinstance(name, str) or not _TIER_NAME.fullmatch(name):
            raise ConfigurationError(
                f"DISTLIMIT_TIERS has the tier name {name!r}; a tier name is 1-64 letters, digits, "
                f"'_', '.' or '-'. {accepted}"
            )
        try:
            tiers[name] = parse_rates(rates)
        except ConfigurationError as exc:
            raise ConfigurationError(f"DISTLIMIT_TIERS[{name!r}]: {exc}") from None
    if ANONYMOUS not in tiers:
        raise ConfigurationError(
            f"DISTLIMIT_TIERS has no 'anonymous' tier (got {sorted(tiers)}): every client that is "
            f"not identified, or whose tier is unknown, is counted in it. {accepted}"
        )
    return MappingProxyType(tiers)


def _read_int(key: str, value: object, low: int, high: int, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigurationError(
            f"{key} must be an integer from {low} to {high}: {meaning}; got {value!r}."
        )
    return value


def _read_secret(secret: object, app_secret: object) -> bytes | None:
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
        return hmac.new(value, _DIGEST_CONTEXT, hashlib.sha256).digest()
    return None


def _as_list(value: object) -> list[object]:
    if isinstance(value, (str, bytes)):
        return [value]
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _read_jwt(config: MutableMapping[str, object]) -> JwtSettings | None:
    keys = config.setdefault("DISTLIMIT_JWT_KEYS", None)
    algorithms = config.setdefault("DISTLIMIT_JWT_ALGORITHMS", None)
    audience = config.setdefault("DISTLIMIT_JWT_AUDIENCE", None)
    issuer = config.setdefault("DISTLIMIT_JWT_ISSUER", None)
    leeway = config.setdefault("DISTLIMIT_JWT_LEEWAY", 0)
    claims = {
        key: config.setdefault(key, default)
        for key, default in (
            ("DISTLIMIT_JWT_SUBJECT_CLAIM", "sub"),
            ("DISTLIMIT_JWT_CLIENT_CLAIM", "client_id"),
            ("DISTLIMIT_JWT_TIER_CLAIM", "tier"),
        )
    }
    if keys is None or keys == [] or keys == ():
        return None
    try:
        jwt_algorithms = importlib.import_module("jwt.algorithms")
    except ImportError:
        raise ConfigurationError(
            f"DISTLIMIT_JWT_KEYS is set, but PyJWT is not installed. {_JWT_HINT}"
        ) from None

    algs = _as_list(algorithms) if algorithms is not None else []
    supported = sorted(a for a in jwt_algorithms.get_default_algorithms() if a != "none")
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
    for setting, name in claims.items():
        if not isinstance(name, str) or not _CLAIM_NAME.fullmatch(name):
            raise ConfigurationError(f"{setting} must be a claim name such as 'sub', got {name!r}.")

    prepared: dict[str, list[object]] = {str(a): [] for a in algs}
    for index, key in enumerate(_as_list(keys)):
        usable = False
        for alg in prepared:
            ready = _prepare_key(jwt_algorithms, alg, key, index)
            if ready is not None:
                prepared[alg].append(ready)
                usable = True
        if not usable:
            raise ConfigurationError(
                f"DISTLIMIT_JWT_KEYS[{index}] cannot verify any of DISTLIMIT_JWT_ALGORITHMS "
                f"{list(prepared)}: an HMAC secret (str/bytes) needs HS256/HS384/HS512, a PEM "
                "public key ('-----BEGIN PUBLIC KEY-----...') needs RS*/PS*/ES*/EdDSA."
            )
    return JwtSettings(
        keys=MappingProxyType({alg: tuple(ks) for alg, ks in prepared.items() if ks}),
        algorithms=tuple(str(a) for a in algs),
        audience=tuple(str(a) for a in auds),
        issuer=issuer,
        leeway=float(leeway),
        subject_claim=str(claims["DISTLIMIT_JWT_SUBJECT_CLAIM"]),
        client_claim=str(claims["DISTLIMIT_JWT_CLIENT_CLAIM"]),
        tier_claim=str(claims["DISTLIMIT_JWT_TIER_CLAIM"]),
    )


def _prepare_key(jwt_algorithms: Any, alg: str, key: object, index: int) -> object | None:
    """The key prepared by PyJWT for ``alg``, ``None`` when it is not a key of that family."""
    if not isinstance(key, (str, bytes)) or not key:
        raise ConfigurationError(
            f"DISTLIMIT_JWT_KEYS[{index}] must be a non-empty string or bytes (an HMAC secret or "
            f"a PEM public key), got a {type(key).__name__}."
        )
    algorithm = jwt_algorithms.get_default_algorithms()[alg]
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


class _TierTable:
    """Maps tier names to known tiers, warning once per unknown name."""

    __slots__ = ("_tiers", "_warned")

    def __init__(self, tiers: Mapping[str, object]) -> None:
        self._tiers = frozenset(tiers)
        self._warned: set[str] = set()

    def known(self, tier: object, source: str) -> str:
        if tier is None:
            return ANONYMOUS
        if isinstance(tier, str) and (tier in self._tiers or not self._tiers):
            return tier  # with no tier table, a tier only names the client's plan in reports
        shown = repr(tier)[:80]
        if shown not in self._warned and len(self._warned) < _MAX_WARNED:
            self._warned.add(shown)
            logger.warning(
                "Unknown tier %s from %s: counted as %r. Add it to DISTLIMIT_TIERS (known: %s). "
                "(Logged once per tier name.)",
                shown, source, ANONYMOUS, sorted(self._tiers),
            )  # fmt: skip
        return ANONYMOUS


class _JwtVerifier:
    """Verifies bearer tokens with PyJWT; answers an identity or ``None``, never raises."""

    __slots__ = ("_decode", "_errors", "_header", "_keys", "_kwargs", "_settings")

    def __init__(self, settings: JwtSettings) -> None:
        jwt = importlib.import_module("jwt")
        self._settings = settings
        self._keys = settings.keys
        self._header: Callable[[str], dict[str, Any]] = jwt.get_unverified_header
        self._decode: Callable[..., dict[str, Any]] = jwt.PyJWT(
            options={"enforce_minimum_key_length": True}
        ).decode
        self._errors: tuple[type[BaseException], ...] = (
            jwt.PyJWTError, ValueError, TypeError, LookupError, OverflowError, RecursionError,
        )  # fmt: skip
        require = ["exp", "aud"] + (["iss"] if settings.issuer is not None else [])
        self._kwargs: dict[str, Any] = {
            "audience": list(settings.audience),
            "issuer": settings.issuer,
            "leeway": settings.leeway,
            "options": {"require": require, "verify_signature": True, "strict_aud": False},
        }

    def claims(self, authorization: object) -> dict[str, Any] | None:
        """The verified claims of ``Authorization: Bearer <token>``, else ``None``."""
        if not isinstance(authorization, str) or len(authorization) > MAX_TOKEN_LENGTH + 16:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return None
        try:
            alg = self._header(token).get("alg")
            keys = self._keys.get(alg) if isinstance(alg, str) else None
            if not keys:
                return None  # 'none', or an algorithm not configured: never trusted
            for key in keys:
                try:
                    return self._decode(token, key, algorithms=[alg], **self._kwargs)
                except self._errors:
                    continue
        except self._errors:
            return None
        return None

    def identify(self, authorization: object, tiers: _TierTable) -> Identity | None:
        claims = self.claims(authorization)
        if claims is None:
            return None
        s = self._settings
        subject = claims.get(s.subject_claim)
        if isinstance(subject, str) and subject:
            value = f"jwt:sub:{subject}"
        else:
            client = claims.get(s.client_claim)
            if isinstance(client, bool) or not isinstance(client, (str, int)) or client == "":
                return None  # verified, but it names no one
            value = f"jwt:client_id:{client}"
        return Identity("jwt", value, tiers.known(claims.get(s.tier_claim), "a JWT tier claim"))


class IdentityResolver:
    """Identifies requests according to :class:`IdentitySettings` (one per app)."""

    def __init__(self, settings: IdentitySettings) -> None:
        self.settings = settings
        self._tiers = _TierTable(settings.tiers)
        self._trusted = settings.trusted_proxies
        self._api_key_environ = "HTTP_" + settings.api_key_header.upper().replace("-", "_")
        self._mac = (
            hmac.new(settings.api_key_secret, digestmod=hashlib.sha256)
            if settings.api_key_secret is not None
            else None
        )
        self._jwt = _JwtVerifier(settings.jwt) if settings.jwt is not None else None
        self._shift = 128 - settings.ipv6_prefix
        self._prefix = settings.ipv6_prefix
        self._address: Callable[[str], str] = functools.lru_cache(maxsize=4096)(self._normalize)
        # An anonymous client's Identity per address (a frozen dataclass costs ~0.6 us to build).
        self._anonymous: Callable[[str], Identity] = functools.lru_cache(maxsize=4096)(
            functools.partial(Identity, "ip", tier=ANONYMOUS)
        )
        self._warned_invalid = False

    # -- checks ------------------------------------------------------------------------------

    def check_hooks(self, hooks: IdentityHooks) -> None:
        """Raise :class:`ConfigurationError` when the hooks cannot work with the settings.

        Called by ``init_app`` and, for hooks set later, on every request that needs them.
        """
        if hooks.api_key_verifier is not None and self._mac is None:
            raise ConfigurationError(
                "An API key verifier is set (limiter.api_key_verifier), but there is no secret to "
                "digest API keys with, so they could only be stored in clear. Set "
                "DISTLIMIT_API_KEY_SECRET (or the app's SECRET_KEY) to a long random string, "
                "e.g. secrets.token_hex(32), before init_app."
            )

    # -- the request path --------------------------------------------------------------------

    def identify(self, request: flask.Request, hooks: IdentityHooks) -> Identity:
        """The identity of ``request``: user, JWT, API key or client IP, in that order."""
        environ = request.environ
        verifier = hooks.api_key_verifier
        if verifier is not None and self._mac is None:
            self.check_hooks(hooks)
        identity: Identity | None = None
        if hooks.identity_loader is not None:
            loaded = hooks.identity_loader()
            if loaded is not None:
                identity = self._user(loaded)
        if identity is None and self._jwt is not None:
            identity = self._jwt.identify(environ.get("HTTP_AUTHORIZATION"), self._tiers)
        if identity is None and verifier is not None:
            raw = environ.get(self._api_key_environ)
            if isinstance(raw, str) and raw and len(raw) <= MAX_API_KEY_LENGTH:
                tier = verifier(raw)
                if tier is not None:
                    identity = Identity(
                        "api_key",
                        self.api_key_identity(raw),
                        self._tiers.known(tier, "the API key verifier"),
                    )
        if identity is None:
            identity = self._anonymous(self.client_ip(environ))
        if hooks.tier_resolver is not None:
            tier = self._tiers.known(hooks.tier_resolver(identity), "the tier resolver")
            if tier != identity.tier:
                identity = Identity(identity.kind, identity.value, tier)
        return identity

    def _user(self, loaded: tuple[str, str | None]) -> Identity | None:
        try:
            user_id, tier = loaded
        except (TypeError, ValueError):
            raise TypeError(
                f"The identity loader must return (id, tier or None) or None, got {loaded!r}."
            ) from None
        if isinstance(user_id, bool) or not isinstance(user_id, (str, int)):
            raise TypeError(
                f"The identity loader returned the id {user_id!r}; an id is a str or int "
                "(e.g. str(current_user.id))."
            )
        if user_id == "":
            return None
        return Identity("user", f"user:{user_id}", self._tiers.known(tier, "the identity loader"))

    def api_key_identity(self, raw_key: str) -> str:
        """``"apikey:<hex>"``: the identity of a (verified) API key, without the key itself."""
        if self._mac is None:
            raise ConfigurationError(
                "No secret to digest API keys with: set DISTLIMIT_API_KEY_SECRET or SECRET_KEY."
            )
        mac = self._mac.copy()
        mac.update(raw_key.encode("utf-8", "surrogatepass"))
        return "apikey:" + mac.hexdigest()

    def client_ip(self, environ: Mapping[str, object]) -> str:
        """``"ip:<address>"`` of the client, as ``ProxyFix(x_for=DISTLIMIT_TRUSTED_PROXIES)``
        would set ``REMOTE_ADDR``; IPv6 as its ``/DISTLIMIT_IPV6_PREFIX`` network."""
        address = environ.get("REMOTE_ADDR")
        if self._trusted:
            forwarded = environ.get("HTTP_X_FORWARDED_FOR")
            if forwarded and isinstance(forwarded, str):
                values = parse_list_header(forwarded)
                if len(values) >= self._trusted:
                    chosen = values[-self._trusted]
                    if chosen:
                        address = chosen
        if not isinstance(address, str):
            return self._invalid(address)
        value = self._address(address)
        if value == INVALID_IP:
            return self._invalid(address)
        return value

    def _invalid(self, address: object) -> str:
        if not self._warned_invalid:
            self._warned_invalid = True
            logger.warning(
                "Cannot read the client address %s; such requests share the bucket %r. Behind a "
                "proxy, set DISTLIMIT_TRUSTED_PROXIES. (Logged once.)",
                repr(address)[:80], INVALID_IP,
            )  # fmt: skip
        return INVALID_IP

    def _normalize(self, address: str) -> str:
        text = address.strip()
        if not text or len(text) > _MAX_ADDRESS_LENGTH:
            return INVALID_IP
        if text.startswith("["):  # "[v6]" or "[v6]:port"
            host, bracket, port = text[1:].partition("]")
            if not bracket or (port and not (port[0] == ":" and _is_port(port[1:]))):
                return INVALID_IP
            text = host
        elif text.count(":") == 1:  # "v4:port"
            host, _, port = text.partition(":")
            if not _is_port(port):
                return INVALID_IP
            text = host
        try:
            ip = ipaddress.ip_address(text)
        except ValueError:
            return INVALID_IP
        if isinstance(ip, ipaddress.IPv6Address):
            mapped = ip.ipv4_mapped
            if mapped is not None:
                return f"ip:{mapped}"
            network = ipaddress.IPv6Network((int(ip) >> self._shift << self._shift, self._prefix))
            return f"ip:{network}"
        return f"ip:{ip}"


def _is_port(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) <= 5
