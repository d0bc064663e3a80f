"""A key kept beside another in its Redis Cluster slot: a script's second key, e.g. the fleet
sizes beside the heartbeat (:mod:`.heartbeat`), the records beside the lease publishers
(:mod:`.lease_records`)."""

from __future__ import annotations

__all__ = ["beside"]


def beside(key: str, name: str, what: str) -> str:
    """The key ``name`` beside ``key`` in its slot: ``<key>:<name>`` when ``key`` has a hash tag
    of its own, else ``<key>:<name>:{<key>}`` (Redis then hashes ``<key>`` for both). A ``key``
    with a brace but no hash tag is a ``ValueError`` that calls it a ``what`` key."""
    start = key.find("{")
    if start != -1:
        end = key.find("}", start + 1)
        if end > start + 1:
            return f"{key}:{name}"
    if "{" in key or "}" in key:
        raise ValueError(f"{what} key {key!r} has a brace but no hash tag")
    return f"{key}:{name}:{{{key}}}"
