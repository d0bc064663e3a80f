"""What ``init_app`` says about its Redis before the app serves: one probe, one line.

:func:`check_storage` makes a request's call (a cost-0 peek on two hash slots, writing nothing)
and, on a Cluster, asks each primary whether it covers every slot; a fault is one line naming the
masked URL and the fix, as ``DISTLIMIT_STARTUP_CHECK`` says. Bounded by
``DISTLIMIT_REDIS_TIMEOUT`` per call; fork-safe. Design: docs/design-notes.md, "The start-up probe".
"""

from __future__ import annotations

import logging
from typing import Any, Final, Literal, cast

from flask_distlimit.core.decision import Check
from flask_distlimit.errors import (
    StorageError,
    StorageMisconfigured,
    StorageResponseError,
    StorageUnavailable,
)
from flask_distlimit.storage.base import Storage
from flask_distlimit.storage.client_retries import client_read_timeout, passed_client
from flask_distlimit.storage.cluster_nodes import ClusterNodes
from flask_distlimit.storage.side_calls import RedisSideCalls
from flask_distlimit.storage.translate import REDIS_FAILURES, misconfiguration, storage_error
from flask_distlimit.storage.urls import mask_url

StartupCheck = Literal["warn", "error", "off"]
#: The values of ``DISTLIMIT_STARTUP_CHECK``.
STARTUP_CHECKS: Final[tuple[StartupCheck, ...]] = ("warn", "error", "off")

log = logging.getLogger(__name__)

_SLOTS: Final = 16384
#: The probe's hash tags: two slots (3773 and 10958).
_TAGS: Final = ("startup", "startup:slots")
#: What a call meeting a slot no primary serves is answered (redis-py's words too).
_CLUSTER_DOWN: Final = ("CLUSTERDOWN", "ClusterDownError", "slot not served", "SlotNotCovered")
_UNREACHABLE: Final = (
    "Check the host, port and scheme of DISTLIMIT_STORAGE_URL (rediss:// for TLS), that Redis "
    "runs, and that this host may reach it (firewall, security group); a Redis farther than "
    "DISTLIMIT_REDIS_TIMEOUT needs a larger one."
)
_SCRIPT_REFUSED: Final = (
    "The limiter needs Lua scripting (EVALSHA and SCRIPT LOAD of plain Lua, each call declaring "
    "its keys, all in one slot): docs/deployment.md, 'Managed services', says what each service "
    "needs."
)
_UNCOVERED: Final = (
    "Keys in the slots not served cannot be counted: their clients meet the failure policy. "
    "Assign every slot (redis-cli --cluster fix <host:port>) or wait for the failover to end."
)


def check_storage(
    storage: Storage,
    *,
    mode: StartupCheck,
    url: str | None,
    key_prefix: str,
    timeout: float,
    policy: str,
) -> bool:
    """Probe ``storage`` once (module docstring); warn, or raise the
    :class:`~flask_distlimit.errors.StorageError` found when ``mode`` is ``"error"``. Answers
    whether the probe was made and answered.

    ``url`` is the ``DISTLIMIT_STORAGE_URL`` the storage was built from (``None``: passed in),
    ``timeout`` the ``DISTLIMIT_REDIS_TIMEOUT``, ``policy`` the app's failure policy."""
    if mode == "off" or not isinstance(storage, RedisSideCalls):
        return False
    given = passed_client(storage)
    if given is not None:
        waits = client_read_timeout(given)
        if waits is None or waits > timeout:
            return False  # could stall the start: warned about by client_retries
    try:
        if isinstance(storage, ClusterNodes):  # first: the slots not served, by primary
            _check_slots(storage)
        # two keys of two slots, as a request's limits of two clients: an endpoint that
        # refuses CROSSSLOT says so now (unless split_slots splits them, as a Cluster does)
        storage.evaluate(
            [Check(f"{key_prefix}:{{{tag}}}:probe", "fixed_window", 1, 1, cost=0) for tag in _TAGS]
        )
    except StorageError as exc:
        where = mask_url(url) if url else f"{type(storage).__name__} (passed in)"
        line = f"Rate-limit storage {where} {_said(exc, timeout)}"
        if mode == "error":
            kind = type(exc) if type(exc) in _KINDS else StorageUnavailable
            raise kind(
                f"{line} (DISTLIMIT_STARTUP_CHECK = 'error': the app does not start; 'warn' "
                "starts it and logs this line instead.)"
            ) from exc
        log.warning(
            "%s Until it is fixed every request meets the failure policy (%r unless its route "
            "sets one). (DISTLIMIT_STARTUP_CHECK: 'error' refuses to start instead, 'off' "
            "skips this check.)",
            line,
            policy,
        )
        return False
    return True


_KINDS: Final = (StorageMisconfigured, StorageResponseError, StorageUnavailable)


def _said(exc: StorageError, timeout: float) -> str:
    """What the probe's failure says, with the fix, after the storage's name."""
    text = " ".join(str(exc).split()).rstrip(".")
    if isinstance(exc, StorageMisconfigured):
        return f"refuses the limiter at start-up: {text}."
    if isinstance(exc, StorageResponseError):
        return f"refuses the limiter's script at start-up: {text}. {_SCRIPT_REFUSED}"
    if isinstance(exc, _NotCovered) or any(t in text for t in _CLUSTER_DOWN):
        return f"does not serve every slot at start-up: {text}. {_UNCOVERED}"
    return (
        f"cannot be reached at start-up within DISTLIMIT_REDIS_TIMEOUT ({timeout:g} s): "
        f"{text}. {_UNREACHABLE}"
    )


class _NotCovered(StorageUnavailable):
    """A Cluster primary that does not serve every slot."""


def _check_slots(storage: ClusterNodes) -> None:
    """Raise :class:`_NotCovered` naming each primary whose ``CLUSTER INFO`` is not ``ok`` with
    every slot served; a user not allowed ``CLUSTER INFO`` is not checked."""
    client = storage.client
    bad = []
    for node in client.get_primaries():
        try:
            info: dict[str, Any] = cast(Any, client).cluster_info(target_nodes=node)
        except REDIS_FAILURES as exc:
            if misconfiguration(exc) is not None:
                return  # an ACL without CLUSTER INFO: the script's call was answered
            raise storage_error(exc) from exc
        state, served = info.get("cluster_state"), int(info.get("cluster_slots_ok", 0))
        if state != "ok" or served < _SLOTS:
            bad.append(
                f"{node.name} answers cluster_state:{state}, {served} of {_SLOTS} slots served"
            )
    if bad:
        raise _NotCovered("; ".join(bad))
