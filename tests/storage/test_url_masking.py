"""Secrets are never printed: ``mask_url`` hides a password whatever it holds unencoded
(``# ? / @ % : &``), and the start-up error of a URL the parser splits inside its password
quotes no piece of it. ``mask_url`` used to end the credentials at the first ``/``, ``?`` or
``#``, so ``redis://:pa/ss@host`` was shown whole."""

from __future__ import annotations

import pytest

from flask_distlimit.errors import ConfigurationError
from flask_distlimit.storage import from_url
from flask_distlimit.storage.urls import mask_url

#: Each holds the marker "Zq9", which must never be shown, beside a character a parser splits on.
PASSWORDS = [
    "Zq9#frag",
    "Zq9?query",
    "a?b=Zq9",
    "Zq9/path",
    "pa/Zq9",
    "Zq9@at",
    "at@Zq9",
    "Zq9%",
    "Zq9%4",
    "%Zq9",
    "Zq9:colon",
    "#?/@%Zq9",
    "Zq9&db=1",
]
URLS = [
    "redis://:{pw}@localhost:6379/0",
    "redis://user:{pw}@localhost",
    "rediss://user:{pw}@h:6380/1?ssl_cert_reqs=none",
    "redis+sentinel://:{pw}@a:26379,b:26379/mymaster/0",
    "redis+cluster://u:{pw}@a:7000,b:7001",
    "unix://:{pw}@/run/redis.sock?db=1",
    "redis://localhost:6379/0?password={pw}",
    "redis://localhost:6379/0?password={pw}&db=1",
    "redis+sentinel://a:1/svc?sentinel_password={pw}&password={pw}",
]


@pytest.mark.parametrize("password", PASSWORDS)
@pytest.mark.parametrize("template", URLS)
def test_mask_url_hides_any_password(template: str, password: str) -> None:
    masked = mask_url(template.format(pw=password))
    assert "Zq9" not in masked
    assert "***" in masked


@pytest.mark.parametrize("password", PASSWORDS)
@pytest.mark.parametrize("template", URLS)
def test_no_error_prints_a_piece_of_the_password(template: str, password: str) -> None:
    try:
        storage = from_url(template.format(pw=password))
    except ConfigurationError as exc:
        assert "Zq9" not in str(exc)
    else:
        storage.close()


def test_what_is_not_a_secret_is_still_shown() -> None:
    assert mask_url("redis://u:p@h:1/0?db=1") == "redis://u:***@h:1/0?db=1"
    assert mask_url("redis://h:1/0?password=p#x&db=1") == "redis://h:1/0?password=***&db=1"
    assert mask_url("redis://:s3cret") == "redis://:***"
    assert mask_url("redis://localhost:notaport") == "redis://localhost:notaport"
    with pytest.raises(ConfigurationError, match="port 'notaport' is not a number"):
        from_url("redis://localhost:notaport")
    with pytest.raises(ConfigurationError, match=r"empty host in '\*\*\*'"):
        from_url("redis://:s3cret")
