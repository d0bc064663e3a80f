"""Leased units given back to the window they were taken in, and to no other: one Lua script.

Promises: units come off only while the server's window and the key's are both the one they were
taken in, at most the count, the key's TTL kept; made again under the same id
(:func:`give_back_call`) it takes nothing more; garbage is left to the limit script. KEYS and
ARGV: docs/design-notes.md, "Giving leased units back".
"""

from __future__ import annotations

import secrets
from typing import Final

from flask_distlimit.engine.common import US
from flask_distlimit.engine.lua_source import lua_text
from flask_distlimit.engine.registry import REGISTRY
from flask_distlimit.engine.scripts import token_key
from flask_distlimit.errors import StorageResponseError
from flask_distlimit.storage.base import GiveBack

#: The algorithms whose units are given back (those with a ``give_back_field`` in the registry),
#: by the limit script's code.
GIVE_BACK_CODES: Final[dict[str, int]] = {
    n: e.code for n, e in REGISTRY.items() if e.give_back_field
}
#: The script's table of the hash field each of those codes takes units off.
_FIELDS: Final = ", ".join(
    f"[{e.code}] = '{e.give_back_field}'" for e in REGISTRY.values() if e.give_back_field
)

#: How long at most a give-back's id keeps what it took off, ms (in GIVE_BACK_SOURCE): longer
#: than any repeat of the call (redis-py's backoff between its retries included).
ID_KEPT_MS: Final = 300_000

GIVE_BACK_SOURCE: Final = (
    lua_text(__package__, "give_back.lua")
    .replace("ID_KEPT_MS", str(ID_KEPT_MS))
    .replace("{FIELDS}", f"{{{_FIELDS}}}")
)


def give_back_call(back: GiveBack) -> tuple[list[str], list[int]]:
    """``KEYS`` and ``ARGV`` of one give-back: its key and a fresh id in its Cluster slot
    (docs/design-notes.md, "Given back once"), then its arguments (``now_us`` ``None``: the
    server's clock)."""
    now_us = -1 if back.now_us is None else back.now_us
    args = [GIVE_BACK_CODES[back.algorithm], back.period * US, back.window, back.units, now_us]
    return [back.key, token_key(back.key, f"gb.{secrets.token_hex(10)}")], args


def given_back(reply: object) -> int:
    """The units the script took off, or :class:`StorageResponseError` for another reply."""
    if not isinstance(reply, int):
        raise StorageResponseError(f"unexpected give-back reply {reply!r}")
    return reply
