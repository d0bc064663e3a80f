"""memory:// served by several processes: one WARNING per process, saying that every limit is
multiplied and how to fix it. Real gunicorn with 2 workers (by -w, and by WEB_CONCURRENCY), and
the detection in this process as gunicorn's own configuration classes see a command line."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path

import fakeredis
import pytest
from flask import Flask

from flask_distlimit import Limiter
from flask_distlimit.ops import serving
from flask_distlimit.ops.serving import Server, detect_server
from flask_distlimit.storage.memory import MemoryStorage
from flask_distlimit.storage.redis import RedisStorage
from tests.servers import free_port, gunicorn_command

ROOT = Path(__file__).resolve().parents[2]
GUNICORN = str(Path(sys.prefix) / "bin" / "gunicorn")  # what argv[0] is in a gunicorn worker
APP = "tests.apps.memory_app:app"
#: Environment variables that would change what a test's gunicorn does or how it is seen.
_SERVING_ENV = ("SERVER_SOFTWARE", "GUNICORN_CMD_ARGS", "WEB_CONCURRENCY")


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test is a process that has not warned yet, and is served by nothing."""
    monkeypatch.setattr(serving, "_warned_in", None)
    for name in _SERVING_ENV:
        monkeypatch.delenv(name, raising=False)


def as_gunicorn_worker(monkeypatch: pytest.MonkeyPatch, *argv: str) -> None:
    """Make this process look like a worker of ``gunicorn ARGV``."""
    monkeypatch.setenv("SERVER_SOFTWARE", "gunicorn/27.0.1")
    monkeypatch.setattr(sys, "argv", [GUNICORN, *argv])


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "flask_distlimit.serving" and r.levelno == logging.WARNING
    ]


def init(storage_url: str = "memory://", **kwargs: object) -> Flask:
    app = Flask("served")
    app.config["DISTLIMIT_STORAGE_URL"] = storage_url
    Limiter(app, **kwargs)  # type: ignore[arg-type]
    return app


# -- detection, in this process ----------------------------------------------------------------


def test_no_server_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    assert detect_server() is None
    init()
    assert warnings_of(caplog) == []


