"""X-Forwarded-For read exactly as the proxies wrote it, on the lowest and the highest werkzeug.

Issue 10, finding 1: a client that sends ``X-Forwarded-For: 9.9.9.9, "`` made werkzeug's
quoted-string list parser swallow the entries its proxies appended (werkzeug 2.3.8-3.1.3: the
client was counted as 9.9.9.9) or answer nothing (later 3.1.x: the request was counted as the
proxy itself). The checks live in ``tests/proxy_checks.py`` and run twice against a real
redis-server: here (the newest werkzeug installed) and in a venv with the oldest Flask and
werkzeug that ``pyproject.toml`` accepts (tests/lowest_versions.py).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

import flask
import pytest
import redis
from werkzeug.middleware.proxy_fix import ProxyFix

from flask_distlimit.identity import IdentityResolver, IdentitySettings
from tests import lowest_versions, proxy_checks
from tests.servers import RedisProcess

ROOT = Path(__file__).resolve().parents[2]


def _floors() -> dict[str, str]:
    return dict(pin.split("==") for pin in lowest_versions.lowest_pins())


@pytest.fixture(scope="session")
def oldest_flask_python() -> Path:
    """The python of the venv with the lowest declared version of each dependency
    (tests/lowest_versions.py, cached under .ci/); the package comes from this checkout via
    PYTHONPATH. A venv that cannot be built fails the test, never skips it."""
    try:
        return lowest_versions.venv_python()
    except RuntimeError as exc:
        pytest.fail(str(exc))


def _version(text: object) -> tuple[int, ...]:
    return tuple(int(part) for part in str(text).split(".")[:2])


def _check(report: dict[str, object]) -> None:
    expected = proxy_checks.EXPECTED
    cases = proxy_checks.CASES
    identities = report["identities"]
    assert isinstance(identities, list)
    wrong = [
        f"{hops} hop(s), X-Forwarded-For {header!r}: counted as {got!r}, expected {want!r}"
        for (hops, header, want), got in zip(cases, identities, strict=True)
        if got != want
    ]
    assert not wrong, "\n".join(wrong)
    assert report["attack"] == expected["attack"]


def test_the_newest_werkzeug_reads_forwarded_for_as_written(
    redis_server: RedisProcess, redis_client: redis.Redis
) -> None:
    report = proxy_checks.report(redis_server.url, "newest")
    assert _version(report["werkzeug"]) >= (3, 1)
    _check(report)


@pytest.mark.slow
def test_the_oldest_werkzeug_reads_forwarded_for_as_written(
    oldest_flask_python: Path, redis_server: RedisProcess, redis_client: redis.Redis
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [str(oldest_flask_python), str(ROOT / "tests" / "proxy_checks.py"), redis_server.url,
         "oldest"],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    floors = _floors()
    assert (report["flask"], report["werkzeug"]) == (floors["flask"], floors["werkzeug"]), report
    _check(report)


def test_well_formed_headers_pick_the_client_proxyfix_picks() -> None:
    """Where the header holds only addresses, the client is the one ProxyFix(x_for=N) makes
    REMOTE_ADDR (ProxyFix parses a quoted-string list: junk is where the two part ways)."""
    captured: dict[str, object] = {}

    def app(environ: dict[str, object], start_response: object) -> list[bytes]:
        captured.update(environ)
        return []

    header = "1.1.1.1, 2.2.2.2, 3.3.3.3, 4.4.4.4"
    for hops, want in ((1, "4.4.4.4"), (2, "3.3.3.3"), (3, "2.2.2.2"), (4, "1.1.1.1")):
        environ = {"REMOTE_ADDR": "10.0.0.9", "HTTP_X_FORWARDED_FOR": header}
        ProxyFix(app, x_for=hops)(dict(environ), lambda *a: None)  # type: ignore[arg-type]
        assert captured["REMOTE_ADDR"] == want
        config = flask.Flask("parity").config
        config["DISTLIMIT_TRUSTED_PROXIES"] = hops
        resolver = IdentityResolver(IdentitySettings.from_config(config))
        assert resolver.client_ip(environ) == f"ip:{want}"


def test_no_client_address_is_logged_once_with_the_fix(caplog: pytest.LogCaptureFixture) -> None:
    config = flask.Flask("junk").config
    config["DISTLIMIT_TRUSTED_PROXIES"] = 2
    resolver = IdentityResolver(IdentitySettings.from_config(config))
    with caplog.at_level(logging.WARNING, "flask_distlimit.identity"):
        for junk in ("junk", "unknown", '"'):
            environ = {"REMOTE_ADDR": "10.0.0.2", "HTTP_X_FORWARDED_FOR": f"{junk}, 10.0.0.1"}
            assert resolver.client_ip(environ) == "ip:invalid-via:10.0.0.1"
    (record,) = caplog.records
    assert "DISTLIMIT_TRUSTED_PROXIES (2)" in record.getMessage()
    assert "ip:invalid-via:10.0.0.1" in record.getMessage()
