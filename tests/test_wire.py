"""The hand-packed EVALSHA and the hand-read reply (storage/wire.py), against redis-py and a real
redis-server: same bytes out, same values and exceptions back, and a connection that is
disconnected whenever what is left in its socket is unknown."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import redis
from redis import exceptions as rx

from flask_distlimit.decision import Check
from flask_distlimit.storage.redis import RedisStorage
from flask_distlimit.storage.wire import EvalshaPacker, read_bulk
from tests.servers import RedisProcess

SHA = "e0e1f9fabfc9d4800c877a703b823ac0578ff8db"


@pytest.mark.parametrize(
    ("keys", "args"),
    [
        (["ratelimit:{abc}:route:orders"], ["-1,0,1,100,60000000,1"]),
        (["a", "b{x}", "c d\r\n"], ["1,2", 7]),
        (["clé:{é}:ünïcode"], ["-1,0"]),
        ([], ["x" * 10_000]),
        (["k"] * 120, ["-1,0," + ",".join(["1,5,60000000,1"] * 120)]),
    ],
)
def test_pack_is_byte_for_byte_what_redis_py_sends(keys: list[str], args: list[str | int]) -> None:
    connection = redis.Connection()
    expected = b"".join(connection.pack_command("EVALSHA", SHA, len(keys), *keys, *args))
    assert EvalshaPacker(SHA).pack(keys, args) == expected


def test_pack_follows_the_connection_encoding() -> None:
    connection = redis.Connection(encoding="latin-1")
    expected = b"".join(connection.pack_command("EVALSHA", SHA, 1, "clé", "1"))
    assert EvalshaPacker(SHA, encoding="latin-1").pack(["clé"], ["1"]) == expected


def test_pack_refuses_what_the_encoding_cannot_say() -> None:
    with pytest.raises(UnicodeEncodeError):
        EvalshaPacker(SHA, encoding="ascii").pack(["clé"], ["1"])


# -- reading, against a real server -------------------------------------------------------------


@pytest.fixture
def connection(redis_server: RedisProcess) -> Iterator[redis.Connection]:
    conn = redis.Connection(host="127.0.0.1", port=redis_server.port, socket_timeout=0.5)
    conn.connect()
    yield conn
    conn.disconnect()


def _eval(connection: redis.Connection, source: str, *args: str) -> object:
    connection.send_command("EVAL", source, 0, *args)
    return read_bulk(connection)


def test_reads_a_bulk_string_and_stays_in_step(connection: redis.Connection) -> None:
    assert _eval(connection, "return ARGV[1]", "1700000000000000,1,100,99") == (
        b"1700000000000000,1,100,99"
    )
    assert _eval(connection, "return ''") == b""
    big = "7," * 100_000  # far more than one recv: read in pieces
    assert _eval(connection, "return ARGV[1]", big) == big.encode()
    assert _eval(connection, "return 'again'") == b"again"
    assert connection.is_connected


@pytest.mark.parametrize("protocol", [2, 3])
def test_reads_a_nil_in_either_protocol(redis_server: RedisProcess, protocol: int) -> None:
    conn = redis.Connection(host="127.0.0.1", port=redis_server.port, protocol=protocol)
    conn.connect()
    try:
        assert _eval(conn, "return nil") is None
        assert _eval(conn, "return 'next'") == b"next"
    finally:
        conn.disconnect()


def test_noscript_is_raised_as_redis_py_raises_it_and_the_connection_stays(
    connection: redis.Connection,
) -> None:
    connection.send_packed_command([EvalshaPacker("0" * 40).pack(["k"], ["1"])])
    with pytest.raises(rx.NoScriptError):
        read_bulk(connection)
    assert connection.is_connected
    assert _eval(connection, "return 'in step'") == b"in step"


def test_a_script_error_is_a_response_error(connection: redis.Connection) -> None:
    with pytest.raises(rx.ResponseError, match="distlimit: boom"):
        _eval(connection, "return redis.error_reply('ERR distlimit: boom')")
    assert _eval(connection, "return 'in step'") == b"in step"


@pytest.mark.parametrize(
    "source", ["return 5", "return {'a', 'b'}", "return redis.status_reply('OK')"]
)
def test_another_reply_type_is_invalid_and_disconnects(
    connection: redis.Connection, source: str
) -> None:
    with pytest.raises(rx.InvalidResponse):
        _eval(connection, source)
    assert not connection.is_connected


def test_a_stalled_server_times_out_and_disconnects(connection: redis.Connection) -> None:
    connection.send_command("EVAL", "return 'x'", 0)
    connection.read_response()
    # Nothing was sent: nothing comes back before the socket timeout.
    with pytest.raises(rx.TimeoutError):
        read_bulk(connection)
    assert not connection.is_connected


# -- reading what a server should never send (a socket pair plays the server) --------------------


class _Pair:
    """A connection-like object whose socket is one end of a socket pair."""

    def __init__(self, timeout: float = 0.5) -> None:
        self._sock, self.server = socket.socketpair()
        self._sock.settimeout(timeout)
        self._parser = redis.Connection()._parser
        self.disconnected = False

    def disconnect(self) -> None:
        self.disconnected = True

    def close(self) -> None:
        self._sock.close()
        self.server.close()


@pytest.fixture
def pair() -> Iterator[_Pair]:
    made = _Pair()
    yield made
    made.close()


@pytest.mark.parametrize(
    "reply",
    [
        b"$abc\r\nxyz\r\n",  # bad length
        b"$-2\r\n",  # a negative length that is not nil
        b"$3\r\nabcd\r\n",  # longer than announced
        b"$3\r\nabc\r\n+OK\r\n",  # bytes after the reply
        b"-ERR x\r\n+OK\r\n",  # bytes after an error
        b":12\r\n",
        b"*1\r\n$1\r\na\r\n",
    ],
)
def test_malformed_replies_are_invalid_and_disconnect(pair: _Pair, reply: bytes) -> None:
    pair.server.sendall(reply)
    with pytest.raises(rx.InvalidResponse):
        read_bulk(pair)
    assert pair.disconnected


def test_a_reply_split_over_many_packets_is_read_whole(pair: _Pair) -> None:
    pieces = [b"$", b"1", b"0\r", b"\n1700,1,", b"5,9\r", b"\n"]
    pair.server.sendall(b"".join(pieces[:1]))
    # recv returns what has arrived; send the rest byte by byte from here on demand.
    rest = b"".join(pieces[1:])
    real = pair._sock

    class Dribble:
        def recv(self, size: int) -> bytes:
            data = real.recv(1)
            if rest_buffer:
                pair.server.sendall(rest_buffer.pop(0))
            return data

    rest_buffer = [bytes([b]) for b in rest]
    pair._sock = Dribble()  # type: ignore[assignment]
    try:
        assert read_bulk(pair) == b"1700,1,5,9"
        assert not pair.disconnected
    finally:
        pair._sock = real


def test_a_closed_socket_is_a_connection_error(pair: _Pair) -> None:
    pair.server.sendall(b"$10\r\nabc")
    pair.server.close()
    with pytest.raises(rx.ConnectionError, match="closed by server"):
        read_bulk(pair)
    assert pair.disconnected


def test_an_endless_line_is_refused(pair: _Pair) -> None:
    pair.server.sendall(b"-" + b"x" * 70_000)
    with pytest.raises(rx.InvalidResponse, match="No end of line"):
        read_bulk(pair)
    assert pair.disconnected


# -- where the storage uses it ----------------------------------------------------------------


@pytest.mark.parametrize("protocol", [2, 3])
def test_the_storage_it_builds_uses_the_hand_path_in_either_protocol(
    redis_server: RedisProcess, redis_client: redis.Redis, protocol: int
) -> None:
    check = [Check("t:{w}:wire:fixed_window", "fixed_window", 3, 60)]
    lean = RedisStorage(host="127.0.0.1", port=redis_server.port, protocol=protocol)
    given = RedisStorage(redis_server.client(protocol=protocol))
    assert lean._packer is not None
    assert given._packer is None  # a client passed in keeps its own path
    # Both agree on the same key: 3 allowed, then denied, whichever path asks.
    allowed = [s.evaluate(check).allowed for s in (lean, given, lean, given)]
    assert allowed == [True, True, True, False]
    lean.close()
    given.client.close()
