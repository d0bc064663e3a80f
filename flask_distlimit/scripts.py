"""The Lua side of the storage: the script source and its KEYS/ARGV/reply contract.

``lua/<algorithm>.lua`` each define the functions of one algorithm; ``lua/evaluate.lua`` is the
driver that evaluates every check of a request in two phases (decide all, then write all only if
all allow). :data:`SCRIPT_SOURCE` is their concatenation, registered once per Redis client with
``register_script`` (redis-py's ``Script`` re-sends it on ``NOSCRIPT``).

Every Redis backend (single node, Sentinel, each Cluster slot group) calls the script through
:func:`script_args` and :func:`parse_reply` only, so the wire contract lives in this one module.
"""

from __future__ import annotations

from collections.abc import Sequence

from .decision import Check, Evaluation

__all__ = ["SCRIPT_SOURCE", "parse_reply", "script_args"]

SCRIPT_SOURCE: str = ""  # filled by the engine: concatenated lua/*.lua, driver last


def script_args(
    checks: Sequence[Check], now_us: int | None = None, *, refund: bool = False
) -> tuple[list[str], list[str | int]]:
    """KEYS and ARGV for one script call over ``checks``.

    ``now_us`` injects the time (tests only); ``None`` makes the script use Redis ``TIME``.
    ``refund=True`` undoes a previous consumption of the same checks (Redis Cluster: when a group
    in another slot denied, the groups that consumed give their units back).
    """
    raise NotImplementedError


def parse_reply(reply: object, checks: Sequence[Check]) -> Evaluation:
    """Turn the script's reply into an :class:`Evaluation`.

    Raises :class:`~flask_distlimit.errors.StorageResponseError` for a reply of the wrong shape.
    """
    raise NotImplementedError
