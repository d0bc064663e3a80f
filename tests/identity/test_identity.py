"""Identities and tiers: forged headers, tokens and keys never mint a fresh quota."""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import flask
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.crc import key_slot
from werkzeug.middleware.proxy_fix import ProxyFix
from werkzeug.test import EnvironBuilder

from flask_distlimit.core.algorithms import Algorithm
from flask_distlimit.declare.keys import limit_key
from flask_distlimit.errors import ConfigurationError
from flask_distlimit.identity import (
    Identity,
    IdentityHooks,
    IdentityResolver,
    IdentitySettings,
)
from flask_distlimit.identity.addresses import INVALID_IP
from flask_distlimit.identity.digests import IdentityTags, tag_secret
from flask_distlimit.identity.tiers import ANONYMOUS

SECRET = "s3cret-for-hs256-tokens-0123456789abcdef"  # 40 bytes: long enough for HS256
AUDIENCE = "https://api.example.test"
ISSUER = "https://issuer.example.test"
CLIENT = "198.51.100.7"
#: The tier table docs/configuration.md starts from (DISTLIMIT_TIERS)
EXAMPLE_TIERS = {
    "anonymous": "60/minute",
    "free": "300/minute",
    "pro": "1800/minute",
    "internal": "10000/minute",
}


def make_app(**config: object) -> flask.Flask:
    app = flask.Flask(__name__)
    app.config.update(config)
    return app


def make_resolver(app: flask.Flask) -> IdentityResolver:
    return IdentityResolver(IdentitySettings.from_config(app.config))


def identify(
    app: flask.Flask,
    resolver: IdentityResolver,
    hooks: IdentityHooks | None = None,
    headers: dict[str, str] | None = None,
    remote_addr: str | None = CLIENT,
) -> Identity:
    base = {"REMOTE_ADDR": remote_addr} if remote_addr is not None else {}
    with app.test_request_context("/", headers=headers or {}, environ_base=base) as ctx:
        if remote_addr is None:
            ctx.request.environ.pop("REMOTE_ADDR", None)
        return resolver.identify(ctx.request, hooks or IdentityHooks())


def token(claims: dict[str, Any] | None = None, key: Any = SECRET, alg: str = "HS256") -> str:
    now = int(time.time())
    payload: dict[str, Any] = {"sub": "alice", "aud": AUDIENCE, "exp": now + 600, "iat": now}
    payload.update(claims or {})
    payload = {k: v for k, v in payload.items() if v is not None}
    return jwt.encode(payload, key, algorithm=alg)


def jwt_app(**config: object) -> flask.Flask:
    defaults: dict[str, object] = {
        "DISTLIMIT_JWT_KEYS": SECRET,
        "DISTLIMIT_JWT_ALGORITHMS": ["HS256"],
        "DISTLIMIT_JWT_AUDIENCE": AUDIENCE,
    }
    defaults.update(config)
    return make_app(**defaults)


@pytest.fixture(scope="module")
def rsa_pair() -> tuple[Any, str]:
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public_pem = (
        private.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )
    return private, public_pem


# -- a tiny quota app: proves "no fresh quota" end to end through the Flask test client -------


def quota_app(
    hooks: IdentityHooks, quota: int = 3, **config: object
) -> tuple[flask.Flask, Counter[str]]:
    """Each identity may make ``quota`` requests; the next get 429."""
    app = make_app(**config)
    resolver = make_resolver(app)
    resolver.check_hooks(hooks)
    seen: Counter[str] = Counter()

    @app.get("/")
    def index() -> tuple[str, int]:
        identity = resolver.identify(flask.request, hooks)
        seen[identity.value] += 1
        return identity.value, 200 if seen[identity.value] <= quota else 429

    return app, seen


def statuses(app: flask.Flask, requests: Iterator[dict[str, str]], addr: str = CLIENT) -> list[int]:
    client = app.test_client()
    return [
        client.get("/", headers=h, environ_base={"REMOTE_ADDR": addr}).status_code for h in requests
    ]


# -- settings -------------------------------------------------------------------------------


def test_defaults_are_set_in_config_and_parsed() -> None:
    app = make_app()
    settings_ = IdentitySettings.from_config(app.config)
    assert app.config["DISTLIMIT_TIERS"] == {}  # no tier limits unless the app sets them
    assert app.config["DISTLIMIT_TRUSTED_PROXIES"] == 0
    assert app.config["DISTLIMIT_IPV6_PREFIX"] == 64
    assert app.config["DISTLIMIT_API_KEY_HEADER"] == "X-Api-Key"
    assert dict(settings_.tiers) == {}
    assert settings_.jwt is None and settings_.api_key_secret is None


