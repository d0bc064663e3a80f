"""DISTLIMIT_* settings: read once at init_app, defaults visible in app.config, bad values refused
at start-up with the key, the value and the accepted forms."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import redis
from flask import Flask

from flask_distlimit import ConfigurationError, Limiter
from flask_distlimit.config import DEFAULTS, KNOWN_KEYS, Settings
from flask_distlimit.core.limits import Rate
from flask_distlimit.identity import IdentitySettings
from tests.servers import RedisProcess

ROOT = Path(__file__).resolve().parents[2]


def _init(**config: object) -> Flask:
    app = Flask("cfg")
    app.config.update(config)
    Limiter(app)
    return app


def test_defaults_are_set_in_app_config_and_frozen() -> None:
    app = _init()
    for key, value in DEFAULTS.items():
        assert app.config[key] == value
    assert app.config["DISTLIMIT_TIERS"] == {}  # identity keys too: no tier limits by default
    settings = app.extensions["distlimit"].settings
    assert settings == Settings()
    with pytest.raises(AttributeError):
        settings.headers = "none"  # type: ignore[misc]


def test_values_are_parsed() -> None:
    settings = Settings.from_config(
        {
            "DISTLIMIT_DEFAULT_LIMITS": "10/second;1000/hour",
            "DISTLIMIT_GLOBAL_LIMITS": "50 per second",
            "DISTLIMIT_INSTANCES": "auto",
            "DISTLIMIT_REDIS_TIMEOUT": 1,
            "DISTLIMIT_FAILURE_POLICY": "local",
            "DISTLIMIT_KEY_PREFIX": "app:v2/rl",
            "DISTLIMIT_INSTANCES_MIN": 12,
        }
    )
    assert settings.instances_min == 12
    assert settings.default_limits == (Rate(10, 1), Rate(1000, 3600))
    assert settings.global_limits == (Rate(50, 1),)
    assert settings.instances == "auto"
    assert settings.redis_timeout == 1.0
    assert settings.failure_policy == "local"


def test_instances_min_reaches_the_fallback() -> None:
    app = _init(DISTLIMIT_INSTANCES="auto", DISTLIMIT_INSTANCES_MIN=4)
    guard = app.extensions["distlimit"].guard
    assert guard.instances.divisor == 4  # before any heartbeat
    assert guard.health()["instances_min"] == 4


def test_fallback_max_keys_reaches_every_fallback() -> None:
    guard = _init(DISTLIMIT_FALLBACK_MAX_KEYS=1234).extensions["distlimit"].guard
    assert guard.fallback.max_keys == 1234
    assert guard.fallbacks.of("node-2").max_keys == 1234  # a Cluster node's own, made later
    assert _init().extensions["distlimit"].guard.fallback.max_keys == 50_000


def test_config_is_read_once() -> None:
    app = Flask("once")
    limiter = Limiter(app)

    @app.get("/")
    @limiter.limit("1/minute")
    def index() -> str:
        return "ok"

    app.config["DISTLIMIT_HEADERS"] = "none"  # too late: read at init_app
    response = app.test_client().get("/")
    assert "X-RateLimit-Limit" in response.headers


@pytest.mark.parametrize(
    ("key", "value", "hint"),
    [
        ("DISTLIMIT_DEFAULT_LIMITS", "10 per fortnight", "Unknown time unit"),
        ("DISTLIMIT_DEFAULT_LIMITS", "ten/minute", "Cannot read"),
        ("DISTLIMIT_GLOBAL_LIMITS", "5/0 seconds", "period of at least 1"),
        ("DISTLIMIT_GLOBAL_LIMITS", 100, "string"),
        ("DISTLIMIT_ALGORITHM", "leaky_bucket", "sliding_window_counter"),
        ("DISTLIMIT_HEADERS", "all", "'legacy', 'ietf', 'both', 'none'"),
        ("DISTLIMIT_HEADERS", None, "'legacy'"),
        ("DISTLIMIT_KEY_PREFIX", "rl*", "glob"),
        ("DISTLIMIT_KEY_PREFIX", "rl{x}", "braces"),
        ("DISTLIMIT_KEY_PREFIX", "my prefix", "spaces"),
        ("DISTLIMIT_KEY_PREFIX", "", "1 to 64"),
        ("DISTLIMIT_KEY_PREFIX", "ratelimit\n", "spaces"),  # read from a file, say
        # from_prefixed_env() reads FLASK_DISTLIMIT_KEY_PREFIX=123 as JSON: an int
        ("DISTLIMIT_KEY_PREFIX", 123, "It is int, not a string: quote it in JSON"),
        ("DISTLIMIT_REDIS_TIMEOUT", 0, "> 0"),
        ("DISTLIMIT_REDIS_TIMEOUT", "0.1", "number"),
        ("DISTLIMIT_REDIS_TIMEOUT", float("nan"), "number"),
        ("DISTLIMIT_REQUEST_TOKENS", "never", "'auto', 'always'"),
        ("DISTLIMIT_REQUEST_TOKENS", True, "'auto', 'always'"),
        ("DISTLIMIT_CONDITIONAL_COST", -1, ">= 0"),
        ("DISTLIMIT_CONDITIONAL_COST", 1.5, "integer"),
        ("DISTLIMIT_ENABLED", "yes", "True or False"),
        ("DISTLIMIT_FAILURE_POLICY", "maybe", "'open', 'closed', 'local'"),
        ("DISTLIMIT_INSTANCES", 0, "'auto'"),
        ("DISTLIMIT_INSTANCES", True, "'auto'"),
        ("DISTLIMIT_INSTANCES_MIN", 0, ">= 1"),
        ("DISTLIMIT_INSTANCES_MIN", "3", "integer"),
        ("DISTLIMIT_INSTANCES_MIN", 2.5, "integer"),
        ("DISTLIMIT_INSTANCES_MIN", 100_001, "<= 100000"),
        ("DISTLIMIT_FALLBACK_MAX_KEYS", 0, ">= 1"),
        ("DISTLIMIT_FALLBACK_MAX_KEYS", "50000", "integer"),
        ("DISTLIMIT_FALLBACK_MAX_KEYS", 10_000_001, "<= 10000000"),
        ("DISTLIMIT_BREAKER_FAIL_MAX", 0, ">= 1"),
        ("DISTLIMIT_BREAKER_RESET_TIMEOUT", -5, "> 0"),
        ("DISTLIMIT_STORAGE_URL", "mongodb://localhost", "redis://"),
        ("DISTLIMIT_STORAGE_URL", "localhost:6379", "redis://"),
    ],
)
def test_bad_values_fail_at_init_app_naming_key_and_value(
    key: str, value: object, hint: str
) -> None:
    with pytest.raises(ConfigurationError) as info:
        _init(**{key: value})
    message = str(info.value)
    assert key in message
    assert repr(value) in message
    assert hint in message


def test_request_tokens_reach_the_storage_built_from_the_url() -> None:
    for mode in ("auto", "always"):
        app = _init(DISTLIMIT_STORAGE_URL="redis://127.0.0.1:1/0", DISTLIMIT_REQUEST_TOKENS=mode)
        storage = app.extensions["distlimit"].storage
        assert storage.tokens.mode == mode  # nothing connects before the first call
        storage.close()
    cluster = _init(
        DISTLIMIT_STORAGE_URL="redis+cluster://127.0.0.1:1", DISTLIMIT_REQUEST_TOKENS="always"
    )
    assert cluster.extensions["distlimit"].storage.tokens.mode == "always"
    _init(DISTLIMIT_REQUEST_TOKENS="always")  # memory:// loses no reply: nothing to refuse


def test_always_request_tokens_beside_a_storage_passed_in_fail_at_init_app() -> None:
    from flask_distlimit.storage.redis import RedisStorage

    app = Flask("cfg")
    app.config["DISTLIMIT_REQUEST_TOKENS"] = "always"
    auto = RedisStorage(host="127.0.0.1", port=1)
    with pytest.raises(ConfigurationError, match=r"request_tokens='always'"):
        Limiter(app, storage=auto)
    always = RedisStorage(host="127.0.0.1", port=1, request_tokens="always")
    Limiter(Flask("cfg2"), storage=always)  # and "auto" takes any
    app2 = Flask("cfg3")
    app2.config["DISTLIMIT_REQUEST_TOKENS"] = "always"
    Limiter(app2, storage=always)
    auto.close()
    always.close()


def test_bad_storage_url_details_come_from_the_storage() -> None:
    with pytest.raises(ConfigurationError, match="memory"):
        _init(DISTLIMIT_STORAGE_URL="memory://somewhere")
    with pytest.raises(ConfigurationError):
        _init(DISTLIMIT_STORAGE_URL="redis://localhost:notaport/0")


def test_identity_settings_are_validated_at_init_app() -> None:
    with pytest.raises(ConfigurationError, match="DISTLIMIT_TIERS"):
        _init(DISTLIMIT_TIERS={"pro": "10/minute"})
    with pytest.raises(ConfigurationError, match="DISTLIMIT_TRUSTED_PROXIES"):
        _init(DISTLIMIT_TRUSTED_PROXIES=-1)


def test_bad_decorator_arguments_fail_when_declared() -> None:
    limiter = Limiter()
    with pytest.raises(ConfigurationError, match="fortnight"):
        limiter.limit("1 per fortnight")
    with pytest.raises(ConfigurationError, match="at least one rate"):
        limiter.limit("")
    with pytest.raises(ConfigurationError, match="leaky"):
        limiter.limit("1/second", algorithm="leaky")
    with pytest.raises(ConfigurationError, match="cost"):
        limiter.limit("1/second", cost=-1)
    with pytest.raises(ConfigurationError):
        limiter.limit("1/second", on_failure="sometimes")
    with pytest.raises(ConfigurationError, match="scope"):
        limiter.shared_limit("1/second", scope="")


def test_api_key_verifier_without_secret_fails_at_init_app() -> None:
    limiter = Limiter()
    limiter.api_key_verifier(lambda key: None)
    app = Flask("nosecret")
    with pytest.raises(ConfigurationError, match="DISTLIMIT_API_KEY_SECRET"):
        limiter.init_app(app)


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("DISTLIMIT_STORAGE_URI", "DISTLIMIT_STORAGE_URL"),
        ("DISTLIMIT_DEFAULT_LIMIT", "DISTLIMIT_DEFAULT_LIMITS"),
        ("DISTLIMIT_FAILURE_MODE", "DISTLIMIT_FAILURE_POLICY"),
        ("DISTLIMIT_TRUSTED_PROXY", "DISTLIMIT_TRUSTED_PROXIES"),
        ("DISTLIMIT_JWT_KEY", "DISTLIMIT_JWT_KEYS"),
        ("DISTLIMIT_APIKEY_HEADER", "DISTLIMIT_API_KEY_HEADER"),
    ],
)
def test_an_unknown_key_fails_at_init_app_naming_the_closest(typo: str, meant: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        _init(**{typo: "x"})
    message = str(info.value)
    assert f"{typo} (did you mean {meant}?)" in message
    assert "The keys it reads" not in message  # the suggestion is enough


def test_unknown_keys_without_a_close_one_list_every_valid_key() -> None:
    with pytest.raises(ConfigurationError) as info:
        _init(DISTLIMIT_FOO=1, DISTLIMIT_STORAGE_URI="redis://localhost")
    message = str(info.value)
    assert "settings: DISTLIMIT_FOO, DISTLIMIT_STORAGE_URI (did you mean" in message
    assert all(key in message for key in KNOWN_KEYS)


def test_other_keys_are_not_ours_to_judge() -> None:
    _init(RATELIMIT_STORAGE_URI="redis://x", DISTLIMITS="x", distlimit_foo=1)


def test_known_keys_are_exactly_the_keys_the_extension_reads() -> None:
    config: dict[str, object] = {}
    Settings.from_config(config)
    IdentitySettings.from_config(config)
    assert sorted(config) == sorted(KNOWN_KEYS)
    assert len(set(KNOWN_KEYS)) == len(KNOWN_KEYS)


@pytest.mark.parametrize("key", sorted(DEFAULTS))
def test_every_key_is_read_and_checked(key: str) -> None:
    """No setting is stored unread: a value no key accepts is refused, naming its key."""

    class Nothing:
        pass

    with pytest.raises(ConfigurationError, match=key):
        Settings.from_config({key: Nothing()})


#: The typo the docs show being refused (flask_distlimit/config.py's docstring too).
EXAMPLE_TYPO = "DISTLIMIT_STORAGE_URI"


def test_every_key_the_repository_sets_or_documents_is_known() -> None:
    """Tests, the example app, the benchmarks and the docs use only keys init_app accepts (the
    package's own keys: tests/project/test_docs.py)."""
    token = re.compile(r"DISTLIMIT_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_]*\*)")
    files = [ROOT / "README.md"] + [
        path
        for folder in ("tests", "example_app", "bench", "docs")
        for path in (ROOT / folder).rglob("*")
        if path.suffix in {".py", ".md", ".toml", ".cfg", ".yml", ".sh"}
    ]
    here = Path(__file__).resolve()
    used = {
        (key, path.relative_to(ROOT).as_posix())
        for path in files
        if path.resolve() != here  # this module spells typos on purpose
        for key in token.findall(path.read_text())
    }
    unknown = sorted((k, where) for k, where in used if k not in KNOWN_KEYS and k != EXAMPLE_TYPO)
    assert not unknown, f"DISTLIMIT_* keys init_app would refuse: {unknown}"


@pytest.mark.redis
def test_always_request_tokens_refuse_a_storage_that_can_carry_none(
    redis_server: RedisProcess, redis_client: redis.Redis
) -> None:
    """A RedisStorage given a ready client calls through redis-py's Script: no call of it ever
    carries a token, whatever its ``request_tokens`` says, so ``"always"`` cannot hold for it.
    A testing wrapper (CountingStorage) is judged by the storage it wraps."""
    from flask_distlimit.core.decision import Check
    from flask_distlimit.storage.redis import RedisStorage
    from flask_distlimit.testing import CountingStorage

    ready = RedisStorage(redis_server.client(), request_tokens="always")
    ready.evaluate([Check("ratelimit:{cfg}:r:5/60:fixed_window", "fixed_window", 5, 60)])
    assert redis_client.keys("ratelimit:rq:*") == []  # it kept no reply: it carries no token

    def refused(storage: object, match: str) -> None:
        app = Flask("cfg")
        app.config["DISTLIMIT_REQUEST_TOKENS"] = "always"
        with pytest.raises(ConfigurationError, match=match):
            Limiter(app, storage=storage)

    refused(ready, r"ready client.*carry no request token")
    refused(RedisStorage(redis_server.client()), r"ready client.*carry no request token")
    auto = RedisStorage(host="127.0.0.1", port=redis_server.port)
    refused(CountingStorage(auto), r"request_tokens='always'")
    always = RedisStorage(host="127.0.0.1", port=redis_server.port, request_tokens="always")
    app = Flask("cfg-ok")
    app.config["DISTLIMIT_REQUEST_TOKENS"] = "always"
    Limiter(app, storage=CountingStorage(always))  # the wrapped storage carries them
    Limiter(Flask("cfg-auto"), storage=ready)  # "auto" takes any storage
    for storage in (ready, auto, always):
        storage.close()
