"""The example app: its factory through the Flask test client on memory:// and a real Redis, and
the README's first command (the launcher) run for real: gunicorn workers on a private redis-server,
hit over loopback, stopped by PID."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from flask import Flask
from flask.testing import FlaskClient

from example_app import create_app
from example_app.__main__ import choose_storage
from tests.servers import free_port

ROOT = Path(__file__).resolve().parent.parent

BACKENDS = [
    pytest.param("memory", id="memory"),
    pytest.param("redis", marks=pytest.mark.redis, id="redis"),
]


@pytest.fixture(params=BACKENDS)
def app(request: pytest.FixtureRequest) -> Iterator[Flask]:
    config: dict[str, object] = {"TESTING": True, "SECRET_KEY": "test-secret"}
    if request.param == "redis":
        client: redis.Redis = request.getfixturevalue("redis_client")
        port = client.connection_pool.connection_kwargs["port"]
        config["DISTLIMIT_STORAGE_URL"] = f"redis://127.0.0.1:{port}/0"
    application = create_app(config)
    yield application
    application.extensions["distlimit"].storage.close()


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


def token_for(client: FlaskClient, account: str, password: str) -> str:
    reply = client.post(
        "/token",
        json={"account": account, "password": password},
        environ_base={"REMOTE_ADDR": "10.9.9.9"},
    )
    assert reply.status_code == 200, reply.get_json()
    token = reply.get_json()["access_token"]
    assert isinstance(token, str)
    return token


def test_catalogue_is_capped_at_the_anonymous_tier_and_downstream_runs_that_often(
    app: Flask, client: FlaskClient
) -> None:
    codes = [client.get("/catalogue").status_code for _ in range(25)]
    assert codes == [200] * 20 + [429] * 5
    denied = client.get("/catalogue")
    assert denied.mimetype == "application/problem+json"
    assert int(denied.headers["Retry-After"]) > 0
    downstream = client.get("/downstream").get_json()
    assert downstream["counts"] == {"catalogue": 20}
    assert downstream["by_caller"] == {"catalogue": {"anonymous": 20}}
    assert downstream["shared"] is (app.config["DISTLIMIT_STORAGE_URL"] != "memory://")


def test_health_and_downstream_are_exempt(client: FlaskClient) -> None:
    for _ in range(30):
        reply = client.get("/health")
        assert reply.status_code == 200
    assert "RateLimit" not in reply.headers
    assert "X-RateLimit-Limit" not in reply.headers


def test_a_token_carries_its_tier_into_the_limits(client: FlaskClient) -> None:
    token = token_for(client, "bob", "bob-pw")
    reply = client.get("/orders", headers={"Authorization": f"Bearer {token}"})
    assert reply.status_code == 200
    assert reply.get_json()["client"] == "user:bob"
    assert reply.headers["RateLimit-Policy"].startswith('"tier-pro:')
    assert reply.headers["X-RateLimit-Limit"] == "300"


def test_a_forged_token_is_anonymous_and_unauthorized(client: FlaskClient) -> None:
    forged = token_for(client, "alice", "alice-pw")[:-4] + "AAAA"
    reply = client.get("/orders", headers={"Authorization": f"Bearer {forged}"})
    assert reply.status_code == 401
    assert reply.headers["X-RateLimit-Limit"] == "20"  # counted as anonymous


def test_api_keys_are_verified_against_the_store(client: FlaskClient) -> None:
    good = client.get("/orders", headers={"X-Api-Key": "pro-demo-key"})
    assert good.status_code == 200
    assert good.get_json()["client"] == "key:acme-pro"
    assert good.headers["X-RateLimit-Limit"] == "300"
    unknown = client.get("/orders", headers={"X-Api-Key": "made-up-key"})
    assert unknown.status_code == 401
    assert unknown.headers["X-RateLimit-Limit"] == "20"


def test_creating_orders_has_its_own_token_bucket(client: FlaskClient) -> None:
    headers = {"X-Api-Key": "free-demo-key"}
    codes = [
        client.post("/orders", json={"item": 1}, headers=headers).status_code for _ in range(12)
    ]
    assert codes == [201] * 10 + [429] * 2
    ran = client.get("/downstream").get_json()
    assert ran["counts"]["orders"] == 10
    assert ran["by_caller"]["orders"] == {"key:acme-free": 10}


def test_login_is_limited_per_account_whatever_the_address(client: FlaskClient) -> None:
    codes = [
        client.post(
            "/token",
            json={"account": "alice", "password": f"guess-{i}"},
            environ_base={"REMOTE_ADDR": f"198.51.100.{i}"},
        ).status_code
        for i in range(7)
    ]
    assert codes == [401] * 5 + [429] * 2
    # Another account is not affected.
    assert token_for(client, "bob", "bob-pw")


def test_login_fails_closed_while_the_rest_fails_open() -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    app = create_app({"TESTING": True, "SECRET_KEY": "s", "DISTLIMIT_STORAGE_URL": dead})
    client = app.test_client()
    try:
        login = client.post("/token", json={"account": "alice", "password": "alice-pw"})
        assert login.status_code == 503
        assert login.mimetype == "application/problem+json"
        assert "Retry-After" in login.headers
        catalogue = client.get("/catalogue")
        assert catalogue.status_code == 200
        assert catalogue.headers["X-RateLimit-Degraded"] == "true"
    finally:
        app.extensions["distlimit"].storage.close()


def test_launcher_prefers_the_configured_url_and_hides_its_password(
    capsys: pytest.CaptureFixture[str],
) -> None:
    env = {"DISTLIMIT_STORAGE_URL": "redis://:hunter2@10.0.0.1:6379/0"}
    assert choose_storage(env) is None
    assert env["DISTLIMIT_STORAGE_URL"] == "redis://:hunter2@10.0.0.1:6379/0"
    err = capsys.readouterr().err
    assert "hunter2" not in err
    assert "redis://:***@10.0.0.1:6379/0" in err


def test_launcher_without_redis_says_what_memory_means(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("example_app.__main__.shutil.which", lambda name: None)
    env: dict[str, str] = {}
    assert choose_storage(env) is None
    assert env["DISTLIMIT_STORAGE_URL"] == "memory://"
    err = capsys.readouterr().err
    assert "OWN counters" in err
    assert "multiplied by the" in err


def _get(url: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        body = json.loads(exc.read())
        exc.close()
        return exc.code, body


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as stopped.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


@pytest.mark.gunicorn
@pytest.mark.redis
@pytest.mark.slow
def test_readme_command_runs_gunicorn_on_a_private_redis(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTLIMIT_", "EXAMPLE_"))}
    log_path = tmp_path / "launcher.log"
    with log_path.open("wb") as log:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "example_app", "--port", str(port), "--workers", "3",
             "--threads", "2"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    redis_pid = None
    try:
        deadline = time.monotonic() + 60
        while True:
            assert launcher.poll() is None, log_path.read_text()
            try:
                if _get(f"{base}/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        found = re.search(r"private redis-server \(pid (\d+)\)", log_path.read_text())
        assert found, log_path.read_text()
        redis_pid = int(found[1])
        boot_deadline = time.monotonic() + 30
        while log_path.read_text().count("Booting worker") < 3:
            assert time.monotonic() < boot_deadline, log_path.read_text()
            time.sleep(0.2)
        # Several workers, one shared count: exactly the anonymous tier's 20 pass. The example
        # counts with a sliding window counter, which admits a little more when a burst straddles
        # a minute (the previous window's count is weighted down): burst within one minute.
        into_minute = time.time() % 60
        if into_minute > 45:
            time.sleep(60.5 - into_minute)
        codes = [_get(f"{base}/catalogue")[0] for _ in range(24)]
        assert codes.count(200) == 20 and codes.count(429) == 4, codes
        status, downstream = _get(f"{base}/downstream")
        assert status == 200
        assert downstream["shared"] is True
        assert downstream["counts"] == {"catalogue": 20}
    finally:
        if launcher.poll() is None:
            os.kill(launcher.pid, signal.SIGTERM)
        try:
            launcher.wait(timeout=30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launcher.pid, signal.SIGKILL)  # anything left in its process group
    assert launcher.returncode == 0, log_path.read_text()
    assert "stopped the private redis-server" in log_path.read_text()
    assert redis_pid is not None and not _alive(redis_pid)
