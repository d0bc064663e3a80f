"""Fuzz (issue 10): whatever a client puts in ``X-Forwarded-For``, ``Forwarded``,
``Authorization`` and the API-key header, and whatever a ``key_func`` returns, through a Flask
app's test client on a real redis-server:

- no response is a 5xx;
- every key is under the prefix, in the key format, with a TTL: ``fuzz:{<20 hex>}:<limit
  id>:<algorithm>``, so every key of one limit has the same length (the identity part is fixed:
  20 hex characters; the whole key is bounded by the prefix and the limit id, not by any input);
- two requests (or two limits of one request) land in the same bucket exactly when they name the
  same client. Who the client is comes from how the test built the request, not from the code
  under test: a valid token's subject, else a known API key's id (in any letter case), else the
  address the trusted proxy appended (several spellings of one address, and of one IPv6 /64,
  name one client), else the proxy that handed on a header without an address; a ``key_func``
  value is a client of its own kind, whatever it spells (an empty one: the request's own
  identity).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

import jwt
import pytest
import redis
from flask import Flask, request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flask_distlimit import Limiter
from flask_distlimit.storage.redis import RedisStorage
from flask_distlimit.testing import CountingStorage, FakeClock
from tests.servers import RedisProcess

PREFIX = "fuzz"
PROXY = "10.0.0.2"  # REMOTE_ADDR: the one trusted proxy
JWT_SECRET = "fuzz-hs256-secret-0123456789abcdefghij"
AUDIENCE = "https://fuzz.example.test"
API_KEYS = {"0123456789abcdef0123456789abcdef": "key-1", "fedcba9876543210fedcba9876543210": 2}
KEY_FORMAT = re.compile(
    r"fuzz:\{([0-9a-f]{20})\}:(g_1000/60|r_fuzz_1000/60|r_fuzz_999/60):fixed_window"
)
TOKEN_FORMAT = re.compile(r"fuzz:rq:\{[0-9a-f]{20}\}:[0-9a-f]{12}\.[0-9]+\.[0-9]+")

#: What the proxy appended to X-Forwarded-For, and the client it names.
APPENDED: list[tuple[str, str]] = [
    ("198.51.100.7", "ip A"),
    ("198.51.100.7:5555", "ip A"),
    ("::ffff:198.51.100.7", "ip A"),
    ("203.0.113.9", "ip B"),
    ("2001:db8:1:2::1", "ip C"),
    ("[2001:db8:1:2:ffff::9]:443", "ip C"),  # the same /64
    ("2001:db8:1:3::1", "ip D"),
    ("unknown", "no address, via the proxy"),
    ("", "no address, via the proxy"),
    ('"198.51.100.7"', "no address, via the proxy"),
]

# Header values a client can send: any latin-1 text but CR and LF (werkzeug refuses those).
_header_text = st.text(
    alphabet=st.characters(codec="latin-1", exclude_characters="\r\n"), max_size=60
)
#: Client parts that once moved or swallowed the proxies' entries, or named another client.
_FORGED = ['9.9.9.9, "', '"', "9.9.9.9", '\\"', "203.0.113.9, unknown"]
#: key_func values that spell built-in identities.
_SPELLED = ["ip:198.51.100.7", "ip:invalid-via:10.0.0.2", "jwt:sub:alice", "apikey:key-1", ""]
_subjects = st.sampled_from(["alice", "bob", "ip:198.51.100.7", "func:alice", "apikey:x"])


def _spelled(key: str, mask: int) -> str:
    return "".join(c.upper() if mask >> i & 1 else c for i, c in enumerate(key))


@dataclass(frozen=True)
class Attempt:
    headers: tuple[tuple[str, str], ...]
    key_func_value: str
    #: who the request names: for the identity-keyed limits and for the key_func limit
    client: tuple[str, str]
    ip_client: tuple[str, str]


@st.composite
def attempts(draw: st.DrawFn) -> Attempt:
    headers: list[tuple[str, str]] = []
    # X-Forwarded-For: the client's part (anything), then what the trusted proxy appended.
    if draw(st.booleans()):
        appended, ip_name = draw(st.sampled_from(APPENDED))
        client_part = draw(st.one_of(st.none(), _header_text, st.sampled_from(_FORGED)))
        xff = appended if client_part is None else f"{client_part},{appended}"
        headers.append(("X-Forwarded-For", xff))
    else:
        ip_name = "the proxy itself"  # nothing forwarded: the peer is the client
    ip_client = ("ip", ip_name)
    if draw(st.booleans()):
        headers.append(("Forwarded", draw(_header_text)))  # never read: changes nothing
    client = ip_client
    api_client: tuple[str, str] | None = None
    kind = draw(st.sampled_from(["none", "junk", "key"]))
    if kind == "junk":
        headers.append(("X-Api-Key", draw(st.one_of(_header_text, st.just("k" * 2000)))))
    elif kind == "key":
        key = draw(st.sampled_from(sorted(API_KEYS)))
        headers.append(("X-Api-Key", _spelled(key, draw(st.integers(0, 2**32 - 1)))))
        api_client = ("api key", str(API_KEYS[key]))
    auth = draw(st.sampled_from(["none", "junk", "token"]))
    if auth == "junk":
        headers.append(("Authorization", draw(st.sampled_from(["", "Bearer ", "Basic "]))
                        + draw(_header_text)))  # fmt: skip
    elif auth == "token":
        subject = draw(_subjects)
        claims = {"sub": subject, "aud": AUDIENCE, "exp": int(time.time()) + 3600}
        headers.append(("Authorization", "Bearer " + jwt.encode(claims, JWT_SECRET, "HS256")))
        client = ("jwt", subject)
    if client == ip_client and api_client is not None:
        client = api_client
    key_func_value = draw(st.one_of(st.text(max_size=40), st.sampled_from(_SPELLED)))
    return Attempt(tuple(headers), key_func_value, client, ip_client)


@pytest.fixture
def fuzz_app(redis_server: RedisProcess, redis_client: redis.Redis) -> Iterator[
    tuple[Flask, CountingStorage]
]:  # fmt: skip
    storage = RedisStorage(host="127.0.0.1", port=redis_server.port)
    counting = CountingStorage(storage)
    app = Flask("fuzz")
    app.config.update(
        DISTLIMIT_KEY_PREFIX=PREFIX,
        DISTLIMIT_TRUSTED_PROXIES=1,
        DISTLIMIT_TIERS={"anonymous": "", "pro": ""},
        DISTLIMIT_GLOBAL_LIMITS="1000/minute",
        DISTLIMIT_ALGORITHM="fixed_window",
        DISTLIMIT_API_KEY_SECRET="fuzz-api-key-secret-0123456789",
        DISTLIMIT_JWT_KEYS=JWT_SECRET,
        DISTLIMIT_JWT_ALGORITHMS=["HS256"],
        DISTLIMIT_JWT_AUDIENCE=AUDIENCE,
    )
    limiter = Limiter(clock=FakeClock(), deny_cache=False)

    @limiter.api_key_verifier
    def verify(raw: str) -> tuple[str | int, str | None] | None:
        key_id = API_KEYS.get(raw.lower())
        return (key_id, "pro") if key_id is not None else None

    @app.get("/fuzz")
    @limiter.limit("1000/minute")
    @limiter.limit("999/minute", key_func=lambda: request.environ["fuzz.key"])
    def fuzz() -> str:
        return "ok"

    limiter.init_app(app, storage=counting)
    yield app, counting
    storage.close()


@pytest.mark.redis
@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@pytest.mark.slow
@given(batch=st.lists(attempts(), min_size=1, max_size=4))
def test_no_input_errs_or_lands_in_another_clients_bucket(
    fuzz_app: tuple[Flask, CountingStorage], redis_client: redis.Redis, batch: list[Attempt]
) -> None:
    app, counting = fuzz_app
    redis_client.flushall()
    counting.checks.clear()
    client = app.test_client()
    for attempt in batch:
        response = client.get(
            "/fuzz",
            headers=list(attempt.headers),
            environ_base={"REMOTE_ADDR": PROXY, "fuzz.key": attempt.key_func_value},
        )
        assert response.status_code == 200, (attempt, response.get_data(as_text=True)[:300])
    # Every key: under the prefix, in the format, with a TTL.
    for raw_key in redis_client.scan_iter(count=1000):
        key = raw_key.decode()
        if key.startswith("fuzz:rq:"):  # a request's token: its reply, kept a second for a retry
            assert TOKEN_FORMAT.fullmatch(key), key
            assert 0 < redis_client.pttl(key) <= 1000, key
            continue
        assert KEY_FORMAT.fullmatch(key), key
        assert redis_client.pttl(key) > 0, key
    # Same bucket (tag) exactly when the same client, across requests and limits.
    named: dict[str, tuple[str, str]] = {}
    by_client: dict[tuple[str, str], str] = {}
    assert len(counting.checks) == len(batch)
    for attempt, checks in zip(batch, counting.checks, strict=True):
        # global, per identity, per key_func (skipped on an empty answer): never merged
        assert len(checks) == (3 if attempt.key_func_value else 2), checks
        for check in checks:
            found = KEY_FORMAT.fullmatch(check.key)
            assert found, check.key
            tag, limit = found.groups()
            if limit == "g_1000/60":
                who = attempt.ip_client
            elif limit == "r_fuzz_1000/60":
                who = attempt.client
            else:
                who = ("key_func", attempt.key_func_value)
            assert named.setdefault(tag, who) == who, (tag, named[tag], who)
            assert by_client.setdefault(who, tag) == tag, (who, by_client[who], tag)
