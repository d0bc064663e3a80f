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
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from flask import Flask
from flask.testing import FlaskClient

from example_app import create_app
from example_app.__main__ import choose_storage
from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[2]

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


@dataclass
class Launched:
    """The README's first command, running: ``python -m example_app`` on a free port."""

    process: subprocess.Popen[bytes]
    base: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text()


@contextlib.contextmanager
def launched(tmp_path: Path, *, workers: int = 3, threads: int = 2) -> Iterator[Launched]:
    """Start the launcher as a user would (no DISTLIMIT_/EXAMPLE_ variables), wait until every
    worker answers, and stop it with SIGTERM at the end (anything left in its process group is
    killed)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTLIMIT_", "EXAMPLE_"))}
    log_path = tmp_path / "launcher.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "example_app", "--port", str(port), "--workers",
             str(workers), "--threads", str(threads)],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    running = Launched(process, f"http://127.0.0.1:{port}", log_path)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, running.log()
            try:
                if _get(f"{running.base}/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, running.log()
            time.sleep(0.2)
        boot_deadline = time.monotonic() + 30
        while running.log().count("Booting worker") < workers:
            assert time.monotonic() < boot_deadline, running.log()
            time.sleep(0.2)
        yield running
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # anything left in its process group


@pytest.mark.gunicorn
@pytest.mark.redis
@pytest.mark.slow
def test_readme_command_runs_gunicorn_on_a_private_redis(tmp_path: Path) -> None:
    with launched(tmp_path) as running:
        found = re.search(r"private redis-server \(pid (\d+)\)", running.log())
        assert found, running.log()
        redis_pid = int(found[1])
        # Several workers, one shared count: exactly the anonymous tier's 20 pass. The example
        # counts with a sliding window counter, which admits a little more when a burst
        # straddles a minute (the previous window's count is weighted down): burst within one
        # minute.
        into_minute = time.time() % 60
        if into_minute > 45:
            time.sleep(60.5 - into_minute)
        codes = [_get(f"{running.base}/catalogue")[0] for _ in range(24)]
        assert codes.count(200) == 20 and codes.count(429) == 4, codes
        status, downstream = _get(f"{running.base}/downstream")
        assert status == 200
        assert downstream["shared"] is True
        assert downstream["counts"] == {"catalogue": 20}
    assert running.process.returncode == 0, running.log()
    assert "stopped the private redis-server" in running.log()
    assert not _alive(redis_pid)


def readme_commands(base: str) -> list[str]:
    """The shell commands of example_app/README.md's "Try it" block, continuation lines joined,
    aimed at ``base`` instead of localhost:8000."""
    text = (ROOT / "example_app" / "README.md").read_text()
    block = text[text.index("Try it") : text.index("and look at the counters")]
    commands: list[str] = []
    pending = ""
    for line in block.splitlines():
        if not line.startswith("    "):
            continue
        pending += line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        commands.append(pending.replace("localhost:8000", base.removeprefix("http://")))
        pending = ""
    assert len(commands) >= 5, commands
    return commands


def _shell_env() -> dict[str, str]:
    """The README's commands run ``python`` and ``flask``: this interpreter's, first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTLIMIT_", "EXAMPLE_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run_in_one_shell(commands: list[str]) -> list[str]:
    """Run ``commands`` in one bash, in order (a variable set by one is seen by the next);
    answer each one's output, stderr included, with its exit status last."""
    script = "exec 2>&1\n" + "".join(
        f"echo '>>> {i}'\n{c}\necho \"\n<<< $?\"\n" for i, c in enumerate(commands)
    )
    result = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env=_shell_env(), capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    combined = result.stdout + result.stderr
    outputs = re.split(r">>> \d+\n", result.stdout)[1:]
    assert len(outputs) == len(commands), combined
    assert "Traceback" not in combined and "KeyError" not in combined, combined
    return outputs


@pytest.mark.gunicorn
@pytest.mark.redis
@pytest.mark.slow
def test_readme_commands_work_in_any_order_and_inspect_finds_the_counters(
    tmp_path: Path,
) -> None:
    with launched(tmp_path, workers=2, threads=2) as running:
        commands = readme_commands(running.base)
        token_line = next(i for i, c in enumerate(commands) if c.startswith("TOKEN="))
        forward = _run_in_one_shell(commands)
        assert '"client":"user:bob"' in forward[token_line + 1].replace(" ", ""), forward
        assert "429" in forward[-2], forward  # the loop met the anonymous tier
        # Backwards: the loop spends the address's quota before the token is asked for, and
        # the orders line runs with no token at all. Each says why, none crashes.
        backward = _run_in_one_shell(commands[::-1])[::-1]
        assert "retry in" in backward[token_line], backward
        # No token: counted as anonymous, whose quota is spent; the problem document says so.
        assert '"detail":' in backward[token_line + 1], backward
        # The inspect line the launcher printed finds the counters those requests made.
        printed = running.log().split("the counters, from another terminal", 1)[1]
        inspect = next(line.strip() for line in printed.splitlines() if "distlimit inspect" in line)
        readme = (ROOT / "example_app" / "README.md").read_text()
        assert inspect.endswith("flask --app example_app:create_app distlimit inspect ip:127.0.0.1")
        assert "flask --app example_app:create_app distlimit inspect ip:127.0.0.1" in readme
        seen = subprocess.run(
            ["bash", "-c", inspect], cwd=ROOT, env=_shell_env(), capture_output=True,
            text=True, timeout=60, check=False,
        )  # fmt: skip
        assert seen.returncode == 0, seen.stdout + seen.stderr
        assert "no counters stored" not in seen.stdout, seen.stdout
        assert "tier-anonymous" in seen.stdout, seen.stdout


def test_launcher_prints_no_secret_or_url_it_was_given() -> None:
    from example_app.__main__ import inspect_command

    env = {"DISTLIMIT_STORAGE_URL": "redis://:hunter2@10.0.0.1:6379/0", "EXAMPLE_SECRET_KEY": "s3"}
    line = inspect_command(env, secret_given=True, url_given=True)
    assert "hunter2" not in line and "s3" not in line
    assert line.startswith('EXAMPLE_SECRET_KEY="$EXAMPLE_SECRET_KEY" DISTLIMIT_STORAGE_URL=')
    made = inspect_command(
        {"DISTLIMIT_STORAGE_URL": "redis://127.0.0.1:7000/0", "EXAMPLE_SECRET_KEY": "ab12"},
        secret_given=False,
        url_given=False,
    )
    assert made.startswith(
        "EXAMPLE_SECRET_KEY=ab12 DISTLIMIT_STORAGE_URL=redis://127.0.0.1:7000/0 "
    )
    memory = inspect_command(
        {"DISTLIMIT_STORAGE_URL": "memory://", "EXAMPLE_SECRET_KEY": "ab12"},
        secret_given=False,
        url_given=False,
    )
    assert "cannot see" in memory


def test_downstream_answers_while_redis_is_unreachable(caplog: pytest.LogCaptureFixture) -> None:
    """``GET /downstream`` shows this process's counts when Redis is down, as ``hit`` keeps
    them (it was a 500: the read had no fallback)."""
    app = create_app({"DISTLIMIT_STORAGE_URL": "redis://127.0.0.1:1/0", "SECRET_KEY": "x" * 40})
    response = app.test_client().get("/downstream")
    assert response.status_code == 200
    assert "Redis unreachable" in caplog.text
