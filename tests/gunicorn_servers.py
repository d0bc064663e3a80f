"""gunicorn serving an app of ``tests/apps/`` on a free loopback port, for the tests (and the
benches) that deploy one: started in a process group of its own with this checkout first on
its PYTHONPATH, its output in a log file, stopped through its group (master and workers).
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from tests.servers import free_port, gunicorn_command

ROOT: Final = Path(__file__).resolve().parent.parent
#: How most tests serve: 3 gthread workers x 4 threads.
GTHREAD: Final = ("--workers", "3", "--worker-class", "gthread", "--threads", "4")


@dataclass
class Gunicorn:
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)  # master and workers: one group
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def launch(
    app: str, env: dict[str, str], logdir: Path, workers: Sequence[str] = GTHREAD
) -> Gunicorn:
    """gunicorn serving ``app`` (``workers``: its worker options, by default :data:`GTHREAD`)
    on a free port, with ``env`` added to this process's environment."""
    port = free_port()
    log = logdir / f"gunicorn-{port}.log"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        **env,
    }
    cmd = gunicorn_command(
        "--bind", f"127.0.0.1:{port}",
        *workers,
        "--graceful-timeout", "5",
        "--log-level", "warning",
        app,
    )  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Gunicorn(port, proc, log)


def request(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    """(status, body) of one GET; a degraded answer (storage outage) fails the test."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        body = response.read().decode()
        assert response.getheader("X-RateLimit-Degraded") is None, (response.status, body)
        return response.status, body
    finally:
        conn.close()


def status_of(port: int, path: str, method: str = "GET") -> int:
    """The status of one request, its body read (a degraded answer too)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=90)
    try:
        conn.request(method, path)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Poll ``condition`` until it holds; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def wait_ready(server: Gunicorn, timeout: float = 30.0, path: str = "/health") -> None:
    """Until the instance answers ``path`` (an exempt route) with a 200."""
    deadline = time.monotonic() + timeout
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(f"gunicorn exited at start:\n{server.log.read_text()[-3000:]}")
        try:
            if request(server.port, path)[0] == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"gunicorn did not answer in time:\n{server.log.read_text()[-3000:]}"
            )
        time.sleep(0.1)
