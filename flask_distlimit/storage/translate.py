"""redis-py exceptions translated into the project's error tree.

Misconfigurations become ``StorageMisconfigured`` naming the fix (:func:`misconfiguration`),
outages ``StorageUnavailable``, refused writes ``StorageFull`` (:func:`refused_write`: the
breaker does not count them), and anything else the server answers ``StorageResponseError``,
never an outage. Which reply is which: docs/design-notes.md, "What a storage error means".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, TypeVar

from redis import exceptions as rx
from redis.sentinel import MasterNotFoundError

from flask_distlimit.errors import (
    StorageError,
    StorageFull,
    StorageMisconfigured,
    StorageResponseError,
    StorageUnavailable,
)

#: What the limiter's ACL user needs, besides its keys (``~<DISTLIMIT_KEY_PREFIX>:*``): the
#: commands it sends (EVALSHA, SCRIPT LOAD when a script is missing, SCRIPT EXISTS and PING for
#: health, SCAN and DEL for resets), and those its scripts run inside Redis (PERSIST: the
#: identity digest key never expires, lua/shared_value.lua).
ACL_GRANTS: Final = (
    "+evalsha +script|load +script|exists +ping +scan +del +unlink +time +get +set +hset +hmget "
    "+pexpire +persist +lindex +llen +lpush +lrange +lset +ltrim +zadd +zcard +zcount "
    "+zrange +zrem +zremrangebyscore +zscore"
)

_T = TypeVar("_T")

#: What a storage catches around a Redis call and passes to :func:`storage_error`.
REDIS_FAILURES: Final[tuple[type[Exception], ...]] = (
    rx.RedisError,
    rx.RedisClusterException,
    rx.ChildDeadlockedError,
    OSError,
)

_OUTAGES: Final[tuple[type[BaseException], ...]] = (
    rx.ConnectionError,  # includes BusyLoadingError, MasterNotFoundError, MaxConnectionsError
    rx.TimeoutError,
    rx.ClusterError,  # ClusterDownError, MasterDownError, "TTL exhausted"
    rx.TryAgainError,
    rx.RedisClusterException,  # SlotNotCoveredError, "cannot connect to any node"
    rx.ReadOnlyError,
    rx.ChildDeadlockedError,
    rx.InvalidResponse,
    OSError,
)
_OUTAGE_CODES: Final = ("BUSY ", "MASTERDOWN", "CLUSTERDOWN", "LOADING", "NOREPLICAS")
#: What the server's refusal of a write says (redis-py strips the ``OOM`` code from its
#: ``OutOfMemoryError`` but keeps it in a script error that quotes the refusal).
_FULL_TEXTS: Final = ("command not allowed when used memory", "MISCONF ")


_CREDENTIALS: Final = (
    "Redis refuses the limiter's credentials ({answer}). Fix the user name and password in "
    "DISTLIMIT_STORAGE_URL: redis://<user>:<password>@host:6379/0, or "
    "redis://:<password>@host:6379/0 for the default user."
)
_PERMISSIONS: Final = (
    "Redis refuses the limiter's commands ({answer}). Grant its ACL user the commands and keys "
    f"it uses: ACL SETUSER <user> {ACL_GRANTS} ~<DISTLIMIT_KEY_PREFIX>:* (add +select for a "
    "database other than 0, +cluster|slots +cluster|info on Redis Cluster), or put such a "
    "user's credentials in DISTLIMIT_STORAGE_URL."
)
_DATABASE: Final = (
    "Redis refuses the database number of DISTLIMIT_STORAGE_URL ({answer}). Use one the server "
    "has, from 0 to its 'databases' setting minus 1 (16 by default): e.g. redis://host:6379/0."
)
_UNKNOWN_COMMAND: Final = (
    "Redis does not offer a command the limiter needs ({answer}): it is disabled or renamed "
    "(rename-command), or a proxy or managed service blocks it. The limiter sends EVALSHA and "
    "SCRIPT LOAD (Lua scripting), and its scripts run TIME and plain key, hash, list and "
    "sorted-set commands: allow them, or point DISTLIMIT_STORAGE_URL at a Redis that does."
)
_NOT_A_CLUSTER: Final = (
    "DISTLIMIT_STORAGE_URL names a Redis Cluster (redis+cluster://), but the server runs without "
    "cluster mode ({answer}). Use redis://host:6379/0 for a single server."
)
_SENTINEL_CREDENTIALS: Final = (
    "The Redis Sentinels refuse the limiter's credentials (they answered AuthenticationError). "
    "DISTLIMIT_STORAGE_URL's user name and password are sent to the Sentinels too: give the "
    "Sentinels' own as the query parameters sentinel_username and sentinel_password, or fix them."
)
_CROSS_SLOT: Final = (
    "Redis refuses a script call whose keys span hash slots ({answer}): DISTLIMIT_STORAGE_URL "
    "names one endpoint of a sharded database (a clustering proxy: Redis Enterprise or Cloud, "
    "an Enterprise tier of Azure). Add split_slots=true to its query (e.g. "
    "rediss://host:port/0?split_slots=true): one call per slot, all or nothing across them; "
    "or use its OSS Cluster API as redis+cluster://."
)
#: How deep :func:`misconfiguration` looks into the causes of a redis-py cluster error.
_MAX_CHAIN: Final = 5


def misconfiguration(exc: BaseException) -> str | None:
    """What is misconfigured, and how to fix it, when ``exc`` says the server refuses the
    limiter (see the module docstring); ``None`` for any other error.

    redis-py strips the error code it recognises from the text (``NOPERM``, ``WRONGPASS``,
    ``ERR``); redis-py 8 keeps it as ``status_code``, and the exception's type tells it too.
    """
    for _ in range(_MAX_CHAIN):
        found = _refusal(exc)
        inner = exc.__cause__ or exc.__context__
        if found is not None or inner is None or not isinstance(exc, rx.RedisClusterException):
            return found
        # The cluster client wraps the first node's error ("cannot be connected", "cluster
        # mode is not enabled"): the cause says what it was.
        exc = inner
    return None


def _refusal(exc: BaseException) -> str | None:
    text = str(exc)
    if isinstance(exc, MasterNotFoundError):
        return _SENTINEL_CREDENTIALS if "AuthenticationError" in text else None
    if (
        isinstance(exc, rx.RedisClusterException)
        and "Cluster mode is not enabled" in text
        and exc.__cause__ is None
        and exc.__context__ is None
    ):  # redis-py before 6 says only this; later ones chain the server's answer
        return _NOT_A_CLUSTER.format(answer=text)
    if not isinstance(exc, rx.AuthenticationError | rx.ResponseError):
        return None
    code = getattr(exc, "status_code", None)
    if not isinstance(code, str):  # redis-py before 8 keeps no code: the type and text tell it
        code = _code_of(exc, text)
    answer = f"{code} {text}" if code and not text.startswith(code) else text
    bare = text.removeprefix("ERR ")
    if (
        isinstance(exc, rx.AuthenticationError | rx.AuthenticationWrongNumberOfArgsError)
        or answer.startswith(("WRONGPASS", "NOAUTH"))
        or bare.startswith("invalid password")
    ):
        return _CREDENTIALS.format(answer=answer)
    if (
        isinstance(exc, rx.NoPermissionError)
        or answer.startswith("NOPERM")
        or "user executing the script can't" in text  # an ACL refusal inside a script
        or text.startswith("ACL failure in script")  # the same refusal, in Valkey 8's words
    ):
        return _PERMISSIONS.format(answer=answer)
    if bare.startswith("DB index is out of range"):
        return _DATABASE.format(answer=answer)
    if bare.startswith("unknown command") or "Unknown Redis command called from script" in text:
        # "..., with args beginning with: <keys and arguments>": not for a log line.
        return _UNKNOWN_COMMAND.format(answer=answer.split(", with args", 1)[0])
    if answer.startswith("CROSSSLOT") or isinstance(exc, rx.ClusterCrossSlotError):
        return _CROSS_SLOT.format(answer=answer)
    if "cluster support disabled" in bare:
        return _NOT_A_CLUSTER.format(answer=answer)
    return None


def _code_of(exc: BaseException, text: str) -> str | None:
    """The error code redis-py before 8 strips from a refusal's text (it maps ``WRONGPASS``
    and ``NOAUTH`` to ``AuthenticationError``, ``NOPERM`` to ``NoPermissionError``)."""
    if isinstance(exc, rx.NoPermissionError):
        return "NOPERM"
    if isinstance(exc, rx.AuthenticationError) and not isinstance(
        exc, rx.AuthenticationWrongNumberOfArgsError
    ):
        return "NOAUTH" if text.startswith("Authentication required") else "WRONGPASS"
    return None


def refused_write(exc: BaseException) -> bool:
    """Does ``exc`` say the server is up but refuses to write (out of memory, ``MISCONF``)?"""
    if isinstance(exc, rx.OutOfMemoryError):
        return True
    if not isinstance(exc, rx.ResponseError):
        return False
    text = str(exc)
    return text.startswith("OOM ") or any(t in text for t in _FULL_TEXTS)


def storage_error(exc: BaseException) -> StorageError:
    """The :class:`StorageError` to raise for an exception from redis-py (or the pool)."""
    if isinstance(exc, StorageError):
        return exc
    refused = misconfiguration(exc)
    if refused is not None:
        return StorageMisconfigured(refused)
    if refused_write(exc):
        text = " ".join(str(exc).split())
        if isinstance(exc, rx.OutOfMemoryError) and not text.startswith("OOM"):
            text = f"OOM {text}"  # the code redis-py strips
        return StorageFull(
            f"Redis refuses to write ({text}): it is out of memory under "
            "maxmemory-policy noeviction, or cannot persist (MISCONF). The limiter answers at "
            "each process's local share until it has room: raise maxmemory, or give the limiter "
            'a Redis of its own (docs/deployment.md, "Memory").'
        )
    if isinstance(exc, _OUTAGES):
        return StorageUnavailable(f"Redis is unavailable: {type(exc).__name__}: {exc}")
    if isinstance(exc, rx.ResponseError):
        text = str(exc)
        if text.startswith(_OUTAGE_CODES):
            return StorageUnavailable(f"Redis is unavailable: {text}")
        return StorageResponseError(
            f"Redis answered with an error (a script bug or bad data, not an outage): {text}"
        )
    return StorageResponseError(f"Redis client error: {type(exc).__name__}: {exc}")


def translated(call: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``call(*args, **kwargs)``; a redis-py failure raised as :func:`storage_error` of it."""
    try:
        return call(*args, **kwargs)
    except REDIS_FAILURES as exc:
        raise storage_error(exc) from exc
