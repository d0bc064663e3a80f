"""``split_slots=true``: a single endpoint that refuses a script call across hash slots
(``CROSSSLOT``, a clustering proxy) gets one call per slot group, all in one write, all or
nothing across the groups (flask_distlimit/storage/split_slots.py).

The refusing endpoint is a loopback proxy in front of a real redis-server that answers every
``EVALSHA`` or ``EVAL`` whose keys span slots as Redis Enterprise's proxy does, and forwards
everything else.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from flask import Flask
from redis.crc import key_slot

from flask_distlimit import Limiter
from flask_distlimit.core.decision import Check
from flask_distlimit.errors import ConfigurationError, StorageMisconfigured
from flask_distlimit.storage import from_url
from flask_distlimit.storage.redis import RedisStorage
from flask_distlimit.storage.slot_keys import slot_of
from tests.servers import RedisProcess

CROSSSLOT = b"-CROSSSLOT Keys in request don't hash to the same slot\r\n"


def _encode(reply: Any) -> bytes:
    """A reply as RESP2 (what the proxy hands the client)."""
    if isinstance(reply, redis.ResponseError):
        return b"-" + str(reply).encode() + b"\r\n"
    if reply is None:
        return b"$-1\r\n"
    if isinstance(reply, int):
        return b":%d\r\n" % reply
    if isinstance(reply, list):
        return b"*%d\r\n" % len(reply) + b"".join(_encode(r) for r in reply)
    data = reply if isinstance(reply, bytes) else str(reply).encode()
    return b"$%d\r\n%s\r\n" % (len(data), data)


class CrossSlotProxy:
    """A TCP proxy on loopback to ``upstream`` that refuses script calls across slots;
    ``refused`` counts the refusals, ``writes`` the client's writes (recv calls)."""

    def __init__(self, upstream: RedisProcess) -> None:
        self.upstream = upstream
        self.refused = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = redis.Connection(host="127.0.0.1", port=self.upstream.port, protocol=2)
        reader = client.makefile("rb")
        try:
            while True:
                head = reader.readline()
                if not head:
                    return
                args = []
                for _ in range(int(head[1:])):
                    size = int(reader.readline()[1:])
                    args.append(reader.read(size + 2)[:-2])
                name = args[0].upper()
                if (
                    name in (b"EVALSHA", b"EVAL")
                    and len({key_slot(k) for k in args[3 : 3 + int(args[2])]}) > 1
                ):
                    self.refused += 1
                    client.sendall(CROSSSLOT)
                    continue
                upstream.send_command(*args)
                try:
                    reply = upstream.read_response()
                except redis.ResponseError as exc:
                    reply = exc
                client.sendall(_encode(reply))
        except OSError:
            return
        finally:
            upstream.disconnect()
            client.close()

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def proxy(redis_server: RedisProcess) -> Iterator[CrossSlotProxy]:
    running = CrossSlotProxy(redis_server)
    yield running
    running.close()


def two_clients(prefix: str, first_limit: int = 1) -> list[Check]:
    """A request's checks of two clients in two slots (a per-address limit beside a user's)."""
    checks = [
        Check(f"{prefix}:{{addr}}:g:fixed_window", "fixed_window", first_limit, 60),
        Check(f"{prefix}:{{user}}:r:fixed_window", "fixed_window", 5, 60),
    ]
    assert slot_of(checks[0].key) != slot_of(checks[1].key)
    return checks


NOW_US = 1_700_000_000_000_000


def test_the_proxy_refuses_a_call_across_slots_and_the_error_names_the_option(
    proxy: CrossSlotProxy,
) -> None:
    storage = from_url(proxy.url, timeout=2.0)
    with pytest.raises(StorageMisconfigured, match=r"CROSSSLOT.*split_slots=true"):
        storage.evaluate(two_clients("refused"), now_us=NOW_US)
    assert proxy.refused == 1
    storage.close()


def test_split_slots_makes_the_refusing_endpoint_work(proxy: CrossSlotProxy) -> None:
    storage = from_url(proxy.url + "?split_slots=true", timeout=2.0)
    assert isinstance(storage, RedisStorage) and storage.split_slots
    evaluation = storage.evaluate(two_clients("split"), now_us=NOW_US)
    assert evaluation.allowed and [d.remaining for d in evaluation.decisions] == [0, 4]
    assert not storage.evaluate(two_clients("split"), now_us=NOW_US).allowed
    assert proxy.refused == 0
    storage.close()


def test_a_group_that_denies_leaves_the_other_groups_uncharged(
    redis_server: RedisProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exact across groups on a real server: the request the per-address limit refuses costs
    the user's limit nothing (the group that admitted gives back); the groups go in one write,
    the refund in one more."""
    storage = RedisStorage(port=redis_server.port, timeout=2.0, split_slots=True)
    assert storage.pool is not None
    sends: list[Any] = []
    send = storage.pool.send
    monkeypatch.setattr(
        storage.pool, "send", lambda c, command: (sends.append(command), send(c, command))
    )
    checks = two_clients("exact")
    assert storage.evaluate(checks, now_us=NOW_US).allowed  # takes 1 of 1 and 1 of 5
    sends.clear()
    for _ in range(3):
        denied = storage.evaluate(checks, now_us=NOW_US)
        assert not denied.allowed
        assert denied.decisions[1].remaining == 4  # given back: still 4 of 5 left
    assert len(sends) == 3 * 2  # per request: both groups in one write, then the refund
    peek = storage.evaluate([Check(checks[1].key, "fixed_window", 5, 60, cost=0)], now_us=NOW_US)
    assert peek.decisions[0].remaining == 4  # the user's limit: 1 used, by the first request
    storage.close()


def test_a_request_of_one_slot_still_goes_in_a_batch(redis_server: RedisProcess) -> None:
    storage = RedisStorage(port=redis_server.port, timeout=2.0, split_slots=True)
    check = two_clients("one")[1]
    assert storage.evaluate([check, check.__class__(check.key + ":2", "gcra", 5, 60)]).allowed
    assert storage.pipeline.loaded  # went through the pipeline, as without the option
    storage.close()


def test_the_startup_check_names_the_option_and_passes_with_it(
    proxy: CrossSlotProxy, caplog: pytest.LogCaptureFixture
) -> None:
    app = Flask("refused")
    # the proxy is a thread of this process: the default 0.1 s may pass while it waits for the
    # GIL on a busy machine (a timeout, not the CROSSSLOT this test is about), as the others here
    slow = {"DISTLIMIT_STARTUP_CHECK": "error", "DISTLIMIT_REDIS_TIMEOUT": 2.0}
    app.config.update(DISTLIMIT_STORAGE_URL=proxy.url, **slow)
    with pytest.raises(StorageMisconfigured, match="split_slots=true"):
        Limiter(app)
    app = Flask("split")
    app.config.update(DISTLIMIT_STORAGE_URL=proxy.url + "?split_slots=true", **slow)
    with caplog.at_level(logging.WARNING):
        Limiter(app).state(app).storage.close()
    assert [r for r in caplog.records if "split_slots" in r.getMessage()] == []


@pytest.mark.parametrize(
    "url", ["redis://h?split_slots=maybe", "redis+cluster://h:1?split_slots=true"]
)
def test_split_slots_is_validated_with_the_url(url: str) -> None:
    with pytest.raises(ConfigurationError, match="split_slots"):
        from_url(url)
