"""Storage keys: ``<prefix>:{<identity tag>}:<limit id>:<algorithm>``.

The identity is ``<kind>:<value>``, no kind's head beginning another's, so kinds never share a
bucket (docs/identity.md, "Key spaces"); the tag is its keyed digest
(:mod:`flask_distlimit.identity.digests`), so any value makes a well-formed key in one Cluster
slot per client. The algorithm ends the key: a changed algorithm never reads another's key.
"""

from __future__ import annotations

import hashlib
import re
from typing import Final

from flask import current_app, has_app_context

from flask_distlimit.core.algorithms import Algorithm
from flask_distlimit.identity.digests import IdentityTags

#: The head of every kind of identity text (see the module docstring).
IDENTITY_KINDS: Final = ("ip:", "user:", "jwt:", "apikey:", "func:")

_UNSAFE: Final = re.compile(r"[^A-Za-z0-9_.,;=/+\-]")
#: The most characters of a limit id in a key (a longer id ends in a digest of the whole).
_MAX_ID: Final = 200


def identity_tag(identity: str, tags: IdentityTags | None = None) -> str:
    """The tag of an identity text in keys (``"ip:203.0.113.9"`` -> 20 hex characters): a
    keyed digest (:mod:`flask_distlimit.identity.digests`), so it depends on the app.

    ``tags``: the app's :class:`~flask_distlimit.identity.digests.IdentityTags`
    (``limiter.state(app).tags``); by default the current app's, which needs an app context.
    """
    if tags is None:
        state = current_app.extensions.get("distlimit") if has_app_context() else None
        tags = getattr(state, "tags", None)
    if not isinstance(tags, IdentityTags):
        raise RuntimeError(
            "Identity tags are keyed per app, and there is no app with a Limiter here. Call "
            "this inside `with app.app_context():` of an app that called limiter.init_app(app), "
            "or pass tags=limiter.state(app).tags."
        )
    return tags.tag(identity)


def key_tag(key: str) -> str:
    """The hash tag of a storage key: the digest of who is counted, never the identity in
    clear (``""`` for a key without one)."""
    start = key.find("{")
    end = key.find("}", start + 1)
    return key[start + 1 : end] if 0 <= start < end else ""


def key_parts(prefix: str, limit_id: str, algorithm: Algorithm) -> tuple[str, str]:
    """``("<prefix>:{", "}:<limit id>:<algorithm>")``: a key is ``head + tag + tail``. A limit
    id over :data:`_MAX_ID` characters is cut before its rate: it ends in a digest of the whole
    (``=<16 hex>``), so two limits of a long endpoint never share a key."""
    safe = _UNSAFE.sub("_", limit_id)
    if len(safe) > _MAX_ID:
        digest = hashlib.blake2b(limit_id.encode("utf-8", "surrogatepass"), digest_size=8)
        safe = f"{safe[: _MAX_ID - 17]}={digest.hexdigest()}"
    return f"{prefix}:{{", f"}}:{safe}:{algorithm}"


def limit_key(
    prefix: str,
    identity: str,
    limit_id: str,
    algorithm: Algorithm,
    tags: IdentityTags | None = None,
) -> str:
    """The storage key of one limit for one client identity (``tags`` as in
    :func:`identity_tag`)."""
    head, tail = key_parts(prefix, limit_id, algorithm)
    return head + identity_tag(identity, tags) + tail


def client_pattern(prefix: str, identity: str, tags: IdentityTags | None = None) -> str:
    """A SCAN ``MATCH`` pattern for every key of one client (for inspect/reset)."""
    return f"{prefix}:{{{identity_tag(identity, tags)}}}:*"