def test_the_example_tier_table_parses() -> None:
    app = make_app(DISTLIMIT_TIERS=dict(EXAMPLE_TIERS))
    settings_ = IdentitySettings.from_config(app.config)
    assert set(settings_.tiers) == {"anonymous", "free", "pro", "internal"}
    assert settings_.tiers["pro"][0].amount == 1800
    assert settings_.tiers["pro"][0].period == 60


def test_without_a_tier_table_a_hook_tier_only_names_the_plan(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = make_app()
    resolver = make_resolver(app)
    hooks = IdentityHooks(tier_resolver=lambda identity: "platinum")
    with caplog.at_level(logging.WARNING, "flask_distlimit.identity"):
        assert identify(app, resolver, hooks).tier == "platinum"
    assert not caplog.records  # nothing to warn about: no tier limits are configured
    assert "secret" not in repr(IdentitySettings.from_config(make_app(SECRET_KEY="x").config))


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"DISTLIMIT_TIERS": {"free": "10/minute"}}, ["'anonymous'", "DISTLIMIT_TIERS"]),
        ({"DISTLIMIT_TIERS": {"anonymous": "ten a minute"}}, ["anonymous", "ten a minute"]),
        ({"DISTLIMIT_TIERS": {"anonymous": "1/minute", "a b": "1/s"}}, ["'a b'"]),
        ({"DISTLIMIT_TIERS": "60/minute"}, ["DISTLIMIT_TIERS", "dict"]),
        ({"DISTLIMIT_TRUSTED_PROXIES": -1}, ["DISTLIMIT_TRUSTED_PROXIES", "-1"]),
        ({"DISTLIMIT_TRUSTED_PROXIES": "1"}, ["DISTLIMIT_TRUSTED_PROXIES", "'1'"]),
        ({"DISTLIMIT_TRUSTED_PROXIES": True}, ["DISTLIMIT_TRUSTED_PROXIES"]),
        ({"DISTLIMIT_IPV6_PREFIX": 0}, ["DISTLIMIT_IPV6_PREFIX", "1 to 128"]),
        ({"DISTLIMIT_IPV6_PREFIX": 129}, ["DISTLIMIT_IPV6_PREFIX", "129"]),
        ({"DISTLIMIT_API_KEY_HEADER": "X Api Key"}, ["DISTLIMIT_API_KEY_HEADER"]),
        ({"DISTLIMIT_API_KEY_SECRET": 12345}, ["DISTLIMIT_API_KEY_SECRET", "int"]),
        ({"DISTLIMIT_JWT_KEYS": SECRET}, ["DISTLIMIT_JWT_ALGORITHMS"]),
        (
            {"DISTLIMIT_JWT_KEYS": SECRET, "DISTLIMIT_JWT_ALGORITHMS": ["none"]},
            ["DISTLIMIT_JWT_ALGORITHMS", "'none' is never accepted"],
        ),
        (
            {"DISTLIMIT_JWT_KEYS": SECRET, "DISTLIMIT_JWT_ALGORITHMS": "HS256"},
            ["DISTLIMIT_JWT_AUDIENCE"],
        ),
        (
            {
                "DISTLIMIT_JWT_KEYS": "short",
                "DISTLIMIT_JWT_ALGORITHMS": "HS256",
                "DISTLIMIT_JWT_AUDIENCE": AUDIENCE,
            },
            ["DISTLIMIT_JWT_KEYS[0]", "too weak"],
        ),
        (
            {
                "DISTLIMIT_JWT_KEYS": [SECRET, 42],
                "DISTLIMIT_JWT_ALGORITHMS": "HS256",
                "DISTLIMIT_JWT_AUDIENCE": AUDIENCE,
            },
            ["DISTLIMIT_JWT_KEYS[1]"],
        ),
        (
            {
                "DISTLIMIT_JWT_KEYS": SECRET,
                "DISTLIMIT_JWT_ALGORITHMS": "RS256",
                "DISTLIMIT_JWT_AUDIENCE": AUDIENCE,
            },
            ["cannot verify", "HS256"],
        ),
        (
            {
                "DISTLIMIT_JWT_KEYS": SECRET,
                "DISTLIMIT_JWT_ALGORITHMS": "HS256",
                "DISTLIMIT_JWT_AUDIENCE": AUDIENCE,
                "DISTLIMIT_JWT_LEEWAY": 3600,
            },
            ["DISTLIMIT_JWT_LEEWAY"],
        ),
    ],
)
def test_bad_config_raises_configuration_error(config: dict[str, object], words: list[str]) -> None:
    with pytest.raises(ConfigurationError) as info:
        IdentitySettings.from_config(make_app(**config).config)
    for word in words:
        assert word in str(info.value)


