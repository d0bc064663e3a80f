"""The hot call's command as bytes: ``EVALSHA sha numkeys key... arg...``, packed per call.

:class:`EvalshaPacker` builds exactly the bytes of redis-py's public ``pack_command`` (tested byte
for byte), in the connection's own encoding, for ``send_packed_command``; redis-py reads the
replies. Design: docs/design-notes.md, "Packing the hot call".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_ASCII = "".join(map(chr, range(128)))


class EvalshaPacker:
    """Packs ``EVALSHA sha numkeys key... arg...`` for one script as RESP bytes."""

    __slots__ = ("_as_text", "_encoding", "_errors", "_head", "_text_head")

    def __init__(self, sha: str, *, encoding: str = "utf-8", errors: str = "strict") -> None:
        self._head = b"$7\r\nEVALSHA\r\n$%d\r\n%b\r\n" % (len(sha), sha.encode("ascii"))
        self._text_head = self._head.decode("ascii")
        self._encoding = encoding
        self._errors = errors
        #: the encoding writes ASCII text as itself (utf-8, latin-1...): ASCII values are
        #: framed as one string, encoded once
        self._as_text = _ASCII.encode(encoding, errors) == _ASCII.encode("ascii")

    @classmethod
    def of(cls, sha: str, connection: Mapping[str, Any]) -> EvalshaPacker:
        """The packer of script ``sha`` for connections made with the redis-py keywords
        ``connection`` (their ``encoding`` and ``encoding_errors``)."""
        return cls(
            sha,
            encoding=connection.get("encoding", "utf-8"),
            errors=connection.get("encoding_errors", "strict"),
        )

    def pack(
        self,
        keys: Sequence[str],
        args: Sequence[str | int],
        token: str | None = None,
        mark: str = "",
    ) -> bytes:
        """``keys`` then ``args``; with a request ``token`` (its key) and its ``mark`` (the
        argument that goes with it), the same bytes as ``with_token(keys, args, ...)`` would
        give (:func:`flask_distlimit.engine.scripts.with_token`), without building those lists."""
        extra = token is not None
        n = len(keys) + extra
        values = (*keys, token, *args, mark) if extra else (*keys, *args)
        if self._as_text:  # ASCII text values: one string, encoded once (a character a byte)
            body = f"*{3 + len(values)}\r\n{self._text_head}${len(str(n))}\r\n{n}\r\n"
            for value in values:
                if not isinstance(value, str):  # an int argument
                    break
                body += f"${len(value)}\r\n{value}\r\n"
            else:
                if body.isascii():
                    return body.encode("ascii")
        count = str(n).encode("ascii")
        parts = [
            b"*%d\r\n" % (3 + len(values)),
            self._head,
            b"$%d\r\n%b\r\n" % (len(count), count),
        ]
        encoding, errors = self._encoding, self._errors
        for value in values:
            data = str(value).encode(encoding, errors)
            parts.append(b"$%d\r\n%b\r\n" % (len(data), data))
        return b"".join(parts)
