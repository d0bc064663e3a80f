"""Request tokens: what makes a call safe to make again after its reply was lost.

Every hot call of the Redis storages (single node, Sentinel, each Cluster slot group) carries a
token (``lua/replay.lua``, :func:`flask_distlimit.scripts.with_token`): Redis keeps the call's
reply under the token's key for :attr:`RequestTokens.ttl_ms`, and the call made once more after
its connection was closed under it answers that kept reply when the first one ran. A token is
unique in the fleet: random per process (drawn again in a forked child), the process id, and a
counter. A repeat is idempotent, so it may be made up to :data:`REPEATS` times within the call's
deadline (:func:`repeat_call`): a ``CLIENT KILL`` storm can cut a repeat too.
"""

from __future__ import annotations

import itertools
import math
import os
import secrets
from collections.abc import Callable
from typing import Any, Final

import redis

from ..errors import StorageReplyLost
from ..forks import AfterFork
from ..scripts import token_key
from .pool import DeadlinePool

__all__ = ["REPEATS", "TOKEN_TTL_MS", "RequestTokens", "repeat_call"]

#: How many times a call whose reply was lost is made again, within its deadline.
REPEATS: Final = 3

#: How long Redis keeps a call's reply for its retry, ms (at least twice the timeout).
TOKEN_TTL_MS: Final = 1000
#: First keys whose token heads are kept (a few hundred bytes each).
_HEADS_KEPT: Final = 1024


class RequestTokens:
    """Hands out the token keys of one storage's calls; ``timeout`` is the call's deadline."""

    __slots__ = ("__weakref__", "_count", "_heads", "_prefix", "again", "first", "ttl_ms")

    def __init__(self, timeout: float) -> None:
        #: how long Redis keeps a reply: the retry comes within the same deadline
        self.ttl_ms = max(TOKEN_TTL_MS, math.ceil(2000 * timeout))
        #: the argument that goes with the token on a first try and on a repeat
        #: (:func:`~flask_distlimit.scripts.with_token`)
        self.first = str(self.ttl_ms)
        self.again = f"{self.ttl_ms},1"
        self.reset()
        _every.add(self)  # reset in a forked child, whoever forks (not only the extension)

    def reset(self) -> None:
        """Draw a new random prefix (in a forked child: its parent's counter is no longer
        unique) and start counting again."""
        self._prefix = f"{secrets.token_hex(6)}.{os.getpid()}."
        self._count = itertools.count()
        #: first key -> its tokens' key up to the token itself (the same clients come back);
        #: emptied when full
        self._heads: dict[str, str] = {}

    def key(self, first_key: str) -> str:
        """A new token's key, in the Cluster slot of ``first_key`` (a call's first key)."""
        head = self._heads.get(first_key)
        if head is None:
            if len(self._heads) >= _HEADS_KEPT:
                self._heads.clear()
            head = self._heads[first_key] = token_key(first_key, "")
        return f"{head}{self._prefix}{next(self._count)}"


#: Every RequestTokens of this process: a forked child resets each (its parent's prefix and
#: counter would give the same tokens in both).
_every: AfterFork[RequestTokens] = AfterFork(RequestTokens.reset)


def repeat_call(
    pool: DeadlinePool,
    connection: Any,
    again: list[bytes],
    deadline: float,
    lost: redis.ConnectionError,
    read: Callable[[Any], Any],
) -> Any:
    """Make a call whose reply was lost (``lost``) again on ``connection``, reconnected: the
    packed repeat ``again`` (its token marked as a repeat), read by ``read(connection)``; up to
    :data:`REPEATS` times, all by ``deadline``.

    Lost every time: :class:`~flask_distlimit.errors.StorageReplyLost` when a fresh connection
    answers a ``PING`` (the store is up), else the last ``ConnectionError`` (an outage).
    """
    errors = [lost]
    for _ in range(REPEATS):
        try:
            pool.renew(connection, deadline)
            pool.send(connection, again, deadline)
            return read(connection)
        except redis.ConnectionError as exc:
            errors.append(exc)
    if pool.answers(deadline):
        raise StorageReplyLost(
            f"Redis closed the connection before replying, {len(errors)} times (last: "
            f"{errors[-1]}); it answers on a fresh one"
        ) from errors[-1]
    raise errors[-1]
