"""Request tokens: what makes a call safe to make again after its reply was lost.

Every hot call of the Redis storages (single node, Sentinel, each Cluster slot group) carries a
token (``lua/replay.lua``, :func:`flask_distlimit.scripts.with_token`): Redis keeps the call's
reply under the token's key for :attr:`RequestTokens.ttl_ms`, and the call made once more after
its connection was closed under it answers that kept reply when the first one ran. A token is
unique in the fleet: random per process (drawn again in a forked child), the process id, and a
counter.
"""

from __future__ import annotations

import itertools
import math
import os
import secrets
from typing import Final

from ..scripts import token_key

__all__ = ["TOKEN_TTL_MS", "RequestTokens"]

#: How long Redis keeps a call's reply for its retry, ms (at least twice the timeout).
TOKEN_TTL_MS: Final = 1000


class RequestTokens:
    """Hands out the token keys of one storage's calls; ``timeout`` is the call's deadline."""

    __slots__ = ("_count", "_prefix", "ttl_ms")

    def __init__(self, timeout: float) -> None:
        #: how long Redis keeps a reply: the retry comes within the same deadline
        self.ttl_ms = max(TOKEN_TTL_MS, math.ceil(2000 * timeout))
        self.reset()

    def reset(self) -> None:
        """Draw a new random prefix (in a forked child: its parent's counter is no longer
        unique) and start counting again."""
        self._prefix = f"{secrets.token_hex(6)}.{os.getpid()}."
        self._count = itertools.count()

    def key(self, first_key: str) -> str:
        """A new token's key, in the Cluster slot of ``first_key`` (a call's first key)."""
        return token_key(first_key, f"{self._prefix}{next(self._count)}")
