"""Storage keys: ``<prefix>:{<identity tag>}:<limit id>:<algorithm>``.

- The identity is a text ``<kind>:<value>``; each kind of identity is a key space of its own:

  =========  ====================================================  ============================
  kind       identity text                                         from
  =========  ====================================================  ============================
  ``ip``     ``ip:203.0.113.9``, ``ip:2001:db8::/64``,              the client address
             ``ip:invalid``, ``ip:invalid-via:<proxy address>``
  ``user``   ``user:<id>``                                         the ``identity_loader``
  ``jwt``    ``jwt:sub:<subject>``, ``jwt:client_id:<id>``         a verified bearer token
  ``apikey`` ``apikey:<HMAC hex>``                                 a verified API key
  ``func``   ``func:<value>``                                      a limit's ``key_func``
  =========  ====================================================  ============================

  No kind's head (``ip:``, ``user:``, ...) begins another's, so two kinds never share a text,
  hence never a tag nor a bucket: a ``key_func`` that returns ``"ip:203.0.113.9"`` counts under
  ``func:ip:203.0.113.9``, never in that address's bucket.
- The identity tag is a digest of the identity text, so braces, spaces, newlines or a 10 KB
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

__all__ = ["IDENTITY_KINDS", "client_pattern", "identity_kind", "identity_tag", "limit_key"]

#: The head of every kind of identity text (see the module docstring).
IDENTITY_KINDS: Final = ("ip:", "user:", "jwt:", "apikey:", "func:")

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


def identity_kind(identity: str) -> str | None:
    """The kind of an identity text (``"ip"``, ``"user"``, ``"jwt"``, ``"apikey"``, ``"func"``),
    ``None`` when it names none."""
    for head in IDENTITY_KINDS:
        if identity.startswith(head):
            return head[:-1]
    return None


def _safe(part: str) -> str:
    return _UNSAFE.sub("_", part)[:200]


def limit_key(prefix: str, identity: str, limit_id: str, algorithm: Algorithm) -> str:
    """The storage key of one limit for one client identity."""
    return f"{prefix}:{{{identity_tag(identity)}}}:{_safe(limit_id)}:{algorithm}"


def client_pattern(prefix: str, identity: str) -> str:
    """A SCAN ``MATCH`` pattern for every key of one client (for inspect/reset)."""
    return f"{prefix}:{{{identity_tag(identity)}}}:*"
