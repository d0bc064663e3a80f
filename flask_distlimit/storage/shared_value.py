"""The shared value of a deployment (``Storage.shared_value``): one small Lua script.

Atomically, in one round trip, it stores the value when the key is absent, sets the key's lifetime
(``0``: none, so no ``volatile-*`` policy evicts it) and answers the value stored. A read needs no
memory, so a full Redis still answers it; a key of another type is replaced; only commands of
:data:`~flask_distlimit.storage.translate.ACL_GRANTS`. Design: docs/design-notes.md, "The shared
value".
"""

from __future__ import annotations

from typing import Final

from flask_distlimit.engine.lua_source import lua_text

SHARED_VALUE_SOURCE: Final = lua_text(__package__, "shared_value.lua")
