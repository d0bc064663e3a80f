"""Request tokens: what makes a call safe to make again after its reply was lost.

Redis keeps the reply of a call carrying a token for :attr:`RequestTokens.ttl_ms`; its repeat
(:func:`repeat_call`, at most :data:`REPEATS` within its deadline) answers that reply when the
first ran. Tokens are unique in the fleet. Which calls carry one: docs/design-notes.md,
"Request tokens".
"""

from __future__ import annotations

import itertools
import math
import os
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, NamedTuple

import redis

from flask_distlimit.core.decision import Check
from flask_distlimit.engine.scripts import script_args, token_key
from flask_distlimit.errors import ConfigurationError, StorageReplyLost
from flask_distlimit.forks import AfterFork
from flask_distlimit.storage.evalsha import EvalshaPacker
from flask_distlimit.storage.pool import DeadlinePool

#: How many times a call whose reply was lost is made again, within its deadline.
REPEATS: Final = 3

#: How long Redis keeps a call's reply for its retry, ms (at least twice the timeout).
TOKEN_TTL_MS: Final = 1000
#: How long, in seconds, every call carries a token after the storage's connections failed
#: (``DISTLIMIT_REQUEST_TOKENS = "auto"``): storms of closed connections come in bursts.
ARMED_FOR: Final = 60.0
#: The values of ``DISTLIMIT_REQUEST_TOKENS`` (module docstring).
TOKEN_MODES: Final = ("auto", "always")
#: First keys whose token heads are kept (a few hundred bytes each).
_HEADS_KEPT: Final = 1024


class Made(NamedTuple):
    """A script call to make: its KEYS, its ARGV and its request token's key (``None``: none)."""

    keys: list[str]
    args: list[str | int]
    token: str | None


def token_mode(mode: object) -> str:
    """``mode`` if it is one of :data:`TOKEN_MODES`, else a
    :class:`~flask_distlimit.errors.ConfigurationError` (a ``ValueError``) that says which."""
    if mode not in TOKEN_MODES:
        raise ConfigurationError(
            f"request_tokens = {mode!r} is not valid. Use one of: "
            + ", ".join(repr(m) for m in TOKEN_MODES)
            + " (DISTLIMIT_REQUEST_TOKENS)."
        )
    return str(mode)


class RequestTokens:
    """Hands out the token keys of one storage's calls; ``timeout`` is the call's deadline,
    ``mode`` one of :data:`TOKEN_MODES` (module docstring)."""

    def __init__(self, timeout: float, mode: str = "auto") -> None:
        self.mode = token_mode(mode)
        #: ``time.monotonic()`` until which every call carries a token (``inf``: ``"always"``)
        self.armed_until = math.inf if mode == "always" else -math.inf
        #: how long Redis keeps a reply: the retry comes within the same deadline
        self.ttl_ms = max(TOKEN_TTL_MS, math.ceil(2000 * timeout))
        #: the argument that goes with the token on a first try (a repeat's: :meth:`repeat`;
        #: :func:`~flask_distlimit.engine.scripts.with_token`)
        self.first = str(self.ttl_ms)
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

    def arm(self) -> None:
        """The storage's connections just failed: every call carries a token for the next
        :data:`ARMED_FOR` seconds (nothing changes under ``"always"``)."""
        if self.mode == "auto":
            self.armed_until = time.monotonic() + ARMED_FOR

    def needed(self, parts: Sequence[Sequence[Check]], *, now: float, refund: bool = False) -> bool:
        """Do the script calls over ``parts`` carry a request token at ``now``
        (``time.monotonic()``)? Yes while the tokens are armed, in a ``refund``, and when a call
        settles a reservation (gives a rate limit's units back, or charges a debt); a slot's
        release needs none: removing a token twice is once (module docstring)."""
        if refund or now < self.armed_until:
            return True
        for part in parts:  # loops, not any(): the hot path's every call asks
            for c in part:
                if c.debt or (c.release and not c.token):
                    return True
        return False

    def made(
        self, parts: Sequence[Sequence[Check]], now_us: int | None, *, refund: bool
    ) -> list[Made]:
        """The script call of each part (``refund``: giving back), every one with a token when
        they need one (:meth:`needed`)."""
        armed = self.needed(parts, now=time.monotonic(), refund=refund)
        calls = [script_args(part, now_us, refund=refund) for part in parts]
        return [Made(keys, args, self.key(keys[0]) if armed else None) for keys, args in calls]

    def repeat(self, packer: EvalshaPacker, made: Made) -> list[bytes]:
        """The call ``made`` whose reply was lost, packed as a repeat for :func:`repeat_call`,
        under its token (a new one when it carried none); the tokens are armed (connections
        fail)."""
        self.arm()
        token = self.key(made.keys[0]) if made.token is None else made.token
        return [packer.pack(made.keys, made.args, token, f"{self.ttl_ms},1")]

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
            pool.send(connection, again)
            return read(connection)
        except redis.ConnectionError as exc:
            errors.append(exc)
    if pool.answers(deadline):
        raise StorageReplyLost(
            f"Redis closed the connection before replying, {len(errors)} times (last: "
            f"{errors[-1]}); it answers on a fresh one"
        ) from errors[-1]
    raise errors[-1]
