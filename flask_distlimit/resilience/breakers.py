"""One circuit breaker per storage node: a dead Cluster shard degrades only its own keys.

Promises: a known node's breaker is one dictionary read; breakers of nodes gone from the topology
are dropped, at most :data:`MAX_NODES` kept; :attr:`Breakers.state` is the worst node's state; a
call over several nodes asks each breaker once, and each hears once how its parts ended. Design:
docs/design-notes.md, "One breaker per node".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Final, NamedTuple

from flask_distlimit.core.decision import Evaluation
from flask_distlimit.errors import (
    StorageFull,
    StorageMisconfigured,
    StorageReplyLost,
    StorageResponseError,
    StorageUnavailable,
)
from flask_distlimit.resilience.breaker import Breaker, BreakerState

#: The node of a storage that has only one (single node, memory; Sentinel before it connected).
DEFAULT_NODE: Final = "redis"
#: At most this many breakers are kept (a Redis Cluster has at most a few hundred primaries).
MAX_NODES: Final = 1024

_RANK: Final[dict[str, int]] = {"closed": 0, "half-open": 1, "open": 2}


class Admitted(NamedTuple):
    """The answer of :meth:`Breakers.admit`: each node's breaker asked once."""

    trying: dict[str, Breaker]  #: the nodes to try, with their breakers
    blocked: set[str]  #: the nodes whose breaker refused the call


class Breakers:
    """The breakers of one guard, one per node, with shared settings.

    ``name`` is the guard's name: the breaker of :data:`DEFAULT_NODE` is called ``name`` (as the
    one breaker always was: logs and metric labels do not change for a single node), any other
    ``name@node``. ``on_change(breaker_name, state)`` is called after every transition and, with
    state ``None``, when a breaker is dropped. ``known`` answers the nodes the topology lists
    now (``None``: unknown, nothing is dropped for being absent). Each :class:`Breaker` checks
    the settings it is made with (:class:`GuardCore
    <flask_distlimit.resilience.guard_core.GuardCore>` makes its first when it is made).
    """

    def __init__(
        self,
        *,
        name: str,
        fail_max: int,
        reset_timeout: float,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[str, BreakerState | None], None] = lambda name, state: None,
        known: Callable[[], Collection[str] | None] = lambda: None,
        limit: int = MAX_NODES,
    ) -> None:
        self.name = name
        self.fail_max = fail_max
        self.reset_timeout = reset_timeout
        self._clock = clock
        self._on_change = on_change
        self._known = known
        self._limit = max(1, limit)
        self._lock = threading.Lock()
        self._by_node: dict[str, Breaker] = {}

    def breaker_name(self, node: str) -> str:
        return self.name if node == DEFAULT_NODE else f"{self.name}@{node}"

    def get(self, node: str) -> Breaker:
        """The breaker of ``node``, made (and the set pruned) when it is new."""
        breaker = self._by_node.get(node)
        if breaker is not None:
            return breaker
        self.prune()
        dropped: list[str] = []
        with self._lock:
            breaker = self._by_node.get(node)
            if breaker is not None:
                return breaker
            while len(self._by_node) >= self._limit:
                closed = [n for n, b in self._by_node.items() if b.state == "closed"]
                oldest = (closed or list(self._by_node))[0]
                del self._by_node[oldest]
                dropped.append(oldest)
            name = self.breaker_name(node)
            on_change = self._on_change
            breaker = Breaker(
                fail_max=self.fail_max,
                reset_timeout=self.reset_timeout,
                clock=self._clock,
                name=name,
                on_change=lambda s: on_change(name, s),
            )
            self._by_node[node] = breaker
        self._dropped(dropped)
        on_change(name, breaker.state)
        return breaker

    def admit(self, nodes: Iterable[str]) -> Admitted:
        """Ask each node's breaker once (:class:`Admitted`)."""
        trying: dict[str, Breaker] = {}
        blocked: set[str] = set()
        for node in nodes:
            if node in trying or node in blocked:
                continue  # one allow() per node and request: it may hand out the one trial
            breaker = self.get(node)
            if breaker.allow():
                trying[node] = breaker
            else:
                blocked.add(node)
        return Admitted(trying, blocked)

    def retain(self, nodes: Collection[str]) -> None:
        """Drop the breakers of every node not in ``nodes``."""
        with self._lock:
            gone = [n for n in self._by_node if n not in nodes]
            for node in gone:
                del self._by_node[node]
        self._dropped(gone)

    def prune(self) -> None:
        """Drop the breakers of nodes the storage's topology no longer lists."""
        known = self._known()
        if known is not None:
            self.retain(known)

    def _dropped(self, nodes: list[str]) -> None:
        for node in nodes:
            self._on_change(self.breaker_name(node), None)

    def states(self) -> dict[str, BreakerState]:
        """Each node's breaker state, by node name."""
        return {node: b.state for node, b in self.by_node().items()}

    def by_node(self) -> dict[str, Breaker]:
        """Each node's breaker, by node name (a copy)."""
        return dict(list(self._by_node.items()))

    @property
    def state(self) -> BreakerState:
        """The worst state of any node's breaker (``closed`` when there is none yet)."""
        breaker = worst(self.all())
        return "closed" if breaker is None else breaker.state

    def all(self) -> list[Breaker]:
        return list(self._by_node.values())

    def _after_fork(self) -> None:
        self._lock = threading.Lock()
        for breaker in self._by_node.values():
            breaker._after_fork()


def report_parts(
    trying: dict[str, Breaker],
    nodes: Sequence[str],
    results: Sequence[Evaluation | BaseException | None],
) -> list[StorageMisconfigured]:
    """Each node's breaker of ``trying`` (:meth:`Breakers.admit`) hears once how the parts sent
    to it (``nodes``, one per result; ``None`` or an evaluation: answered) ended: an outage if
    any of them met one, else an answer (an error reply, a lost reply and a refused write are
    answers: the node is up); a node that only met this process's load
    (:class:`~flask_distlimit.errors.StorageBusy`) or another exception, or was sent nothing,
    has its trial released. Answers the outages that are misconfigurations (to log)."""
    heard: dict[str, StorageUnavailable | None] = {}
    for node, result in zip(nodes, results, strict=True):
        if result is None or isinstance(
            result, Evaluation | StorageReplyLost | StorageFull | StorageResponseError
        ):
            heard.setdefault(node, None)
        elif isinstance(result, StorageUnavailable):
            heard[node] = result
    for node, breaker in trying.items():
        if node not in heard:
            breaker.release()
        elif (error := heard[node]) is None:
            breaker.success()
        else:
            breaker.failure(error)
    return [e for e in heard.values() if isinstance(e, StorageMisconfigured)]


def worst(breakers: Collection[Breaker]) -> Breaker | None:
    """The breaker in the worst state (open, then half-open, then closed); among equals, the
    one open longest, then the one with the most consecutive failures. ``None`` for none."""

    def badness(breaker: Breaker) -> tuple[int, float, int]:
        opened_for = breaker.opened_for()
        return (_RANK[breaker.state], -1.0 if opened_for is None else opened_for, breaker.failures)

    return max(breakers, key=badness, default=None)
