"""The Lua side of the storage: the script source and its KEYS/ARGV/reply contract.

``lua/<algorithm>.lua`` each define the functions of one algorithm (``lua/common.lua`` holds their
helpers); ``lua/evaluate.lua`` is the driver that evaluates every check of a request in two phases
(decide all, then write all only if all allow). :data:`SCRIPT_SOURCE` is their concatenation,
registered once per Redis client with ``register_script`` (redis-py's ``Script`` re-sends it on
``NOSCRIPT``).

Every Redis backend (single node, Sentinel, each Cluster slot group) calls the script through
:func:`script_args` and :func:`parse_reply` only, so the wire contract lives in this one module:

- ``KEYS``: one key per check, in order.
- ``ARGV``: ``[now_us or -1, mode (0 evaluate, 1 refund)]`` then four integers per check:
  algorithm code (:data:`ALGORITHM_CODES`), limit, period in microseconds, cost.
- reply: ``[now_us]`` then six integers per check: allowed (0/1), limit, remaining,
  reset_after_us, retry_after_us (``-1`` = never), repaired (0/1).
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from typing import Final

from .algorithms import Algorithm
from .decision import NEVER, Check, Decision, Evaluation
from .errors import StorageResponseError

__all__ = ["ALGORITHM_CODES", "SCRIPT_SOURCE", "parse_reply", "script_args"]

#: The number each algorithm is sent as (``ARGV``); the order of ``ALGORITHMS`` in evaluate.lua.
ALGORITHM_CODES: Final[dict[Algorithm, int]] = {
    "fixed_window": 1,
    "sliding_window_log": 2,
    "sliding_window_counter": 3,
    "token_bucket": 4,
    "gcra": 5,
}

_FILES: Final = (
    "common.lua",
    "fixed_window.lua",
    "sliding_window_log.lua",
    "sliding_window_counter.lua",
    "token_bucket.lua",
    "gcra.lua",
    "evaluate.lua",  # the driver, last
)


def _read_source() -> str:
    package = resources.files("flask_distlimit") / "lua"
    return "\n".join((package / name).read_text(encoding="utf-8") for name in _FILES)


#: The whole script: the helpers and algorithms, then the driver.
SCRIPT_SOURCE: Final[str] = _read_source()

_US: Final = 1_000_000
_FIELDS: Final = 6


def script_args(
    checks: Sequence[Check], now_us: int | None = None, *, refund: bool = False
) -> tuple[list[str], list[str | int]]:
    """KEYS and ARGV for one script call over ``checks``.

    ``now_us`` injects the time (tests only); ``None`` makes the script use Redis ``TIME``.
    ``refund=True`` undoes a previous consumption of the same checks (Redis Cluster: when a group
    in another slot denied, the groups that consumed give their units back).
    """
    keys: list[str] = []
    argv: list[str | int] = [-1 if now_us is None else now_us, 1 if refund else 0]
    for check in checks:
        keys.append(check.key)
        argv += (ALGORITHM_CODES[check.algorithm], check.limit, check.period * _US, check.cost)
    return keys, argv


def parse_reply(reply: object, checks: Sequence[Check]) -> Evaluation:
    """Turn the script's reply into an :class:`Evaluation`.

    Raises :class:`~flask_distlimit.errors.StorageResponseError` for a reply of the wrong shape.
    """
    if (
        not isinstance(reply, list)
        or len(reply) != 1 + _FIELDS * len(checks)
        or not all(type(x) is int for x in reply)
    ):
        raise StorageResponseError(
            f"The rate-limit script answered {reply!r:.200}, not {1 + _FIELDS * len(checks)} "
            "integers: the script in Redis does not match this version of Flask-DistLimit. "
            "Run SCRIPT FLUSH on the Redis server (it is reloaded on the next request)."
        )
    decisions = []
    repaired: list[str] = []
    for i, check in enumerate(checks):
        j = 1 + _FIELDS * i
        allowed, limit, remaining, reset_us, retry_us, bad = reply[j : j + _FIELDS]
        decisions.append(
            Decision(
                allowed == 1,
                limit,
                remaining,
                reset_us / _US,
                NEVER if retry_us < 0 else retry_us / _US,
            )
        )
        if bad:
            repaired.append(check.key)
    return Evaluation(tuple(decisions), tuple(repaired))
