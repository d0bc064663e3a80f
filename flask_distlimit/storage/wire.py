"""The hot path's one command on the wire: EVALSHA packed by hand, its reply read by hand.

redis-py packs every argument in pure Python (an ``isinstance`` ladder per argument) and reads a
reply through its buffered parser (a ``BytesIO``, ``readline``, then ``read``): about 8 us per
call on the development VM (``docs/bench/overhead.md``). Our call always has the same shape:
``EVALSHA <sha> <numkeys> <keys...> <one ARGV string>`` answered by ONE bulk string (or an error),
so both ends fit in a few lines:

- :func:`pack_evalsha` builds the RESP2 command in one ``bytes`` (the constant head is made once);
- :func:`read_bulk` reads exactly one reply from the connection's socket: a bulk string is
  returned as ``bytes`` (``None`` for a nil: ``$-1`` in RESP2, ``_`` in RESP3, redis-py 8's
  default), an error reply is raised as the exception redis-py would raise (``NoScriptError``
  for ``NOSCRIPT``, ...), anything else is a protocol error.

Only for connections redis-py's parser has no buffered bytes on: the single-node pool of a client
the storage built, where every reply is read whole (a failed read disconnects the connection, so
a desynchronised stream is never reused) and no RESP3 push can arrive (no pub/sub, no client
tracking on these connections). Sentinel connections keep redis-py's reader: it turns
``READONLY`` from a demoted master into a pool reset.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any, Final

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["EvalshaPacker", "read_bulk"]

#: recv size: a reply is one bulk string of 7 + 6n integers, far below this for any request.
_READ_SIZE: Final = 65536
#: The longest header line accepted before its CRLF ("$" and a length, or an error text).
_MAX_LINE: Final = 64 * 1024


class EvalshaPacker:
    """Packs ``EVALSHA sha numkeys key... arg...`` for one script as RESP2 bytes.

    ``encoding`` / ``errors`` are the connection's (redis-py's ``encoding`` and
    ``encoding_errors`` keywords), so keys are sent exactly as redis-py would send them.
    """

    __slots__ = ("_encoding", "_errors", "_head")

    def __init__(self, sha: str, *, encoding: str = "utf-8", errors: str = "strict") -> None:
        self._head = b"$7\r\nEVALSHA\r\n$%d\r\n%b\r\n" % (len(sha), sha.encode("ascii"))
        self._encoding = encoding
        self._errors = errors

    def pack(self, keys: Sequence[str], args: Sequence[str | int]) -> bytes:
        n = len(keys)
        count = str(n).encode("ascii")
        parts = [
            b"*%d\r\n" % (3 + n + len(args)),
            self._head,
            b"$%d\r\n%b\r\n" % (len(count), count),
        ]
        encoding, errors = self._encoding, self._errors
        for value in (*keys, *args):
            data = str(value).encode(encoding, errors)
            parts.append(b"$%d\r\n%b\r\n" % (len(data), data))
        return b"".join(parts)


def read_bulk(connection: Any) -> bytes | None:
    """Read one reply from ``connection``: a bulk string's bytes (``None`` for a nil).

    An error reply is raised as redis-py raises it (``connection._parser.parse_error``); the
    connection stays usable, the error having been read whole. A timeout raises redis-py's
    ``TimeoutError``, a closed or failing socket its ``ConnectionError``, any other reply type
    or a malformed one ``InvalidResponse``; in those three cases the connection is disconnected
    first (what is left in its socket is unknown).
    """
    try:
        return _read(connection)
    except (RedisTimeoutError, RedisConnectionError, InvalidResponse):
        connection.disconnect()
        raise


def _read(connection: Any) -> bytes | None:
    sock = connection._sock
    if sock is None:
        raise RedisConnectionError("Connection closed before the reply was read.")
    data = _recv(sock)
    while True:
        end = data.find(b"\r\n")
        if end >= 0:
            kind = data[:1]
            if kind == b"$":
                return _bulk(sock, data, end)
            if kind == b"_":  # RESP3 null
                if len(data) != 3:
                    raise InvalidResponse(f"Bad null reply: {data[:200]!r}")
                return None
            if kind == b"-":
                if len(data) != end + 2:
                    raise InvalidResponse(f"Bytes after an error reply: {data[:200]!r}")
                text = data[1:end].decode("utf-8", "replace")
                raise connection._parser.parse_error(text)
            raise InvalidResponse(f"Expected a bulk string or an error, got {data[:200]!r}")
        if len(data) > _MAX_LINE:
            raise InvalidResponse(f"No end of line in {len(data)} bytes: {data[:200]!r}")
        data += _recv(sock)


def _bulk(sock: socket.socket, data: bytes, end: int) -> bytes | None:
    try:
        size = int(data[1:end])
    except ValueError:
        raise InvalidResponse(f"Bad bulk string length: {data[:200]!r}") from None
    if size < 0:
        if size != -1 or len(data) != end + 2:
            raise InvalidResponse(f"Bad nil reply: {data[:200]!r}")
        return None
    total = end + 2 + size + 2
    while len(data) < total:
        data += _recv(sock)
    if len(data) != total or data[total - 2 : total] != b"\r\n":
        raise InvalidResponse(f"Malformed bulk string of {size} bytes: {data[:200]!r}")
    return data[end + 2 : total - 2]


def _recv(sock: socket.socket) -> bytes:
    try:
        data = sock.recv(_READ_SIZE)
    except TimeoutError:  # socket.timeout
        raise RedisTimeoutError("Timeout reading from socket") from None
    except OSError as exc:
        raise RedisConnectionError(f"Error while reading from socket: {exc.args}") from exc
    if not data:
        raise RedisConnectionError("Connection closed by server.")
    return data