def test_private_key_is_refused(rsa_pair: tuple[Any, str]) -> None:
    private, _ = rsa_pair
    pem = private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    app = jwt_app(DISTLIMIT_JWT_KEYS=pem, DISTLIMIT_JWT_ALGORITHMS=["RS256"])
    with pytest.raises(ConfigurationError, match="PUBLIC key"):
        IdentitySettings.from_config(app.config)


def test_jwt_keys_without_pyjwt_say_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "jwt", None)
    monkeypatch.setitem(sys.modules, "jwt.algorithms", None)
    with pytest.raises(ConfigurationError, match=r"pip install 'pyjwt>=2.8'"):
        IdentitySettings.from_config(jwt_app().config)
    # Without JWT keys, PyJWT is never imported.
    assert IdentitySettings.from_config(make_app().config).jwt is None


@pytest.mark.parametrize("keys", [None, [], ""])
def test_jwt_settings_without_keys_warn_that_no_token_is_read(
    keys: object, caplog: pytest.LogCaptureFixture
) -> None:
    """``DISTLIMIT_JWT_KEYS = os.environ.get("JWT_PUBKEY")`` on a host without that variable:
    the JWT path is off, and the start-up log says so (the other settings are not checked)."""
    app = make_app(DISTLIMIT_JWT_KEYS=keys, DISTLIMIT_JWT_AUDIENCE="https://api.example.com")
    with caplog.at_level(logging.WARNING, logger="flask_distlimit"):
        assert IdentitySettings.from_config(app.config).jwt is None
    assert "DISTLIMIT_JWT_KEYS is empty, so no token is read" in caplog.text, caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flask_distlimit"):
        IdentitySettings.from_config(make_app().config)  # no JWT setting at all: no word
    assert "no token is read" not in caplog.text


# -- client IP ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("remote_addr", "expected"),
    [
        ("203.0.113.9", "ip:203.0.113.9"),
        ("2001:db8:1:2:aaaa:bbbb:cccc:dddd", "ip:2001:db8:1:2::/64"),
        ("2001:DB8:1:2::1", "ip:2001:db8:1:2::/64"),
        ("[2001:db8:1:2::1]:443", "ip:2001:db8:1:2::/64"),
        ("fe80::1%eth0", "ip:fe80::/64"),
        ("::ffff:203.0.113.9", "ip:203.0.113.9"),
        ("64:ff9b::cb00:7109", "ip:203.0.113.9"),  # NAT64 (RFC 6052): each IPv4 client its own
        ("64:ff9b:1::cb00:7109", "ip:64:ff9b:1::/64"),  # a local prefix: an IPv6 network
        ("203.0.113.9:5555", "ip:203.0.113.9"),
        (" \t203.0.113.9 ", "ip:203.0.113.9"),  # spaces and tabs around it, as docs/identity.md
        ("203.0.113.9\n", INVALID_IP),  # any other whitespace is no part of an address
        ("\x0b203.0.113.9", INVALID_IP),
        ("203.0.113.9:65535", "ip:203.0.113.9"),
        ("203.0.113.9:65536", INVALID_IP),  # no port
        ("[2001:db8::1]:99999", INVALID_IP),
        ("not an address", INVALID_IP),
        ("", INVALID_IP),
        ("203.0.113.9:http", INVALID_IP),
        ("[::1", INVALID_IP),
        ("1.2.3.4%eth0", INVALID_IP),
        ("x" * 10_000, INVALID_IP),
    ],
)
def test_client_ip_forms(remote_addr: str, expected: str) -> None:
    resolver = make_resolver(make_app())
    assert resolver.client_ip({"REMOTE_ADDR": remote_addr}) == expected


def test_missing_remote_addr_is_the_invalid_bucket_not_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = make_app()
    resolver = make_resolver(app)
    with caplog.at_level(logging.WARNING, "flask_distlimit.identity"):
        assert identify(app, resolver, remote_addr=None) == Identity("ip", INVALID_IP, ANONYMOUS)
        assert resolver.client_ip({"REMOTE_ADDR": None}) == INVALID_IP
    assert len([r for r in caplog.records if "DISTLIMIT_TRUSTED_PROXIES" in r.message]) == 1


def test_ipv6_host_rotating_through_its_64_shares_one_identity() -> None:
    app = make_app()
    resolver = make_resolver(app)
    ids = {
        identify(app, resolver, remote_addr=f"2001:db8:aa:bb:{i:x}:{i * 7:x}::{i:x}").value
        for i in range(1, 200)
    }
    assert ids == {"ip:2001:db8:aa:bb::/64"}
    other = identify(app, resolver, remote_addr="2001:db8:aa:bc::1").value
    assert other == "ip:2001:db8:aa:bc::/64"


