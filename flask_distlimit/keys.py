"""Storage keys: ``<prefix>:{<identity tag>}:<limit id>:<algorithm>``.

- The identity tag is a digest of the client's identity, so braces, spaces, newlines or a 10 KB
  value cannot break a key or move it to another Redis Cluster slot; every key of one client sits
  in one slot (Redis hashes only the part between the first ``{`` and ``}``).
- The algorithm ends the key, so switching a limit's algorithm never reads a key of another type.
"""

from __future__ import annotations

import functools
import hashlib
import re
from typing import Final

from .algorithms import Algorithm

__all__ = ["client_pattern", "identity_tag", "limit_key"]

_UNSAFE: Final = re.compile(r"[^A-Za-z0-9_.,;=/+\-]")


#: Identities up to this length have their digest cached (most requests come from clients seen
#: before); longer ones (a key_func may return kilobytes) are hashed every time.
_CACHED_LENGTH: Final = 128


def identity_tag(identity: str) -> str:
    """A fixed-size, key-safe digest of an identity (``"ip:203.0.113.9"`` -> 20 hex chars)."""
    if len(identity) <= _CACHED_LENGTH:
        return _cached_tag(identity)
    return _digest(identity)


def _digest(identity: str) -> str:
    return hashlib.blake2b(identity.encode("utf-8", "surrogatepass"), digest_size=10).hexdigest()


_cached_tag: Final = functools.lru_cache(maxsize=4096)(_digest)


def _safe(part: str) -> str:
    return _UNSAFE.sub("_", part)[:200]


def limit_key(prefix: str, identity: str, limit_id: str, algorithm: Algorithm) -> str:
    """The storage key of one limit for one client identity."""
    return f"{prefix}:{{{identity_tag(identity)}}}:{_safe(limit_id)}:{algorithm}"


def client_pattern(prefix: str, identity: str) -> str:
    """A SCAN ``MATCH`` pattern for every key of one client (for inspect/reset)."""
    return f"{prefix}:{{{identity_tag(identity)}}}:*"