def test_one_gunicorn_worker_is_fine(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    as_gunicorn_worker(monkeypatch, "-w", "1", APP)
    assert detect_server() == Server("gunicorn", 1)
    init()
    assert warnings_of(caplog) == []


@pytest.mark.slow
def test_several_gunicorn_workers_warn_once_per_process(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    as_gunicorn_worker(monkeypatch, "--workers", "3", "--threads", "2", APP)
    assert detect_server() == Server("gunicorn", 3)
    init()
    init()  # a second app in the same process: no second line
    [line] = warnings_of(caplog)
    assert "memory://" in line and "gunicorn with 3 worker processes" in line
    assert "every limit is multiplied" in line
    assert "DISTLIMIT_STORAGE_URL" in line and "redis://" in line


def test_gunicorn_cmd_args_count(monkeypatch: pytest.MonkeyPatch) -> None:
    as_gunicorn_worker(monkeypatch, APP)
    monkeypatch.setenv("GUNICORN_CMD_ARGS", "--workers 4 --log-level warning")
    assert detect_server() == Server("gunicorn", 4)


def test_the_config_file_counts_and_leaves_no_trace(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "gunicorn.conf.py"
    config.write_text("workers = 5\nchdir = " + repr(str(tmp_path)) + "\n")
    as_gunicorn_worker(monkeypatch, "-c", str(config), APP)
    cwd, path, module = os.getcwd(), list(sys.path), sys.modules.get("__config__")
    assert detect_server() == Server("gunicorn", 5)
    assert (os.getcwd(), sys.path, sys.modules.get("__config__")) == (cwd, path, module)
    assert capsys.readouterr() == ("", "")


def test_python_dash_m_gunicorn_is_the_gunicorn_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import gunicorn

    as_gunicorn_worker(monkeypatch, "-w", "2", APP)
    main = Path(gunicorn.__file__).parent / "__main__.py"  # argv[0] under python -m gunicorn
    monkeypatch.setattr(sys, "argv", [str(main), *sys.argv[1:]])
    assert detect_server() == Server("gunicorn", 2)


def test_a_configuration_gunicorn_refuses_is_an_unknown_count_and_prints_nothing(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    as_gunicorn_worker(monkeypatch, "--no-such-option", APP)
    server = detect_server()
    assert server is not None and server.processes is None
    init()
    [line] = warnings_of(caplog)
    assert "may run several worker processes" in line and "could not be read" in line
    assert capsys.readouterr() == ("", "")  # gunicorn's usage text went to the DEBUG log


def test_an_embedding_launcher_is_an_unknown_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SERVER_SOFTWARE", "gunicorn/27.0.1")
    monkeypatch.setattr(sys, "argv", ["/srv/app/run_server.py", "--port", "8000"])
    server = detect_server()
    assert server is not None and server.processes is None
    assert "run_server.py" in server.reason


@pytest.mark.parametrize(("numproc", "warned"), [(4, True), (1, False)])
def test_uwsgi_numproc(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, numproc: int, warned: bool
) -> None:
    # The uwsgi module exists only inside uWSGI's workers: this stands for it.
    monkeypatch.setitem(sys.modules, "uwsgi", types.SimpleNamespace(numproc=numproc))
    assert detect_server() == Server("uWSGI", numproc)
    init()
    assert bool(warnings_of(caplog)) is warned
    if warned:
        assert "uWSGI with 4 worker processes" in warnings_of(caplog)[0]


def test_only_memory_storage_is_checked(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    as_gunicorn_worker(monkeypatch, "-w", "4", APP)
    init("redis://127.0.0.1:1/0")  # nothing connects at init_app
    init(storage=RedisStorage(fakeredis.FakeRedis()))  # a ready storage wins over the URL
    assert warnings_of(caplog) == []
    init("redis://127.0.0.1:1/0", storage=MemoryStorage())
    assert len(warnings_of(caplog)) == 1


# -- real gunicorn -----------------------------------------------------------------------------


@contextlib.contextmanager
def gunicorn(log: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[None]:
    """gunicorn serving tests/apps/memory_app.py, its output in ``log``; stopped afterwards."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DISTLIMIT_", *_SERVING_ENV))}
    cmd = gunicorn_command(
        "--bind", f"127.0.0.1:{free_port()}", "--log-level", "info", *args, APP
    )  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env={**clean, "PYTHONPATH": str(ROOT), **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # master and workers: one group
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def warned_pids(log: Path, expected: int, timeout: float = 30.0) -> set[str]:
    """The pids that logged the memory:// warning, once ``expected`` workers have booted and
    each has had the time to configure its app (the warning comes at import, before serving)."""
    line = re.compile(r"^(\d+) WARNING flask_distlimit\.serving: (.*)$", re.MULTILINE)
    deadline = time.monotonic() + timeout
    while True:
        text = log.read_text(errors="replace")
        booted = len(re.findall(r"Booting worker with pid", text))
        found = line.findall(text)
        if booted >= expected and len(found) >= expected:
            time.sleep(0.5)  # any extra line would come now
            text = log.read_text(errors="replace")
            found = line.findall(text)
            assert all("every limit is multiplied" in m for _, m in found), text
            assert len(found) == len({pid for pid, _ in found}), text  # one line per process
            return {pid for pid, _ in found}
        if time.monotonic() > deadline:
            raise AssertionError(f"{expected} workers did not warn in {timeout} s:\n{text[-3000:]}")
        time.sleep(0.1)


@pytest.mark.gunicorn
@pytest.mark.parametrize(
    ("args", "env"),
    [(("-w", "2"), {}), ((), {"WEB_CONCURRENCY": "2"})],
    ids=["-w 2", "WEB_CONCURRENCY=2"],
)
@pytest.mark.slow
def test_two_gunicorn_workers_on_memory_warn_once_each(
    tmp_path: Path, args: tuple[str, ...], env: dict[str, str]
) -> None:
    log = tmp_path / "gunicorn.log"
    with gunicorn(log, *args, env=env):
        pids = warned_pids(log, expected=2)
    assert len(pids) == 2
    assert "gunicorn with 2 worker processes" in log.read_text()