@pytest.mark.parametrize(
    ("prefix", "expected"),
    [(48, "ip:2001:db8:aa::/48"), (128, "ip:2001:db8:aa:bb::1/128"), (1, "ip:::/1")],
)
def test_ipv6_prefix_is_configurable(prefix: int, expected: str) -> None:
    resolver = make_resolver(make_app(DISTLIMIT_IPV6_PREFIX=prefix))
    assert resolver.client_ip({"REMOTE_ADDR": "2001:db8:aa:bb::1"}) == expected


def test_a_zone_never_parts_one_ipv6_client_even_at_prefix_128() -> None:
    resolver = make_resolver(make_app(DISTLIMIT_IPV6_PREFIX=128))
    zoned = {resolver.client_ip({"REMOTE_ADDR": f"fe80::1%{zone}"}) for zone in ("eth0", "eth1")}
    assert zoned == {"ip:fe80::1/128"}


def test_forged_x_forwarded_for_from_an_untrusted_client_gets_no_fresh_quota() -> None:
    app, seen = quota_app(IdentityHooks(), quota=3)
    forged = ({"X-Forwarded-For": f"10.0.{i}.1, 192.0.2.{i}"} for i in range(20))
    codes = statuses(app, forged)
    assert codes == [200] * 3 + [429] * 17
    assert list(seen) == [f"ip:{CLIENT}"]


def test_behind_one_proxy_only_the_hop_it_appended_counts() -> None:
    proxy = "10.0.0.2"
    app, seen = quota_app(IdentityHooks(), quota=3, DISTLIMIT_TRUSTED_PROXIES=1)
    # The client forges the left part; the trusted proxy appends the real client address.
    forged = ({"X-Forwarded-For": f"192.0.2.{i}, 7.7.{i}.7, {CLIENT}"} for i in range(10))
    assert statuses(app, forged, addr=proxy) == [200] * 3 + [429] * 7
    assert list(seen) == [f"ip:{CLIENT}"]


# The rule: X-Forwarded-For split on commas, exactly as the proxies wrote it; the client is the
# entry N hops from the right; where that is no address, the nearest trusted hop's, marked.

_IPS = st.one_of(
    st.ip_addresses().map(str),
    st.ip_addresses(v=6).map(lambda a: f"[{a}]:8080"),
    st.ip_addresses(v=4).map(lambda a: f"{a}:1234"),
)
_ADDRESSES = st.one_of(
    _IPS,
    st.sampled_from(["", " ", "unknown", "_hidden", '"1.2.3.4"', '"a,b"', "::ffff:1.2.3.4", '"']),
    st.text(max_size=12),
)
_XFF = st.one_of(
    st.none(),
    st.lists(_ADDRESSES, max_size=5).map(", ".join),
    st.lists(_ADDRESSES, max_size=5).map(",".join),
    st.text(alphabet=' ,"\\1.:abf[]', max_size=30),
)
_DIRECT = make_resolver(make_app(DISTLIMIT_TRUSTED_PROXIES=0))


def _address(text: object) -> str:
    return _DIRECT.client_ip({"REMOTE_ADDR": text} if text is not None else {})


def _the_rule(hops: int, remote: str | None, xff: str | None) -> str:
    if not hops or xff is None:
        return _address(remote)
    entries = [entry.strip(" \t") for entry in xff.split(",")]
    if len(entries) >= hops and _address(entries[-hops]) != INVALID_IP:
        return _address(entries[-hops])
    trusted = entries[len(entries) - hops + 1 :] if len(entries) >= hops else entries
    for hop in [*trusted, remote]:
        if hop is not None and _address(hop) != INVALID_IP:
            return "ip:invalid-via:" + _address(hop).removeprefix("ip:")
    return INVALID_IP


