"""Real redis-server processes for the tests: started on free loopback ports, stopped by PID.

No test skips for a missing Redis: when ``redis-server`` is not installed, starting one fails with
a message that says how to install it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

INSTALL_HINT = (
    "redis-server (7.x) is required by the test suite and was not found on PATH. "
    "Install it with `apt-get install -y redis-server` (as root; .ci/run does this), "
    "or set REDIS_SERVER_BIN to its path."
)


def redis_binary(name: str = "redis-server") -> str:
    env = os.environ.get("REDIS_SERVER_BIN") if name == "redis-server" else None
    path = env or shutil.which(name)
    if not path:
        raise RuntimeError(INSTALL_HINT)
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RedisProcess:
    """One redis-server process on 127.0.0.1:port."""

    port: int
    args: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    workdir: str = ""

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)  # type: ignore[arg-type]

    def start(self, timeout: float = 10.0) -> RedisProcess:
        if not self.workdir:
            self.workdir = tempfile.mkdtemp(prefix=f"distlimit-redis-{self.port}-")
        cmd = [
            redis_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--dir", self.workdir,
            "--logfile", str(Path(self.workdir) / "redis.log"),
            *self.args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"redis-server on port {self.port} exited at start: {err}")
            try:
                if self.client(socket_timeout=0.5).ping():
                    return self
            except redis.exceptions.RedisError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not answer PING in time")
            time.sleep(0.02)

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            # A stopped (SIGSTOP) server ignores SIGTERM until continued.
            os.kill(self.proc.pid, signal.SIGCONT)
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


def start_redis(*args: str) -> RedisProcess:
    return RedisProcess(port=free_port(), args=list(args)).start()
