"""The hot call's command as bytes: ``EVALSHA sha numkeys key... arg...`` packed once per call.

redis-py's public ``Connection.pack_command`` packs any command in pure Python (an
``isinstance`` ladder per argument, a buffer of chunks): about 7 us per call here, where our
call always has the same shape. :class:`EvalshaPacker` builds the same RESP bytes (checked byte
for byte against ``pack_command`` in tests/test_redis_storage.py) in about 4 us, for
``send_packed_command`` (public). Encoding and its error handler are the connection's own
(redis-py's ``encoding`` / ``encoding_errors`` keywords). Replies are read by redis-py
(``read_response``).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["EvalshaPacker"]


class EvalshaPacker:
    """Packs ``EVALSHA sha numkeys key... arg...`` for one script as RESP bytes."""

    __slots__ = ("_encoding", "_errors", "_head")

    def __init__(self, sha: str, *, encoding: str = "utf-8", errors: str = "strict") -> None:
        self._head = b"$7\r\nEVALSHA\r\n$%d\r\n%b\r\n" % (len(sha), sha.encode("ascii"))
        self._encoding = encoding
        self._errors = errors

    def pack(
        self,
        keys: Sequence[str],
        args: Sequence[str | int],
        token: str | None = None,
        mark: str = "",
    ) -> bytes:
        """``keys`` then ``args``; with a request ``token`` (its key) and its ``mark`` (the
        argument that goes with it), the same bytes as ``with_token(keys, args, ...)`` would
        give (:func:`flask_distlimit.scripts.with_token`), without building those lists."""
        extra = token is not None
        n = len(keys) + extra
        count = str(n).encode("ascii")
        parts = [
            b"*%d\r\n" % (3 + n + len(args) + extra),
            self._head,
            b"$%d\r\n%b\r\n" % (len(count), count),
        ]
        encoding, errors = self._encoding, self._errors
        values = (*keys, token, *args, mark) if extra else (*keys, *args)
        for value in values:
            data = str(value).encode(encoding, errors)
            parts.append(b"$%d\r\n%b\r\n" % (len(data), data))
        return b"".join(parts)