def _proxyfix_remote_addr(environ: dict[str, Any], hops: int) -> str | None:
    captured: dict[str, Any] = {}

    def app(env: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        captured.update(env)
        return []

    ProxyFix(app, x_for=hops)(dict(environ), lambda *a: None)  # type: ignore[arg-type]
    return captured.get("REMOTE_ADDR")


@pytest.mark.slow
@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(hops=st.integers(0, 4), remote=st.one_of(st.none(), _ADDRESSES), xff=_XFF)
def test_forwarded_for_follows_the_rule(hops: int, remote: str | None, xff: str | None) -> None:
    environ: dict[str, Any] = {}
    if remote is not None:
        environ["REMOTE_ADDR"] = remote
    if xff is not None:
        environ["HTTP_X_FORWARDED_FOR"] = xff
    ours = make_resolver(make_app(DISTLIMIT_TRUSTED_PROXIES=hops)).client_ip(environ)
    assert ours == _the_rule(hops, remote, xff)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(
    hops=st.integers(0, 4),
    remote=_IPS,
    entries=st.lists(_IPS, min_size=4, max_size=6),
    sep=st.sampled_from([",", ", ", " , "]),
)
@pytest.mark.slow
def test_addresses_only_pick_the_client_proxyfix_picks(
    hops: int, remote: str, entries: list[str], sep: str
) -> None:
    """Where every entry is an address (and there are enough), ProxyFix(x_for=N) agrees."""
    environ = {"REMOTE_ADDR": remote, "HTTP_X_FORWARDED_FOR": sep.join(entries)}
    ours = make_resolver(make_app(DISTLIMIT_TRUSTED_PROXIES=hops)).client_ip(environ)
    assert ours == _address(_proxyfix_remote_addr(environ, hops))


def test_proxyfix_parity_on_a_real_request() -> None:
    for hops in range(4):
        app = make_app(DISTLIMIT_TRUSTED_PROXIES=hops)
        resolver = make_resolver(app)
        builder = EnvironBuilder(
            headers=[("X-Forwarded-For", "1.1.1.1, 2.2.2.2, 2001:db8::5")],
            environ_base={"REMOTE_ADDR": "10.0.0.1"},
        )
        environ = builder.get_environ()
        expected = {
            0: "ip:10.0.0.1",
            1: "ip:2001:db8::/64",
            2: "ip:2.2.2.2",
            3: "ip:1.1.1.1",
        }[hops]
        assert resolver.client_ip(environ) == expected
        assert _proxyfix_remote_addr(environ, hops) == expected.removeprefix("ip:").replace(
            "2001:db8::/64", "2001:db8::5"
        )


# -- JWT ------------------------------------------------------------------------------------


def test_verified_jwt_is_an_identity_with_its_tier() -> None:
    app = jwt_app()
    resolver = make_resolver(app)
    bearer = {"Authorization": f"Bearer {token({'tier': 'pro'})}"}
    assert identify(app, resolver, headers=bearer) == Identity("jwt", "jwt:sub:alice", "pro")
    no_tier = {"Authorization": f"bearer {token()}"}
    assert identify(app, resolver, headers=no_tier) == Identity("jwt", "jwt:sub:alice", ANONYMOUS)
    client = {"Authorization": f"Bearer {token({'sub': None, 'client_id': 'svc-1'})}"}
    assert identify(app, resolver, headers=client).value == "jwt:client_id:svc-1"


def test_jwt_issuer_leeway_and_claim_names_are_configurable() -> None:
    app = jwt_app(
        DISTLIMIT_JWT_ISSUER=ISSUER,
        DISTLIMIT_JWT_LEEWAY=120,
        DISTLIMIT_JWT_SUBJECT_CLAIM="uid",
        DISTLIMIT_JWT_TIER_CLAIM="plan",
    )
    resolver = make_resolver(app)
    good = token({"iss": ISSUER, "uid": "u7", "plan": "free", "exp": int(time.time()) - 60})
    assert identify(app, resolver, headers={"Authorization": f"Bearer {good}"}) == Identity(
        "jwt", "jwt:sub:u7", "free"
    )
    for claims in ({"iss": "https://evil.test", "uid": "u7"}, {"uid": "u7"}):
        bad = token(claims)
        got = identify(app, resolver, headers={"Authorization": f"Bearer {bad}"})
        assert got.kind == "ip"


def _bad_tokens(public_pem: str) -> dict[str, str]:
    now = int(time.time())
    header, payload, _ = token().split(".")
    attacker = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return {
        "other secret": token(key="an-attackers-own-secret-of-plenty-bytes!!"),
        "expired": token({"exp": now - 3600}),
        "no exp": token({"exp": None}),
        "wrong audience": token({"aud": "https://other.example.test"}),
        "no audience": token({"aud": None}),
        "not yet valid": token({"nbf": now + 3600}),
        "alg none": jwt.encode(
            {"sub": "mallory", "aud": AUDIENCE, "exp": now + 600},
            None,  # type: ignore[arg-type]
            algorithm="none",
        ),
        "alg none, sig kept": ".".join(
            [jwt.utils.base64url_encode(b'{"alg":"none","typ":"JWT"}').decode(), payload, "x"]
        ),
        "stripped signature": f"{header}.{payload}.",
        "tampered payload": ".".join(
            [
                header,
                jwt.utils.base64url_encode(
                    b'{"sub":"mallory","aud":"' + AUDIENCE.encode() + b'","exp":9999999999}'
                ).decode(),
                token().split(".")[2],
            ]
        ),
        "RS256 by attacker": token(key=attacker, alg="RS256"),
        "HS256 keyed with the public key": _hs256_with(public_pem),
        "garbage": "not.a.token",
        "empty segments": "..",
        "huge": "a" * 20_000,
        "binary": "\x00\xff\u2603.e30.e30",
        "not json": "e30.bm90IGpzb24.e30",
    }


def _hs256_with(public_pem: str) -> str:
    # The classic algorithm-confusion forgery: sign HS256 using the verifier's RSA public key.
    import hashlib
    import hmac

    now = int(time.time())
    header = jwt.utils.base64url_encode(b'{"alg":"HS256","typ":"JWT"}')
    body = jwt.utils.base64url_encode(
        f'{{"sub":"mallory","aud":"{AUDIENCE}","exp":{now + 600}}}'.encode()
    )
    signing_input = header + b"." + body
    sig = hmac.new(public_pem.encode(), signing_input, hashlib.sha256).digest()
    return (signing_input + b"." + jwt.utils.base64url_encode(sig)).decode()


@pytest.mark.slow
def test_forged_or_invalid_jwts_are_never_an_identity(rsa_pair: tuple[Any, str]) -> None:
    private, public_pem = rsa_pair
    app = jwt_app(
        DISTLIMIT_JWT_KEYS=[SECRET, public_pem], DISTLIMIT_JWT_ALGORITHMS=["HS256", "RS256"]
    )
    resolver = make_resolver(app)
    good_rs = token({"sub": "bob"}, key=private, alg="RS256")
    assert identify(app, resolver, headers={"Authorization": f"Bearer {good_rs}"}).value == (
        "jwt:sub:bob"
    )
    anonymous = Identity("ip", f"ip:{CLIENT}", ANONYMOUS)
    for name, bad in _bad_tokens(public_pem).items():
        for value in (f"Bearer {bad}", f"Basic {bad}", bad):
            got = identify(app, resolver, headers={"Authorization": value})
            assert got == anonymous, name


def test_forged_jwts_fall_through_to_a_verified_api_key() -> None:
    app = jwt_app(DISTLIMIT_API_KEY_SECRET="k" * 32)
    resolver = make_resolver(app)
    hooks = IdentityHooks(api_key_verifier={"good-key": "free"}.get)
    headers = {"Authorization": f"Bearer {token({'exp': 1})}", "X-Api-Key": "good-key"}
    got = identify(app, resolver, hooks, headers=headers)
    assert got.kind == "api_key" and got.tier == "free"


def test_forged_jwts_get_no_fresh_quota_end_to_end(rsa_pair: tuple[Any, str]) -> None:
    _, public_pem = rsa_pair
    hooks = IdentityHooks()
    app, seen = quota_app(
        hooks,
        quota=3,
        DISTLIMIT_JWT_KEYS=SECRET,
        DISTLIMIT_JWT_ALGORITHMS="HS256",
        DISTLIMIT_JWT_AUDIENCE=AUDIENCE,
    )
    bad = list(_bad_tokens(public_pem).values())
    codes = statuses(app, ({"Authorization": f"Bearer {t}"} for t in bad))
    assert codes == [200] * 3 + [429] * (len(bad) - 3)
    assert list(seen) == [f"ip:{CLIENT}"]


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200) | st.binary(max_size=200).map(lambda b: b.decode("latin-1")))
def test_garbage_authorization_never_raises(value: str) -> None:
    resolver = _FUZZ_RESOLVER
    environ = {"REMOTE_ADDR": CLIENT, "HTTP_AUTHORIZATION": "Bearer " + value}
    request = flask.Request(environ)
    assert resolver.identify(request, IdentityHooks()).kind == "ip"


