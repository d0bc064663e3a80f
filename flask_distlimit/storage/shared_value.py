"""The shared value of a deployment (``Storage.shared_value``): one small Lua script.

Atomically, in one round trip, it stores the value when the key is absent, sets the key's lifetime
(``0``: none, so no ``volatile-*`` policy evicts it) and answers the value stored. A read needs no
memory, so a full Redis still answers it; a key of another type is replaced; only commands of
:data:`~flask_distlimit.storage.translate.ACL_GRANTS`. Design: docs/design-notes.md, "The shared
value".
"""

from __future__ import annotations

from importlib import resources
from typing import Final

SHARED_VALUE_SOURCE: Final = (resources.files(__package__) / "lua" / "shared_value.lua").read_text(
    encoding="utf-8"
)
