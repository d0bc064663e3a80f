"""The local fallbacks of one guard: one, or one per node on a Redis Cluster.

On a ``routed`` storage each node engages and settles a fallback of its own, so a healthy shard's
keys are never counted locally because another shard failed. Made on first use and copied on
write under a lock: request threads read them without one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from flask_distlimit.core.decision import Check
from flask_distlimit.resilience.fallback import LocalFallback
from flask_distlimit.storage.base import Storage


class NodeFallbacks:
    """The fallbacks of one guard's ``storage``: one per node, as its :meth:`Storage.route
    <flask_distlimit.storage.base.Storage.route>` places checks, when it is ``routed``; ``new``
    makes each :class:`~flask_distlimit.resilience.fallback.LocalFallback`."""

    def __init__(self, new: Callable[[], LocalFallback], storage: Storage) -> None:
        self._new = new
        self._routed = storage.routed
        self._route = storage.route
        #: The fallback of a storage with one node (on a Cluster: of the checks of no node).
        self.default = self._new()
        # Copied on write (under _lock): request threads iterate it without a lock.
        self._by_node: dict[str, LocalFallback] = {}
        self._lock = threading.Lock()

    def of(self, node: str) -> LocalFallback:
        """The fallback of the checks that go to ``node`` (:attr:`default` but on a Cluster)."""
        if not self._routed:
            return self.default
        fallback = self._by_node.get(node)
        if fallback is None:
            with self._lock:
                fallback = self._by_node.get(node)
                if fallback is None:
                    fallback = self._new()
                    self._by_node = {**self._by_node, node: fallback}
        return fallback

    def split(
        self, checks: Sequence[Check], node_of: dict[int, str] | None = None
    ) -> dict[LocalFallback, list[int]]:
        """Indexes of ``checks`` by the fallback that counts each key (``node_of``: the checks
        to split, each with its node; default: all, as the storage routes them); one part,
        :attr:`default`'s, but on a Cluster."""
        if node_of is None:
            node_of = {i: node for node, found in self._route(checks) for i in found}
        parts: dict[LocalFallback, list[int]] = {}
        for i, node in node_of.items():
            # a fallback that counts the key already (its slot may have moved since: a replica
            # promoted in place of the dead primary knows nothing of the admissions decided
            # locally), else the node's
            key = checks[i].key
            counting = [f for f in self._by_node.values() if f.holding and f.covers(key)]
            parts.setdefault(counting[0] if counting else self.of(node), []).append(i)
        return parts

    def per_node_holding(self) -> bool:
        """Does any node's own fallback hold counts (never on the path of a healthy Cluster)?"""
        return any(f.holding for f in self._by_node.values())

    def all(self) -> list[LocalFallback]:
        """Every fallback: :attr:`default`, then each node's."""
        return [self.default, *self._by_node.values()]

    def after_fork(self) -> None:
        self._lock = threading.Lock()
        for fallback in self.all():
            fallback._after_fork()