_FUZZ_RESOLVER = make_resolver(jwt_app())


# -- API keys -------------------------------------------------------------------------------


def test_verified_api_key_is_an_hmac_digest_never_the_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    raw = "sk_live_0123456789SECRETVALUE"
    app = make_app(
        SECRET_KEY="app-secret-key-for-tests-0123456789", DISTLIMIT_TIERS=dict(EXAMPLE_TIERS)
    )
    resolver = make_resolver(app)
    hooks = IdentityHooks(api_key_verifier={raw: "mystery-tier"}.get)
    with caplog.at_level(logging.DEBUG):
        first = identify(app, resolver, hooks, headers={"X-Api-Key": raw})
        again = identify(app, resolver, hooks, headers={"X-Api-Key": raw})
    assert first == again
    assert first.kind == "api_key"
    assert first.value.startswith("apikey:") and len(first.value) == len("apikey:") + 64
    assert raw not in first.value and raw not in repr(first)
    # A tier the table does not know: anonymous, warned about once.
    assert first.tier == ANONYMOUS
    warnings = [r for r in caplog.records if "mystery-tier" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert all(raw not in r.getMessage() for r in caplog.records)
    # DISTLIMIT_API_KEY_SECRET wins over SECRET_KEY: another digest.
    other = make_resolver(make_app(SECRET_KEY="app-secret", DISTLIMIT_API_KEY_SECRET="k" * 32))
    assert other.api_key_identity(raw) != first.value
    assert resolver.api_key_identity(raw) == first.value


def test_a_verifier_may_answer_the_keys_canonical_id() -> None:
    app = make_app(SECRET_KEY="s" * 32, DISTLIMIT_TIERS=dict(EXAMPLE_TIERS))
    resolver = make_resolver(app)
    keys = {"ABC-123": ("key-7", "pro"), "abc-123": ("key-7", "pro"), "xyz": (8, None)}
    hooks = IdentityHooks(api_key_verifier=keys.get)
    upper = identify(app, resolver, hooks, headers={"X-Api-Key": "ABC-123"})
    lower = identify(app, resolver, hooks, headers={"X-Api-Key": "abc-123"})
    assert upper == lower == Identity("api_key", resolver.api_key_identity("key-7"), "pro")
    numbered = identify(app, resolver, hooks, headers={"X-Api-Key": "xyz"})
    assert numbered == Identity("api_key", resolver.api_key_identity("8"), ANONYMOUS)
    assert "key-7" not in upper.value and "ABC" not in upper.value


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (("", "pro"), "empty"),
        ((None, "pro"), "NoneType"),
        ((True, "pro"), "bool"),
        (("id", "pro", "extra"), "tuple"),
        (42, "int"),
        (["id", "pro"], "list"),
    ],
)
def test_a_verifier_answering_nonsense_is_told_the_forms(answer: object, says: str) -> None:
    raw = "sk_live_never_in_messages"
    app = make_app(SECRET_KEY="s" * 32)
    resolver = make_resolver(app)
    hooks = IdentityHooks(api_key_verifier=lambda key: answer)  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match="canonical id") as info:
        identify(app, resolver, hooks, headers={"X-Api-Key": raw})
    assert says in str(info.value) and raw not in str(info.value)


