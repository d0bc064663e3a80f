"""``python -m example_app``: run the example API on gunicorn with several workers.

Storage, in this order:

1. ``DISTLIMIT_STORAGE_URL`` when it is set (any URL the extension accepts);
2. else a private ``redis-server`` on a free loopback port, when one is installed (stopped on exit);
3. else ``memory://``: every worker then keeps its own counters, which the launcher says plainly.

It prints the ``flask distlimit inspect`` command that sees the workers' counters: the CLI needs
the same storage and the same secret (``EXAMPLE_SECRET_KEY``, which keys the identity digests in
the storage keys), and both can change at each launch.

Ctrl-C or SIGTERM stops gunicorn and then the private Redis.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

import redis

from flask_distlimit.storage.urls import mask_url

HERE = Path(__file__).resolve().parent


def say(message: str) -> None:
    print(f"[example_app] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivateRedis:
    """A throw-away redis-server on 127.0.0.1, no persistence, stopped by PID."""

    def __init__(self, binary: str) -> None:
        self.port = free_port()
        self.workdir = tempfile.mkdtemp(prefix="example-app-redis-")
        command = [
            binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", self.workdir,
            "--logfile", os.path.join(self.workdir, "redis.log"),
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def wait_ready(self, timeout: float = 10.0) -> bool:
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    if client.ping():
                        return True
                except redis.RedisError:
                    time.sleep(0.05)
            return False
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        shutil.rmtree(self.workdir, ignore_errors=True)


def choose_storage(env: dict[str, str]) -> PrivateRedis | None:
    """Set ``DISTLIMIT_STORAGE_URL`` in ``env``; answer the private Redis started, if any."""
    if env.get("DISTLIMIT_STORAGE_URL"):
        say(f"storage: DISTLIMIT_STORAGE_URL={mask_url(env['DISTLIMIT_STORAGE_URL'])}")
        return None
    binary = shutil.which("redis-server")
    if binary:
        private = PrivateRedis(binary)
        if private.wait_ready():
            env["DISTLIMIT_STORAGE_URL"] = private.url
            say(
                f"storage: a private redis-server (pid {private.proc.pid}) at {private.url}, "
                "shared by every worker; it stops when this launcher stops"
            )
            return private
        private.stop()
        say("redis-server is installed but did not start; falling back to memory://")
    env["DISTLIMIT_STORAGE_URL"] = "memory://"
    say(
        "storage: memory:// -- no DISTLIMIT_STORAGE_URL and no redis-server on PATH.\n"
        "    Each gunicorn worker keeps its OWN counters, so every limit is multiplied by the\n"
        "    number of workers (and GET /downstream shows one worker's counts only).\n"
        "    For exact limits install Redis (apt-get install redis-server) or set\n"
        "    DISTLIMIT_STORAGE_URL=redis://host:6379/0."
    )
    return None


def inspect_command(env: dict[str, str], *, secret_given: bool, url_given: bool) -> str:
    """What to run in another terminal to see this launch's counters (one line of shell).

    A secret or URL the caller set is not printed (it is theirs, and may hold a password):
    the line then names the variable instead, to be set in that terminal too.
    """
    url = env["DISTLIMIT_STORAGE_URL"]
    if url == "memory://":
        return (
            "flask distlimit inspect cannot see the workers' counters: with memory:// each "
            "worker keeps its own, in its own memory."
        )
    secret = '"$EXAMPLE_SECRET_KEY"' if secret_given else env["EXAMPLE_SECRET_KEY"]
    shown_url = '"$DISTLIMIT_STORAGE_URL"' if url_given else shlex.quote(url)
    return (
        f"EXAMPLE_SECRET_KEY={secret} DISTLIMIT_STORAGE_URL={shown_url} "
        "flask --app example_app:create_app distlimit inspect ip:127.0.0.1"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m example_app",
        description="Run the Flask-DistLimit example API on gunicorn (gthread workers).",
    )
    parser.add_argument("--host", default=os.environ.get("EXAMPLE_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("EXAMPLE_PORT", "8000")))
    parser.add_argument("--workers", type=int, default=int(os.environ.get("EXAMPLE_WORKERS", "3")))
    parser.add_argument("--threads", type=int, default=int(os.environ.get("EXAMPLE_THREADS", "4")))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = dict(os.environ)
    secret_given = bool(env.get("EXAMPLE_SECRET_KEY"))
    url_given = bool(env.get("DISTLIMIT_STORAGE_URL"))
    # Every worker must verify the tokens any other worker issued, and count an API key and a
    # client under the same digests: one secret per launch, shared by all workers (and printed
    # below for the CLI, which must count the same way to find the workers' counters).
    if not secret_given:
        env["EXAMPLE_SECRET_KEY"] = secrets.token_hex(32)
    private = choose_storage(env)
    base = f"http://{args.host}:{args.port}"
    say(
        f"gunicorn: {args.workers} workers x {args.threads} threads on {base}\n"
        f"    curl {base}/catalogue                      # public, 20/minute when anonymous\n"
        f"    curl -X POST {base}/token -H 'Content-Type: application/json' \\\n"
        f'         -d \'{{"account": "alice", "password": "alice-pw"}}\'\n'
        f"    curl {base}/orders -H 'X-Api-Key: pro-demo-key'\n"
        f"    curl {base}/downstream                     # how often the handlers really ran\n"
        "  the counters, from another terminal in this directory (this launch's storage and "
        "secret):\n"
        f"    {inspect_command(env, secret_given=secret_given, url_given=url_given)}"
    )
    command = [
        sys.executable, "-m", "gunicorn",
        "--config", str(HERE / "gunicorn.conf.py"),
        "--bind", f"{args.host}:{args.port}",
        "--workers", str(args.workers),
        "--threads", str(args.threads),
        "example_app:create_app()",
    ]  # fmt: skip
    server = subprocess.Popen(command, env=env, cwd=HERE.parent)

    def forward(signum: int, _frame: FrameType | None) -> None:
        if server.poll() is None:
            server.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        return server.wait()
    finally:
        if server.poll() is None:
            server.terminate()
            try:
                server.wait(timeout=15)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        if private is not None:
            private.stop()
            say("stopped the private redis-server")


if __name__ == "__main__":
    sys.exit(main())
