"""A Redis client passed in: warn when redis-py would retry on it or wait past the timeout.

:func:`warn_if_client_retries` and :func:`warn_if_client_waits_long`, called by ``init_app``, log
one WARNING each naming the setting and the fix; redis-py's public API only (5.0 to 8.x); they
never raise. Design: docs/design-notes.md, "Clients passed in".
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.cluster import RedisCluster

from flask_distlimit.storage.base import Storage
from flask_distlimit.storage.cluster_nodes import ClusterNodes
from flask_distlimit.storage.redis import RedisStorage

_T = TypeVar("_T")

log = logging.getLogger(__name__)
#: The warning of :func:`warn_if_client_waits_long` (a logger of its own: another setting).
timeouts_log = logging.getLogger(f"{__name__}.timeouts")

_FIX_NODE = (
    "Build the client with retry=Retry(NoBackoff(), 0) (since redis-py 6, redis.Redis() "
    "retries unless told not to) and without retry_on_timeout or retry_on_error (from "
    "redis.retry import Retry; from redis.backoff import NoBackoff)"
)
_FIX_CLUSTER = (
    "Build the RedisCluster with retry=Retry(NoBackoff(), 0) (RedisCluster() retries unless "
    "told not to; from redis.retry import Retry; from redis.backoff import NoBackoff)"
)
_FIX_CLUSTER_5 = _FIX_CLUSTER + " and cluster_error_retry_attempts=0 (redis-py before 6)"
_OR_URL = (
    ", or give the limiter a URL (DISTLIMIT_STORAGE_URL, or flask_distlimit.storage.from_url) "
    "and let it build its own clients, which never retry and repeat a call whose reply was "
    "lost under a request token that cannot count it twice."
)


class _Probe(Exception):
    """The failure :func:`_retries` makes a ``Retry`` handle (redis-py 5)."""


def passed_client(storage: Storage) -> redis.Redis | RedisCluster | None:
    """The ready client ``storage`` was given, or ``None`` when it built its own (from a URL
    or connection keywords) or is not a Redis storage."""
    if isinstance(storage, RedisStorage):
        # the storage's own pool exists only on clients it built (Sentinel's included)
        return storage.client if storage.pool is None else None
    return storage.given_client if isinstance(storage, ClusterNodes) else None


def _read_passed_client(
    storage: Storage, read: Callable[[redis.Redis | RedisCluster], _T], failure: str
) -> tuple[redis.Redis | RedisCluster, _T] | None:
    """The client ``storage`` was given and what ``read`` says of it; ``None`` when it was given
    none, or when ``read`` fails (``failure`` logged at DEBUG): a warning never breaks an app's
    start."""
    client = passed_client(storage)
    if client is None:
        return None
    try:
        return client, read(client)
    except Exception:
        log.debug(failure, exc_info=True)
        return None


def client_retries(client: redis.Redis | RedisCluster) -> list[str]:
    """The settings that make ``client`` retry a command, each as it would be written; empty
    when it never retries. No I/O."""
    if isinstance(client, RedisCluster):
        found = []
        attempts = getattr(client, "cluster_error_retry_attempts", None)  # redis-py < 6
        if isinstance(attempts, int):
            if attempts != 0:
                found.append(f"cluster_error_retry_attempts={attempts}")
        else:
            count = _retries(client.retry)
            if count != 0:
                found.append(f"retry={_described(count)} (the whole command's retries)")
        nodes = client.get_nodes()
        if nodes:  # every node's connections are made alike: the first tells
            node_client = client.get_redis_connection(nodes[0])
            found += [f"{s} (its nodes' connections)" for s in client_retries(node_client)]
        return found
    # what makes its connections retry (redis-py's Connection): a retry if given, else
    # Retry(NoBackoff(), 1) when there are errors to retry on, else no retries
    kwargs = client.get_connection_kwargs()
    retry = kwargs.get("retry")
    errors = [getattr(e, "__name__", str(e)) for e in kwargs.get("retry_on_error") or ()]
    on = [f"retry_on_error=[{', '.join(errors)}]"] if errors else []
    if kwargs.get("retry_on_timeout"):
        on.append("retry_on_timeout=True")
    if retry is None:
        return [f"{s} (without retry=, redis-py retries once)" for s in on]
    count = _retries(retry)
    return [f"retry={_described(count)}", *on] if count != 0 else []


def _retries(retry: Any) -> int | None:
    """How many times ``retry`` (a redis-py ``Retry``) retries: -1 forever, ``None`` some
    number not 0 that redis-py 5 does not tell (module docstring)."""
    get_retries = getattr(retry, "get_retries", None)  # redis-py 6+
    if callable(get_retries):
        return int(get_retries())
    trial = copy.deepcopy(retry)  # what redis-py does with a Retry it is given
    trial.update_supported_errors([_Probe])
    tries = 0

    def fail_once() -> bool:
        nonlocal tries
        tries += 1
        if tries == 1:
            raise _Probe("the first try fails")
        return True

    try:
        trial.call_with_retry(fail_once, lambda error: None)
    except _Probe:
        return 0
    return None


def _described(count: int | None) -> str:
    if count is None:
        return "Retry(...), which retries (redis-py 5 does not tell how often)"
    if count < 0:
        return "Retry(...), which retries forever"
    return f"Retry(..., retries={count})"


def warn_if_client_retries(storage: Storage) -> None:
    """Log one WARNING when ``storage`` was given a client that retries (module docstring).
    Called by ``init_app``; never raises."""
    read = _read_passed_client(
        storage, client_retries, "Could not tell whether the Redis client passed in retries"
    )
    if read is None or not read[1]:
        return
    client, found = read
    if isinstance(client, RedisCluster):
        old = isinstance(getattr(client, "cluster_error_retry_attempts", None), int)
        fix = _FIX_CLUSTER_5 if old else _FIX_CLUSTER
        kind = "RedisCluster"
    else:
        fix, kind = _FIX_NODE, "Redis"
    log.warning(
        "The %s client passed to the rate limiter makes retries of its own: %s. A command it "
        "sends again after the reply was lost may have run already, so a request can be "
        "counted twice; and while Redis is down every request waits for the retries and their "
        "backoff until the circuit breaker opens. %s%s",
        kind,
        "; ".join(found),
        fix,
        _OR_URL,
    )


def client_read_timeout(client: redis.Redis | RedisCluster) -> float | None:
    """How long a single-node ``client`` waits for a reply, seconds (``socket_timeout``:
    ``None`` is forever, redis-py's default before 8.0; 5 from 8.0); ``0.0`` for a
    ``RedisCluster``, whose hot path waits by the storage's own deadline (module docstring).
    No I/O."""
    if isinstance(client, RedisCluster):
        return 0.0
    timeout = client.get_connection_kwargs().get("socket_timeout")
    return None if timeout is None else float(timeout)


def warn_if_client_waits_long(storage: Storage, budget: float) -> None:
    """Log one WARNING when ``storage`` was given a single-node client that waits for a reply
    longer than ``budget`` (``DISTLIMIT_REDIS_TIMEOUT``, seconds), or forever (module
    docstring). Called by ``init_app``; never raises."""
    read = _read_passed_client(
        storage, client_read_timeout, "Could not read the timeouts of the Redis client passed in"
    )
    if read is None:
        return
    timeout = read[1]
    if timeout is not None and timeout <= budget:
        return
    waits = "no socket_timeout" if timeout is None else f"socket_timeout={timeout:g}"
    until = (
        "until the operating system gives up"
        if timeout is None
        else f"{timeout:g} s (DISTLIMIT_REDIS_TIMEOUT is {budget:g} s)"
    )
    timeouts_log.warning(
        "The Redis client passed to the rate limiter has %s: a Redis that stalls (a paused "
        "process, a full network buffer, a host gone behind a firewall) holds every request "
        "%s until the circuit breaker opens (DISTLIMIT_REDIS_TIMEOUT does not reach a client "
        "passed in). Build it with socket_timeout=%g and socket_connect_timeout=%g (seconds), "
        "or give the limiter a URL (DISTLIMIT_STORAGE_URL) and let it build its own clients.",
        waits,
        until,
        budget,
        budget,
    )
