"""The rate-limit engine under test, on each backend: ``evaluate`` and the refund mode.

The Redis engines run the real Lua: ``evaluate`` through :class:`RedisStorage` (the production
path), ``refund`` through the same script in refund mode (what the cluster storage sends). To run
the vectors and properties on one more backend, add a name to :data:`ENGINE_PARAMS` and a branch
to :func:`make_engine`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import fakeredis
import pytest
import redis

from flask_distlimit.core.decision import Check, Evaluation
from flask_distlimit.engine.scripts import SCRIPT_SOURCE, parse_reply, script_args
from flask_distlimit.storage.memory import MemoryStorage
from flask_distlimit.storage.redis import RedisStorage


class Engine(Protocol):
    def evaluate(self, checks: Sequence[Check], *, now_us: int | None = None) -> Evaluation: ...

    def refund(self, checks: Sequence[Check], *, now_us: int | None = None) -> Evaluation: ...


class ScriptEngine:
    """The Lua script on a Redis client (real or fakeredis)."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.storage = RedisStorage(client)
        self._script = client.register_script(SCRIPT_SOURCE)

    def evaluate(self, checks: Sequence[Check], *, now_us: int | None = None) -> Evaluation:
        return self.storage.evaluate(checks, now_us=now_us)

    def refund(self, checks: Sequence[Check], *, now_us: int | None = None) -> Evaluation:
        keys, args = script_args(checks, now_us, refund=True)
        return parse_reply(self._script(keys, args), checks)


ENGINE_PARAMS = [
    pytest.param("memory", id="memory"),
    pytest.param("fakeredis", id="fakeredis"),
    pytest.param("redis", marks=pytest.mark.redis, id="redis"),
]


def make_engine(name: str, request: pytest.FixtureRequest) -> Engine:
    if name == "memory":
        return MemoryStorage(clock=lambda: 0)
    if name == "fakeredis":
        return ScriptEngine(fakeredis.FakeRedis())
    if name == "redis":
        return ScriptEngine(request.getfixturevalue("redis_client"))
    raise AssertionError(f"unknown engine {name!r}")


class NeverExpires(MemoryStorage):
    """The twin without expiry: keys live forever (as they do in Redis when the test pins them)."""

    def _get(self, key: str, now: int) -> object:  # type: ignore[override]
        return self._data.get(key)

    def _tick(self, now: int) -> None:
        pass

    def state_of(self, key: str) -> list[object]:
        """The entries of the log the twin holds under ``key`` ([] for none)."""
        entry = self._data.get(key)
        return entry.state if entry is not None and isinstance(entry.state, list) else []
