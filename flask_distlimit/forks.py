"""What a forked child does again: the live objects of one kind, each reset in the child.

A worker forked from a master that already built the app (gunicorn's ``preload_app``, a
``multiprocessing`` fork, ``os.fork``) inherits its parent's connections, locks and counters.
Each kind of object that must not share them with the parent keeps an :class:`AfterFork` and
adds every instance to it; ``os.register_at_fork`` then resets each in the child. (uWSGI runs
these hooks only with ``lazy-apps`` or ``py-call-osafterfork``: docs/deployment.md.)
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["AfterFork"]

T = TypeVar("T")


class AfterFork(Generic[T]):
    """The live instances of one kind, ``reset(instance)`` for each in a forked child; held by
    weak reference, so being registered keeps none alive."""

    def __init__(self, reset: Callable[[T], None]) -> None:
        self._members: weakref.WeakSet[T] = weakref.WeakSet()
        self._reset = reset
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self.in_child)

    def add(self, member: T) -> None:
        self._members.add(member)

    def in_child(self) -> None:
        """What runs in a forked child (called by ``os.register_at_fork``)."""
        for member in list(self._members):
            self._reset(member)
