"""DISTLIMIT_INSTANCES: validation, heartbeat timing on a fake clock, live counts on a real
Redis, and gunicorn workers (forked from a preloaded app) counted as one instance each."""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from flask_distlimit.errors import ConfigurationError
from flask_distlimit.instances import Instances, validate_instances
from flask_distlimit.storage.urls import from_url
from tests.guard_helpers import FakeClock, ScriptedStorage
from tests.servers import RedisProcess, free_port, gunicorn_command

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("value", "expected"), [("auto", "auto"), (1, 1), (12, 12), ("4", 4)])
def test_valid_settings(value: object, expected: object) -> None:
    assert validate_instances(value) == expected


@pytest.mark.parametrize("value", [0, -1, True, "many", 1.5, None, ""])
def test_invalid_settings_say_what_to_use(value: object) -> None:
    with pytest.raises(ConfigurationError, match=r"positive integer.*auto"):
        validate_instances(value)


def test_a_fixed_count_is_the_divisor_and_never_beats() -> None:
    instances = Instances(6)
    assert instances.divisor == 6
    assert not instances.due()


def test_ttl_must_outlive_the_interval() -> None:
    with pytest.raises(ConfigurationError, match="ttl"):
        Instances("auto", interval=5, ttl=5)


def test_auto_beats_at_most_once_per_interval() -> None:
    clock = FakeClock()
    storage = ScriptedStorage()
    instances = Instances("auto", interval=5, clock=clock)
    assert instances.due() and instances.divisor == 1 and instances.seen is None
    instances.beat(storage)
    assert storage.calls == 1 and instances.seen == 1
    instances.beat(storage)
    clock.advance(4.9)
    assert not instances.due()
    instances.beat(storage)
    assert storage.calls == 1
    clock.advance(0.1)
    assert instances.due()
    instances.beat(storage)
    assert storage.calls == 2


def test_only_one_thread_beats_when_due() -> None:
    storage = ScriptedStorage(delay=0.05)
    instances = Instances("auto")
    threads = [threading.Thread(target=instances.beat, args=(storage,)) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert storage.calls == 1


@pytest.mark.redis
def test_live_members_are_counted_and_expire_on_real_redis(redis_server: RedisProcess) -> None:
    storage = from_url(redis_server.url)
    client = redis_server.client()
    prefix = f"instances-{os.getpid()}"
    try:
        a = Instances("auto", key_prefix=prefix, interval=0.1, ttl=0.3)
        b = Instances("auto", key_prefix=prefix, interval=0.1, ttl=0.3)
        a.beat(storage)
        b.beat(storage)
        assert (a.seen, b.seen) == (1, 2)
        assert 0 < client.pttl(f"{prefix}:instances") <= 300
        time.sleep(0.35)  # b stops beating; its member expires
        a.beat(storage)
        assert a.seen == 1
        assert a.divisor == 1
    finally:
        client.delete(f"{prefix}:instances")
        client.close()
        storage.close()


def _get(port: int, path: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        return conn.getresponse().read().decode()
    finally:
        conn.close()


@pytest.mark.redis
@pytest.mark.gunicorn
def test_each_gunicorn_worker_is_an_instance(redis_server: RedisProcess, tmp_path: Path) -> None:
    prefix = f"gunicorn-instances-{os.getpid()}"
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "DISTLIMIT_STORAGE_URL": redis_server.url,
        "INSTANCES_TEST_PREFIX": prefix,
    }
    cmd = gunicorn_command(
        "--preload",
        "--bind", f"127.0.0.1:{port}", "--workers", "3",
        "--worker-class", "gthread", "--threads", "2", "--graceful-timeout", "5",
        "--log-level", "warning", "tests.apps.instances_app:app",
    )  # fmt: skip
    log = tmp_path / "gunicorn.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    client = redis_server.client()
    try:
        pids: set[str] = set()
        deadline = time.monotonic() + 30
        while len(pids) < 3:  # until every worker has served (and beaten on) a request
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            with contextlib.suppress(OSError):
                pids.add(_get(port, "/"))
            time.sleep(0.01)
        members = {m.decode() for m in client.zrange(f"{prefix}:instances", 0, -1)}
        assert len(members) == 3
        assert {m.split(":")[1] for m in members} == pids  # hostname:pid:token, per worker
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        client.delete(f"{prefix}:instances")
        client.close()
