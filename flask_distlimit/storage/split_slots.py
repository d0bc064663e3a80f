"""A request's slot groups on one endpoint that refuses ``CROSSSLOT`` (``split_slots``).

:func:`send_parts` sends one script call per group on one pooled connection, in one write, within
one Redis deadline: one round trip. A lost reply is repeated under its request token
(:mod:`.tokens`); ``NOSCRIPT`` loads the script and sends once more. It never raises a Redis
failure: it answers per call a reply, an error reply, or the failure that ended it.
:func:`send_whole` and :func:`read_or_repeat` serve the Cluster's calls too.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any, Final

import redis
from redis.exceptions import NoScriptError

from flask_distlimit.errors import StorageError
from flask_distlimit.storage.evalsha import EvalshaPacker
from flask_distlimit.storage.pool import LAST_LOOK, DeadlinePool
from flask_distlimit.storage.tokens import Made, RequestTokens, repeat_call
from flask_distlimit.storage.translate import REDIS_FAILURES

#: What :func:`outcome` answers instead of raising.
_ANSWERED: Final[tuple[type[Exception], ...]] = (*REDIS_FAILURES, StorageError)


def outcome(call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)``, or the Redis failure or :class:`StorageError` it raised."""
    try:
        return call(*args)
    except _ANSWERED as exc:
        return exc


def send_whole(
    pool: DeadlinePool, connection: Any, command: list[bytes], tokens: RequestTokens
) -> float:
    """Send ``command`` on ``connection``; when the send fails (Redis never had it whole: nothing
    ran), ``tokens`` are armed and it is sent once more on a fresh connection. Answers its Redis
    deadline, counted from when Redis has it."""
    try:
        pool.send(connection, command)
    except redis.ConnectionError:
        tokens.arm()
        pool.renew(connection, time.monotonic() + pool.timeout)
        pool.send(connection, command)
    return time.monotonic() + pool.timeout


def read_or_repeat(
    pool: DeadlinePool,
    connection: Any,
    packer: EvalshaPacker,
    tokens: RequestTokens,
    made: Made,
    deadline: float,
    lost: redis.ConnectionError | None = None,
) -> Any:
    """The reply to the call ``made`` just sent on ``connection``, read by ``deadline`` (at least
    a moment: the replies of other calls may be waiting in their sockets when one slow call has
    spent it). When the connection is closed under it (or was: ``lost``), the call is made again
    on it as a repeat of its token (one drawn now when it carried none), within the same deadline
    (:func:`~.tokens.repeat_call`)."""
    if lost is None:
        try:
            return pool.read(connection, max(deadline, time.monotonic() + LAST_LOOK))
        except redis.ConnectionError as exc:
            lost = exc
    again = tokens.repeat(packer, made)
    return repeat_call(pool, connection, again, deadline, lost, lambda c: pool.read(c, deadline))


def send_parts(
    pool: DeadlinePool,
    packer: EvalshaPacker,
    tokens: RequestTokens,
    load: Callable[[Any], bytes],
    made: list[Made],
    wait_until: float,
) -> list[Any]:
    """The reply to each call of ``made`` (module docstring); the wait for a connection ends by
    ``wait_until`` (the queue budget: then each call's reply is the pool's
    ``NoConnectionAvailable``); ``load`` packs the script's ``SCRIPT LOAD`` (the pipeline's)."""
    commands = [packer.pack(m.keys, m.args, m.token, tokens.first) for m in made]
    try:
        connection = pool.checkout(wait_until, probe=False)
    except REDIS_FAILURES as exc:
        return [exc] * len(made)
    replies: list[Any] = []
    lost: redis.ConnectionError | None = None
    try:
        deadline = send_whole(pool, connection, [b"".join(commands)], tokens)
        for call in made:
            if lost is None:
                try:
                    replies.append(pool.read(connection, deadline))
                    continue
                except redis.ResponseError as exc:  # read whole: the next is the next call's
                    replies.append(exc)
                    continue
                except redis.ConnectionError as exc:  # the calls from here may have run
                    lost = exc
            replies.append(
                outcome(read_or_repeat, pool, connection, packer, tokens, call, deadline, lost)
            )
        missing = [n for n, r in enumerate(replies) if isinstance(r, NoScriptError)]
        if missing:  # the script did not run: load it, those calls once more, in one write
            pool.send(connection, [load(connection) + b"".join([commands[n] for n in missing])])
            with contextlib.suppress(redis.ResponseError):  # else each call's reply tells it
                pool.read(connection, deadline)
            for n in missing:
                try:
                    replies[n] = pool.read(connection, deadline)
                except redis.ResponseError as exc:
                    replies[n] = exc
    except REDIS_FAILURES as exc:
        lost = lost or redis.ConnectionError(str(exc))
        # every call not answered (or not since its NOSCRIPT) ends with it
        replies = [exc if isinstance(r, NoScriptError) else r for r in replies]
        replies += [exc] * (len(made) - len(replies))
    except BaseException:
        pool.broken(connection)  # a reply may be left unread
        raise
    finally:
        if lost is not None:
            pool.broken(connection)  # renewed by repeats, or failed: nothing is known of it
        pool.release(connection)
    return replies