def test_random_api_keys_get_no_fresh_quota() -> None:
    calls: list[int] = []

    def verifier(key: str) -> str | None:
        calls.append(len(key))
        return "pro" if key == "the-one-real-key" else None

    hooks = IdentityHooks(api_key_verifier=verifier)
    app, seen = quota_app(hooks, quota=3, DISTLIMIT_API_KEY_SECRET="k" * 32)
    randoms = [f"random-{i}" for i in range(10)] + ["x" * 1025, "y" * 100_000]
    codes = statuses(app, ({"X-Api-Key": k} for k in randoms))
    assert codes == [200] * 3 + [429] * (len(randoms) - 3)
    assert list(seen) == [f"ip:{CLIENT}"]
    assert max(calls) <= 1024  # over-long keys never reach the verifier
    assert statuses(app, iter([{"X-Api-Key": "the-one-real-key"}])) == [200]


def test_api_key_header_is_configurable() -> None:
    app = make_app(DISTLIMIT_API_KEY_HEADER="X-Client-Token", SECRET_KEY="s" * 32)
    resolver = make_resolver(app)
    hooks = IdentityHooks(api_key_verifier=lambda key: "pro")
    assert identify(app, resolver, hooks, headers={"X-Api-Key": "k"}).kind == "ip"
    assert identify(app, resolver, hooks, headers={"X-Client-Token": "k"}).tier == "pro"
    hooks.api_key_verifier = lambda key: ""  # "no tier" for unknown keys: unknown, never a quota
    assert identify(app, resolver, hooks, headers={"X-Client-Token": "invented"}).kind == "ip"


def test_a_verifier_without_any_secret_is_a_configuration_error() -> None:
    raw = "sk_live_do_not_leak_me"
    app = make_app()
    resolver = make_resolver(app)
    hooks = IdentityHooks()
    resolver.check_hooks(hooks)  # no verifier: fine
    hooks.api_key_verifier = lambda key: "pro"  # set after init_app
    with pytest.raises(ConfigurationError, match="DISTLIMIT_API_KEY_SECRET") as at_init:
        resolver.check_hooks(hooks)
    with pytest.raises(ConfigurationError, match="SECRET_KEY") as per_request:
        identify(app, resolver, hooks, headers={"X-Api-Key": raw})
    assert raw not in str(at_init.value) and raw not in str(per_request.value)


# -- user hook and tiers --------------------------------------------------------------------


