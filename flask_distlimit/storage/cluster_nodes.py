"""The Cluster storage's client and nodes: :class:`~.cluster.ClusterStorage` but its scripts.

Promises: the client never retries, sends no health-check PING and is built on first use (an
unreachable cluster fails requests, not start-up); :meth:`ClusterNodes.route` names each slot
group's primary without I/O. Design: docs/design-notes.md, "The Cluster's nodes".
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from flask_distlimit.core.decision import Check
from flask_distlimit.engine.scripts import SCRIPT_SOURCE
from flask_distlimit.storage.base import Route
from flask_distlimit.storage.evalsha import EvalshaPacker
from flask_distlimit.storage.pipeline import Pipeline, script_load
from flask_distlimit.storage.pool import DeadlinePool, queue_budget
from flask_distlimit.storage.redis import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_TIMEOUT,
    HANDSHAKE_FREE,
    connection_options,
)
from flask_distlimit.storage.side_calls import RedisSideCalls, SideScripts
from flask_distlimit.storage.slot_keys import by_slot
from flask_distlimit.storage.tokens import RequestTokens
from flask_distlimit.storage.translate import REDIS_FAILURES, translated

T = TypeVar("T")


class ClusterNodes(RedisSideCalls):
    """The client, nodes and pools of a Redis Cluster storage (module docstring); its script
    calls are :class:`~.cluster.ClusterStorage`'s."""

    scheme = "redis+cluster"
    routed = True

    def __init__(
        self,
        nodes: Sequence[tuple[str, int]] = (),
        *,
        client: RedisCluster | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        request_tokens: str = "auto",
        queue_timeout: float | None = None,
        **connection: Any,
    ) -> None:
        """``nodes``: startup nodes (any reachable node finds the others). ``connection``:
        redis-py connection keywords (``password``, ``ssl``, ...). ``client`` replaces all of
        them with a ready :class:`~redis.cluster.RedisCluster` (not closed by :meth:`close`).
        ``request_tokens``: ``"auto"`` or ``"always"`` (``DISTLIMIT_REQUEST_TOKENS``, module
        docstring). ``queue_timeout``: how long a call may wait for a pooled connection
        (:mod:`.pool`; default :func:`~.pool.queue_budget`)."""
        if client is None and not nodes:
            raise ValueError("ClusterStorage needs startup nodes or a RedisCluster client")
        self.timeout = timeout
        self.queue_timeout = queue_budget(timeout) if queue_timeout is None else queue_timeout
        self._nodes = [(str(h), int(p)) for h, p in nodes]
        #: The node a key's breaker is named for before the topology is known, or when it does
        #: not cover the key's slot: the first startup node.
        self._first_node = "{}:{}".format(*self._nodes[0]) if self._nodes else "cluster"
        self._max_connections = max_connections
        self._connection = connection
        #: The client passed in, ``None`` when built from ``nodes`` (init_app warns when it
        #: retries: :mod:`~flask_distlimit.storage.client_retries`).
        self.given_client = client
        self._lock = threading.Lock()
        self._client: RedisCluster | None = None
        self._scripts: SideScripts | None = None
        #: The hot path's pool of each primary (``host:port``), in the batches of its
        #: :mod:`.pipeline` (for one-group calls), built on first use.
        self._pipelines: dict[str, Pipeline] = {}
        self.tokens = RequestTokens(timeout, request_tokens)
        if client is not None:
            self._attach(client)

    # -- the client, built lazily (start-up must not need the cluster) ----------------------

    def _attach(self, client: RedisCluster) -> None:
        self._scripts = scripts = SideScripts(client)
        self._packer = EvalshaPacker.of(scripts.limit.sha, self._connection)
        self._client = client

    def _connect(self) -> RedisCluster:
        options = connection_options(self.timeout)
        options.pop("retry")  # RedisCluster sets its nodes' retries to 0 itself
        if not hasattr(Retry, "get_retries"):
            # redis-py < 6 retries the whole command this many times (3 by default), whatever
            # retry= says; from 6 it is retry's count, and this argument is deprecated
            options["cluster_error_retry_attempts"] = 0
        (first_host, first_port), *others = self._nodes
        if ":" in first_host:  # IPv6
            first_host = f"[{first_host}]"
        # A URL (not host=) makes RedisCluster build each node's pool by calling
        # connection_pool_class(**kwargs) (redis-py 5.0 to 8.x), so the pool's wait for a free
        # connection is bounded by the timeout too: redis-py before 8.0 drops timeout= on its
        # way to the nodes' pools, which would then wait 20 s (the calls off the hot path use
        # them: topology, PING, heartbeats, admin); a timeout it passes wins.
        # cast: redis-py 5.0 declares RedisCluster abstract (connection_pool), which it is not
        cluster: RedisCluster = cast(Any, RedisCluster)(
            url=f"redis://{first_host}:{first_port}",
            startup_nodes=[ClusterNode(h, p) for h, p in others],
            retry=Retry(NoBackoff(), 0),
            connection_pool_class=functools.partial(
                redis.BlockingConnectionPool, timeout=self.timeout
            ),
            max_connections=self._max_connections,
            **{**HANDSHAKE_FREE, **self._connection, **options, "timeout": self.timeout},
        )
        return cluster

    @property
    def client(self) -> RedisCluster:
        """The :class:`~redis.cluster.RedisCluster` (connects on first use)."""
        client = self._client
        if client is None:
            with self._lock:
                if self._client is None:
                    self._attach(translated(self._connect))
                client = self._client
                assert client is not None
        return client

    def _side(self) -> SideScripts:
        self.client  # noqa: B018 - connects and registers the scripts on first use
        assert self._scripts is not None
        return self._scripts

    def _same_slot(self, keys: list[str]) -> list[list[str]]:
        return [[keys[i] for i in group] for group in by_slot(keys)]

    def _primary_of(self, key: str) -> str | None:
        """The name (``host:port``) of the primary that serves ``key`` in the cached topology
        (:meth:`_topology`)."""
        node = self._topology(lambda c: c.get_node_from_key(key))
        return str(node.name) if node is not None else None

    def groups(self, checks: Sequence[Check]) -> list[list[int]]:
        """Indexes of ``checks`` grouped by hash slot, in order of first appearance."""
        return by_slot(c.key for c in checks)

    # -- nodes, for one breaker per primary (flask_distlimit.resilience.breakers)
    # ----------------------

    def node(self, refresh: bool = False) -> str:
        """The primary of slot 0 (the first startup node before the topology is known).

        ``refresh`` first reloads the slot map from the cluster (the guard asks for it, at most
        once a second, while a primary's breaker is open: a promoted replica then gets the
        slots, and a breaker of its own); a failure keeps the map it had."""
        client = self._client
        if refresh and client is not None:
            with contextlib.suppress(*REDIS_FAILURES):
                client.nodes_manager.initialize()
        return self._primary_of("") or self._first_node

    def nodes(self) -> frozenset[str] | None:
        """The primaries of the cached topology (``None`` before the client connected)."""
        return self._topology(lambda c: frozenset(str(n.name) for n in c.get_primaries()))

    def _topology(self, read: Callable[[RedisCluster], T]) -> T | None:
        """``read`` of the client's cached topology (no I/O); ``None`` before the client
        connected, or when the topology cannot answer (e.g. a slot it does not cover)."""
        client = self._client
        if client is None:
            return None
        try:
            return read(client)
        except REDIS_FAILURES:
            return None

    def route(self, checks: Sequence[Check]) -> list[Route]:
        """The slot groups (:meth:`groups`), each with the name of its primary (no I/O)."""
        first = self._first_node
        return [Route(self._primary_of(checks[g[0]].key) or first, g) for g in self.groups(checks)]

    def _pipeline_of(self, client: RedisCluster, node: ClusterNode) -> Pipeline:
        """The batches of ``node``'s hot-path pool: a :class:`~.pool.DeadlinePool` of
        connections made as redis-py makes that node's (its pool's public ``connection_class``
        and ``connection_kwargs``), so every wait of a call ends by the call's deadline."""
        name = str(node.name)
        pipeline = self._pipelines.get(name)
        if pipeline is None:
            stock = client.get_redis_connection(node).connection_pool
            with self._lock:
                pipeline = self._pipelines.get(name)
                if pipeline is None:
                    pool = DeadlinePool(
                        timeout=self.timeout,
                        queue_timeout=self.queue_timeout,
                        max_connections=self._max_connections,
                        connection_class=stock.connection_class,
                        **stock.connection_kwargs,
                    )
                    pipeline = self._pipelines[name] = Pipeline(
                        pool, load=script_load(SCRIPT_SOURCE), trouble=self.tokens.arm
                    )
        return pipeline

    def ping(self) -> float:
        client = self.client
        started = time.perf_counter()
        translated(client.ping, target_nodes=RedisCluster.PRIMARIES)
        return time.perf_counter() - started

    def _scanned(self) -> list[redis.Redis]:
        client = self.client
        return [client.get_redis_connection(node) for node in client.get_primaries()]

    def close(self) -> None:
        if self.given_client is None and self._client is not None:
            self._client.close()
            self._client = None
        for pipeline in list(self._pipelines.values()):
            pipeline.pool.disconnect()

    def reset_after_fork(self) -> None:
        """Forget the connections inherited from the parent (call in a forked child)."""
        self.tokens.reset()
        for pipeline in list(self._pipelines.values()):
            pipeline.pool.forget_inherited()
            pipeline.reset()
        client = self._client
        if client is None:
            return
        for node in client.get_nodes():
            if node.redis_connection is not None:
                node.redis_connection.connection_pool.reset()