def test_identity_loader_comes_first() -> None:
    app = jwt_app(DISTLIMIT_API_KEY_SECRET="k" * 32)
    resolver = make_resolver(app)
    hooks = IdentityHooks(
        identity_loader=lambda: ("42", "internal"), api_key_verifier=lambda key: "pro"
    )
    headers = {"Authorization": f"Bearer {token()}", "X-Api-Key": "k"}
    assert identify(app, resolver, hooks, headers=headers) == Identity(
        "user", "user:42", "internal"
    )
    hooks.identity_loader = lambda: None  # anonymous user: fall through to the JWT
    assert identify(app, resolver, hooks, headers=headers).kind == "jwt"
    hooks.identity_loader = lambda: (7, None)  # type: ignore[assignment]
    assert identify(app, resolver, hooks) == Identity("user", "user:7", ANONYMOUS)
    hooks.identity_loader = lambda: (None, "pro")  # type: ignore[assignment]  # get_id(): None
    assert identify(app, resolver, hooks, headers=headers).kind == "jwt"  # no user: as None
    for wrong in (object(), "12", "123"):  # "12": never a user "1" of the tier "2"
        hooks.identity_loader = lambda wrong=wrong: wrong  # type: ignore[misc]
        with pytest.raises(TypeError, match="identity loader must return"):
            identify(app, resolver, hooks)


def test_tier_resolver_overrides_and_unknown_answers_are_anonymous(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = make_app(DISTLIMIT_TIERS=dict(EXAMPLE_TIERS))
    resolver = make_resolver(app)
    hooks = IdentityHooks(tier_resolver=lambda identity: "pro")
    assert identify(app, resolver, hooks) == Identity("ip", f"ip:{CLIENT}", "pro")
    hooks.tier_resolver = lambda identity: "platinum"
    with caplog.at_level(logging.WARNING, "flask_distlimit.identity"):
        for _ in range(5):
            assert identify(app, resolver, hooks).tier == ANONYMOUS
    assert len([r for r in caplog.records if "platinum" in r.getMessage()]) == 1


def test_custom_tier_table() -> None:
    app = make_app(DISTLIMIT_TIERS={"anonymous": "5/minute", "gold": "10/second;1000/hour"})
    settings_ = IdentitySettings.from_config(app.config)
    assert [str(r) for r in settings_.tiers["gold"]] == ["10/second", "1000/hour"]
    resolver = IdentityResolver(settings_)
    hooks = IdentityHooks(identity_loader=lambda: ("1", "pro"))  # "pro" is not in this table
    assert identify(app, resolver, hooks).tier == ANONYMOUS


# -- keys -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        "user:{42}",
        "user:}{",
        "user:a b c",
        "user:line\nbreak\r\n",
        "jwt:sub:" + "x" * 10_240,
        "user:\u2603{\ud800}",
        "ip:invalid",
    ],
)
def test_keys_of_any_identity_stay_in_one_cluster_slot(value: str) -> None:
    identity = Identity("user", value, ANONYMOUS)
    limits: list[tuple[str, Algorithm]] = [
        ("global", "fixed_window"),
        ("tier:anonymous", "sliding_window_counter"),
        ("route:/orders {x}", "token_bucket"),
        ("shared:reports\n", "gcra"),
    ]
    tags = IdentityTags(tag_secret(b"test-secret"))
    keys = [limit_key("ratelimit", identity.value, lid, a, tags) for lid, a in limits]
    slots = {key_slot(key.encode("utf-8", "surrogatepass")) for key in keys}
    assert len(slots) == 1
    assert all(len(key) < 300 and "\n" not in key and " " not in key for key in keys)


# -- cost -----------------------------------------------------------------------------------


class _TrapConfig(flask.Config):
    def __getitem__(self, key: str) -> Any:
        raise AssertionError(f"identify() read app.config[{key!r}]")

    def get(self, key: str, default: Any = None) -> Any:
        raise AssertionError(f"identify() read app.config.get({key!r})")


def test_identify_reads_no_config_and_compiles_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    app = jwt_app(DISTLIMIT_API_KEY_SECRET="k" * 32, DISTLIMIT_TRUSTED_PROXIES=1)
    resolver = make_resolver(app)
    hooks = IdentityHooks(api_key_verifier=lambda key: None)
    headers = {
        "Authorization": f"Bearer {token({'tier': 'pro'})}",
        "X-Api-Key": "unknown",
        "X-Forwarded-For": "2001:db8::1",
    }
    with app.test_request_context("/", headers=headers, environ_base={"REMOTE_ADDR": CLIENT}):
        app.config = _TrapConfig(app.root_path, app.config)

        def no_compile(*args: object, **kwargs: object) -> None:
            raise AssertionError("identify() compiled a regular expression")

        monkeypatch.setattr("re.compile", no_compile)
        assert resolver.identify(flask.request, hooks).kind == "jwt"
        flask.request.environ["HTTP_AUTHORIZATION"] = "Bearer forged"
        assert resolver.identify(flask.request, hooks) == Identity(
            "ip", "ip:2001:db8::/64", ANONYMOUS
        )
